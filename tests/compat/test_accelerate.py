"""Hugging Face accelerate's Transformer Engine path through the compat package, on the CPU:
Accelerator(mixed_precision="fp8") with TE recipe kwargs converts the model's nn.Linear / nn.LayerNorm to
TE modules (te_parallel's), wraps forward in fp8_autocast, and trains; convert_model and
has_transformer_engine_layers work. (On the GPU the same path runs; accelerate's DeepSpeed/FSDP
variants of it are not covered here.)"""
from tests.compat import stand_in

stand_in.require()

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (.ci/install_clients.sh installs it)")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import FP8RecipeKwargs, TERecipeKwargs, convert_model, has_transformer_engine_layers  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from tests.compat.loop import train_steps  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16))


@pytest.mark.parametrize("handler", [TERecipeKwargs(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max"),
                                     FP8RecipeKwargs(backend="TE", fp8_format="E4M3", margin=1)],
                         ids=["TERecipeKwargs", "FP8RecipeKwargs"])
@pytest.mark.parametrize("tokens", [16, 8])
def test_accelerator_fp8_trains(handler, tokens):
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[handler])
    model = _model()
    model, opt = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))  # accelerate re-points opt
    assert has_transformer_engine_layers(model)
    assert isinstance(model[0], te.Linear) and isinstance(model[2], te.LayerNorm)
    x, y = torch.randn(tokens, 32), torch.randn(tokens, 16)
    losses = train_steps(model, acc.backward, opt, x, y, 6)
    assert losses[-1] < 0.8 * losses[0], losses
    assert model[0].fp8_state.updates()[0] == 6  # every step ran in FP8 (delayed scaling updated its scales)
    assert model[0].fp8 and model[0].fp8_meta["recipe"].amax_history_len == (16 if "amax_history_len" in handler.to_kwargs() else 1024)


def test_convert_model_and_layer_check():
    Accelerator(cpu=True)  # accelerate's helpers need its state
    model = _model()
    ref = [p.detach().clone() for p in model.parameters()]
    assert not has_transformer_engine_layers(model)
    with torch.no_grad():
        convert_model(model)
    assert has_transformer_engine_layers(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, model.parameters()))
    x = torch.randn(8, 32)
    with te.fp8_autocast(enabled=True):
        y = model(x)
    y.sum().backward()
    assert model[3].weight.grad is not None


def test_mxfp8_is_reported_unavailable():
    from accelerate.utils import is_transformer_engine_mxfp8_available

    assert is_transformer_engine_mxfp8_available() is False
