"""The dropout kernel (te_parallel.ops.dropout): its mask against a Philox4x32-10 written here in plain
Python, out = residual + x·mask/(1 - p) rounded once, the backward's regenerated mask, the keep rate,
the generator's seed and offset (repeatable runs, an RNG tracker's stream), and TransformerLayer's
dropout + residual through it: output and gradients bit for bit against torch's autograd with the same
masks, and no mask kept between forward and backward."""
import math

import pytest
import torch

import te_parallel as te
from te_parallel import native
from te_parallel.native import dropout as native_dropout
from te_parallel.ops import dropout as dropout_ops

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not native.available():
    pytest.skip("te_parallel._C is absent (built without nvcc)", allow_module_level=True)

M32 = 0xFFFFFFFF


def _philox(seed: int, counter: int, offset: int):
    """Philox4x32-10: key = seed, counter words = (counter low, high, offset low, high). (Random123's
    known answer for counter 0, key 0 starts 0x6627e8d5, 0xe169c58d: what this gives.)"""
    c = [counter & M32, counter >> 32, offset & M32, offset >> 32]
    k0, k1 = seed & M32, seed >> 32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c[3] ^ k1) & M32, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


def _scale(p: float) -> float:
    """1 / (1 - p) as the kernel computes it, in fp32."""
    return (torch.tensor(1.0) / (torch.tensor(1.0) - torch.tensor(p))).item()


def _mask(n: int, p: float, seed: int, offset: int) -> torch.Tensor:
    threshold = native.load().dropout_keep_threshold(p)
    words = [w for g in range((n + 3) // 4) for w in _philox(seed, g, offset)][:n]
    return torch.tensor([w < threshold for w in words], device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 8, 1003], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "alone"])
def test_kernel_matches_philox_reference(dtype, n, residual):
    torch.manual_seed(0)
    p, seed, offset = 0.3, 0x1234_5678_9ABC, 40
    x = torch.randn(n, device="cuda", dtype=dtype)
    r = torch.randn(n, device="cuda", dtype=dtype) if residual else None
    m = _mask(n, p, seed, offset)
    got = native_dropout.dropout_add(x, r, p, seed, offset)
    want = torch.where(m, x.float() * _scale(p), 0.0) + (0.0 if r is None else r.float())
    assert torch.equal(got, want.to(dtype))
    # the backward's call (x = gradient, no residual) regenerates the same mask
    g = torch.randn(n, device="cuda", dtype=dtype)
    assert torch.equal(native_dropout.dropout_add(g, None, p, seed, offset),
                       torch.where(m, g.float() * _scale(p), 0.0).to(dtype))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_fresh_masks(p):
    n = 1 << 22
    x, r = torch.ones(n, device="cuda"), torch.zeros(n, device="cuda")
    torch.manual_seed(3)
    a = dropout_ops.dropout_add(x, r, p) != 0
    b = dropout_ops.dropout_add(x, r, p) != 0
    sigma = math.sqrt(n * p * (1 - p))
    for m in (a, b):
        assert abs(m.sum().item() - n * (1 - p)) < 6 * sigma
    assert not torch.equal(a, b)  # each call draws a new offset
    both = (a & b).sum().item()  # independent masks: both kept with probability (1 - p)^2
    assert abs(both - n * (1 - p) ** 2) < 6 * math.sqrt(n * (1 - p) ** 2 * (1 - (1 - p) ** 2))
    torch.manual_seed(3)
    assert torch.equal(dropout_ops.dropout_add(x, r, p) != 0, a)  # repeatable from the seed


def test_draws_follow_the_cuda_generator():
    """The mask comes from the CUDA generator's state: a state set by set_rng_state (as an RNG tracker's
    fork does) gives that state's mask, and the generator moves on by 4 per call."""
    x, r = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    torch.cuda.manual_seed(11)
    state = torch.cuda.get_rng_state()
    a = dropout_ops.dropout_add(x, r, 0.5)
    assert torch.cuda.default_generators[torch.cuda.current_device()].get_offset() == 4
    torch.cuda.manual_seed(12)
    other = dropout_ops.dropout_add(x, r, 0.5)
    torch.cuda.set_rng_state(state)
    assert torch.equal(dropout_ops.dropout_add(x, r, 0.5), a)
    assert not torch.equal(other, a)


def test_torch_path_where_the_kernel_does_not_run():
    x = torch.randn(64, device="cuda")
    assert not dropout_ops.fused(x, x, 0.1, training=False)
    assert not dropout_ops.fused(x, x, 0.0, training=True)
    assert not dropout_ops.fused(x[1:], x[1:], 0.1, training=True)  # not 16-byte aligned
    assert not dropout_ops.fused(x, x.double(), 0.1, training=True)
    assert dropout_ops.fused(x, x, 0.1, training=True)
    assert torch.equal(dropout_ops.dropout_add(x, x, 0.1, training=False), x + x)
    with pytest.raises(ValueError, match="dropout_add: got x"):
        native_dropout.dropout_add(x[1:], None, 0.1, 0, 0)
    with pytest.raises(ValueError, match="p=1.0"):
        native_dropout.dropout_add(x, None, 1.0, 0, 0)


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed"])
def test_transformer_layer_dropout_through_the_kernel(recipe_name, monkeypatch):
    """A GPT-style layer (hidden_dropout 0.1) runs both residual blocks' dropout + add in the kernel: the
    output and every gradient equal the same layer whose dropout_add is torch autograd with the kernel's
    masks (computed in fp32, rounded once, as the kernel), bit for bit; under FP8 too, no bool mask is
    saved for backward."""
    from te_parallel import recipe
    from te_parallel.module import transformer

    rec = recipe.DelayedScaling() if recipe_name == "delayed" else None
    torch.manual_seed(0)
    layer = te.TransformerLayer(256, 1024, 4, hidden_dropout=0.1, attention_dropout=0.0,
                                params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    draws, real_draw = [], dropout_ops._draw
    monkeypatch.setattr(dropout_ops, "_draw", lambda device: draws.append(real_draw(device)) or draws[-1])

    def run(fn=None):
        with monkeypatch.context() as mp:
            if fn is not None:
                mp.setattr(transformer, "dropout_add", fn)
            xi = x.clone().requires_grad_(True)
            with te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
                y = layer(xi)
            y.backward(dy)
        grads = [xi.grad] + [q.grad.clone() for q in layer.parameters()]
        for q in layer.parameters():
            q.grad = None
        return y.detach(), grads

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        y, grads = run()
    assert len(draws) == 2 and torch.bool not in saved  # torch's dropout would save a bool mask
    if rec is not None:
        return

    masks = iter([_mask(x.numel(), 0.1, *d).view(x.shape) for d in draws])

    def reference(out, residual, p, training):
        m = next(masks)
        return (residual.float() + torch.where(m, out.float() * _scale(p), 0.0)).to(out.dtype)

    y_ref, grads_ref = run(reference)
    assert torch.equal(y, y_ref)
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)
