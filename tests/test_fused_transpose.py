"""The FP8 operands' transposed copies come from the cast itself, not from a later pass.

wgrad needs xᵀ and dyᵀ, dgrad needs Wᵀ (cuBLASLt's FP8 "TN" rule). A training step of a single-rank
FP8 Linear must produce xᵀ and dyᵀ in the cast that makes the row-major bytes: a later
`Float8Tensor.transposed()` that has to build the copy is an extra read and write of the operand
(torch's strided copies cost 4.1 ms of a 16.9 ms step of the GPT layer (hidden 4096, ffn 16384,
32 heads, s2048 b4) on an H200 before this rule).
Wᵀ is made in backward, so that it does not sit in memory through the forward pass
(te_parallel/module/base.py): in a training step by casting the weight again straight into the
transposed layout (no late transpose), and from a kept FP8 W (explicit micro-batches, a weight cached
by inference) by the one-pass native transpose.
"""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe
from te_parallel.fp8.tensor import Float8Tensor


@pytest.fixture
def late_transposes(monkeypatch):
    """Shapes of the Float8Tensors whose transposed copy had to be made after their cast."""
    made = []
    original = Float8Tensor.transposed

    def counting(self):
        if self.data_t is None:
            made.append(tuple(self.data.shape))
        return original(self)

    monkeypatch.setattr(Float8Tensor, "transposed", counting)
    return made


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()], ids=["delayed", "current"])
def test_training_step_makes_no_late_transpose(rec, late_transposes, device):
    lin = te.Linear(64, 48, device=device)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=rec):
        y = lin(x)
    y.backward(torch.randn_like(y))
    assert x.grad is not None and lin.weight.grad is not None
    assert late_transposes == []  # Wᵀ too comes from a cast (the weight re-encoded in backward)


def test_layernorm_mlp_step_makes_no_late_transpose(late_transposes, device):
    mlp = te.LayerNormMLP(64, 128, device=device)
    x = torch.randn(16, 2, 64, device=device, requires_grad=True)
    with te.fp8_autocast():
        y = mlp(x)
    y.sum().backward()
    assert late_transposes == []
    with te.fp8_autocast():
        y = mlp(x, is_first_microbatch=True)  # a kept FP8 W: Wᵀ is its transpose
    y.sum().backward()
    assert sorted(late_transposes) == [(64, 128), (128, 64)]  # fc2's and fc1's Wᵀ only


def test_inference_skips_transposes(device, late_transposes):
    """Under no_grad neither Wᵀ nor xᵀ is made; a later training step makes Wᵀ when dgrad needs it."""
    lin = te.Linear(64, 48, device=device)
    x = torch.randn(32, 64, device=device)
    with torch.no_grad(), te.fp8_autocast():
        lin(x)
    cached = lin._weight_cache[0][1]
    assert cached.data_t is None
    xg = x.clone().requires_grad_()
    with te.fp8_autocast():
        y = lin(xg, is_first_microbatch=False)  # reuse the cached weight
    y.sum().backward()
    assert late_transposes == [(48, 64)]  # Wᵀ, made for dgrad
    assert cached.data_t is None  # ... and not kept in the cache: it lived as long as that backward


@pytest.mark.parametrize("microbatch", [None, True], ids=["reencoded", "kept"])
@pytest.mark.parametrize("rec", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()], ids=["delayed", "current"])
def test_backward_transpose_of_the_weight_is_exact(device, monkeypatch, rec, microbatch):
    """The Wᵀ that dgrad multiplies by holds the bytes of the forward's W, transposed, and its scale:
    re-encoded from the weight (training default) or transposed from the kept W. Delayed scaling
    moves the weight's scale at the autocast exit between the two (the snapshot must be used)."""
    from te_parallel.ops import fp8_gemm_config, gemm

    lin = te.Linear(64, 48, device=device)
    fwd, used = [], []
    quantize_weight, dgrad = fp8_gemm_config.GemmFP8.quantize_weight, gemm.dgrad

    def spy_weight(self, w, amax_group=None):
        fwd.append(quantize_weight(self, w, amax_group))
        return fwd[-1]

    def spy_dgrad(dy, w, out_dtype, **kw):
        used.append(w)
        return dgrad(dy, w, out_dtype, **kw)

    monkeypatch.setattr(fp8_gemm_config.GemmFP8, "quantize_weight", spy_weight)
    monkeypatch.setattr(gemm, "dgrad", spy_dgrad)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    for step in range(2):
        with te.fp8_autocast(fp8_recipe=rec):
            y = lin(x, is_first_microbatch=microbatch)
        if rec.delayed():
            slot = lin.fp8_state.weight_slot(0)
            assert not torch.equal(lin.fp8_state.fwd_scale[slot], fwd[-1].scale)  # moved on since the cast
        y.sum().backward()
        w, wt = fwd[-1], used[-1]
        assert torch.equal(wt.data_t.view(torch.uint8), w.data.t().contiguous().view(torch.uint8))
        assert torch.equal(wt.scale_inv, w.scale_inv)
        with torch.no_grad():
            lin.weight.mul_(1.5)  # the next step's weight and amax differ
    assert len(fwd) == 2 and len(used) == 2


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()], ids=["delayed", "current"])
def test_bias_gradient_from_the_cast(rec, device):
    """FP8 backward takes dbias from the dy cast: equal to the column sums of dy (fp32 accumulation)."""
    lin = te.Linear(64, 48, device=device)
    x = torch.randn(48, 64, device=device, requires_grad=True)
    dy = torch.randn(48, 48, device=device)
    with te.fp8_autocast(fp8_recipe=rec):
        y = lin(x)
    y.backward(dy)
    torch.testing.assert_close(lin.bias.grad.double(), dy.double().sum(0), rtol=1e-6, atol=1e-5)
