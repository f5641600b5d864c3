"""te.checkpoint: recompute replays the forward bit for bit (FP8 scales, quantized weights, dropout)."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.parallel.random import CudaRNGStatesTracker, model_parallel_seed

HID, FFN, HEADS = 64, 128, 4


def _run(use_checkpoint: bool, recipe, device, steps=3):
    torch.manual_seed(0)
    tracker = CudaRNGStatesTracker(device=device)
    model_parallel_seed(tracker, 0, tp_rank=0)
    get_tracker = lambda: tracker  # noqa: E731
    layer = te.TransformerLayer(HID, FFN, HEADS, hidden_dropout=0.2, attention_dropout=0.2, device=device,
                                get_rng_state_tracker=get_tracker)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    outs = []
    for step in range(steps):
        x = torch.randn(16, 2, HID, device=device, requires_grad=True)
        with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            if use_checkpoint:
                y = te.checkpoint(layer, x, get_rng_state_tracker=get_tracker)
            else:
                y = layer(x)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, {k: v.clone() for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("recipe", [None, R.DelayedScaling(amax_history_len=4), R.Float8CurrentScaling()],
                         ids=["fp32", "delayed", "current"])
def test_checkpoint_bit_identical(recipe, device):
    plain, state_plain = _run(False, recipe, device)
    ckpt, state_ckpt = _run(True, recipe, device)
    for (y, dx, grads), (y2, dx2, grads2) in zip(plain, ckpt):
        assert torch.equal(y, y2) and torch.equal(dx, dx2)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    for k in state_plain:
        assert torch.equal(state_plain[k], state_ckpt[k]), k  # weights and FP8 scales/histories


def test_checkpoint_rejects_distributed_saved_activations():
    with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
        te.checkpoint(lambda t: t, torch.ones(2, requires_grad=True), distribute_saved_activations=True)
