"""TE 2.x names and keywords on te_parallel's own API: normalized_shape on the norms, te.autocast beside
fp8_autocast, LayerNormMLP(checkpoint=True)."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R


@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
def test_normalized_shape(cls):
    for m in (cls(normalized_shape=24, device="cpu"), cls(normalized_shape=[24], device="cpu"), cls(24, device="cpu"),
              cls(hidden_size=24, normalized_shape=(24,), device="cpu")):
        assert m.normalized_shape == (24,) and m.weight.shape == (24,)
    with pytest.raises(ValueError, match="last dim only"):
        cls(normalized_shape=(4, 6), device="cpu")
    with pytest.raises(ValueError, match="disagree"):
        cls(hidden_size=8, normalized_shape=24, device="cpu")
    with pytest.raises(TypeError, match="normalized_shape"):
        cls(device="cpu")


def test_autocast_is_fp8_autocast_with_tes_new_argument_names():
    torch.manual_seed(0)
    a, b = te.Linear(32, 32, device="cpu"), te.Linear(32, 32, device="cpu")
    b.load_state_dict(a.state_dict())
    x, r = torch.randn(16, 32), R.DelayedScaling(amax_history_len=4)
    for _ in range(2):
        with te.fp8_autocast(fp8_recipe=r, fp8_group=None):
            ya = a(x)
        with te.autocast(enabled=True, recipe=r, amax_reduction_group=None):
            yb = b(x)
        ya.sum().backward()
        yb.sum().backward()
    assert torch.equal(ya, yb) and torch.equal(a.fp8_state.fwd_scale, b.fp8_state.fwd_scale)


@pytest.mark.parametrize("recipe", [R.DelayedScaling(amax_history_len=4), R.Float8CurrentScaling(), None])
def test_layernorm_mlp_checkpoint_is_bit_identical(recipe):
    torch.manual_seed(0)
    plain = te.LayerNormMLP(32, 64, activation="swiglu", device="cpu")
    recomputed = te.LayerNormMLP(32, 64, activation="swiglu", device="cpu", checkpoint=True)
    recomputed.load_state_dict(plain.state_dict())
    x = torch.randn(16, 2, 32)
    results = []
    for m in (plain, recomputed):
        for _ in range(2):
            xi = x.clone().requires_grad_(True)
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                out = m(xi)
            out.square().sum().backward()
        results.append((out, xi.grad, m.fc1_weight.grad, m.fc2_weight.grad, m.layer_norm_weight.grad))
    assert all(torch.equal(p, q) for p, q in zip(*results))


def _returned_bias_grads(rank, world, device):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    got = {}
    for reduce in (True, False):
        torch.manual_seed(0)
        m = te.Linear(32, 16, parallel_mode="row", sequence_parallel=True, return_bias=True, tp_group=group,
                      allreduce_sp_grads=reduce, device=device)
        x = torch.randn(8, 2, 32 // world, device=device)  # this rank's input features
        out, bias = m(x)
        (out + bias).sum().backward()
        got[reduce] = m.bias.grad.clone()
    local = torch.full((16,), 8 // world * 2.0)  # this rank's tokens: 8/world × batch 2, each adds dy = 1
    assert torch.equal(got[False].cpu(), local), got[False]
    assert torch.equal(got[True].cpu(), local * world), got[True]
    assert getattr(m.bias, "sequence_parallel", False)  # the marker a caller reduces by
    for reduce in (True, False):  # the same with the bias added inside the layer (return_bias=False)
        torch.manual_seed(0)
        m = te.Linear(32, 16, parallel_mode="row", sequence_parallel=True, tp_group=group,
                      allreduce_sp_grads=reduce, device=device)
        m(torch.randn(8, 2, 32 // world, device=device)).sum().backward()
        assert torch.equal(m.bias.grad.cpu(), local * world if reduce else local), (reduce, m.bias.grad)


def test_linear_allreduce_sp_grads_controls_the_returned_bias():
    """Row-parallel, sequence-parallel, the bias returned or added inside: its gradient is summed over the
    TP group here (te_parallel's default) or left partial and marked for the caller (False, TE's behaviour)."""
    from tests.distributed.harness import spawn

    spawn(_returned_bias_grads, 2)
