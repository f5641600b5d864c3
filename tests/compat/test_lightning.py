"""Lightning's Transformer Engine precision plugins through the compat package, on the CPU: Fabric and
Trainer with precision="transformer-engine" (bf16 weights) and "transformer-engine-float16" replace
nn.Linear / nn.LayerNorm with TE modules and train under fp8_autocast."""
from tests.compat import stand_in

stand_in.require()

import pytest
import torch

L = pytest.importorskip("lightning", reason="lightning is not installed (.ci/install_clients.sh installs it)")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision.transformer_engine import TransformerEnginePrecision  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from tests.compat.loop import train_steps  # noqa: E402


def _net():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16))


@pytest.mark.filterwarnings("ignore:.*CUDA is not available.*")
@pytest.mark.parametrize("precision", ["transformer-engine", "transformer-engine-float16"])
def test_fabric_trains(precision):
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = fabric.setup_module(_net())  # replaces the layers: make the optimizer afterwards (as with NVIDIA's TE)
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4))  # eps: fp16 weights
    inner = model.module
    assert isinstance(inner[0], te.Linear) and isinstance(inner[2], te.LayerNorm)
    assert "transformer_engine.pytorch" in inner[0].__module__  # Lightning's "already converted" test
    x, y = torch.randn(8, 32), torch.randn(8, 16)  # 8 tokens: TE's minimum step
    losses = train_steps(model, fabric.backward, opt, x, y, 8)
    assert losses[-1] < 0.8 * losses[0], losses
    assert inner[0].fp8_state.updates()[0] == 8


def test_already_converted_model_is_left_alone():
    plugin = TransformerEnginePrecision(weights_dtype=torch.float32, replace_layers=True)
    model = torch.nn.Sequential(te.Linear(32, 32, device="cpu"), torch.nn.Linear(32, 32))
    out = plugin.convert_module(model)
    assert type(out[1]) is torch.nn.Linear  # a TE module is present: Lightning converts nothing


def test_recipe_as_a_dict():
    plugin = TransformerEnginePrecision(weights_dtype=torch.bfloat16,
                                        recipe={"fp8_format": "HYBRID", "amax_history_len": 8, "margin": 1})
    assert plugin.recipe.amax_history_len == 8 and plugin.recipe.margin == 1


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _net()
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_trains():
    torch.manual_seed(0)
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.repeat(8, 1), y.repeat(8, 1)), batch_size=16)
    module = _Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="transformer-engine", max_steps=8, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    assert isinstance(module.net[0], te.Linear)
    assert module.losses[-1] < 0.8 * module.losses[0], module.losses
    assert module.net[0].fp8_state.updates()[0] == 8
