"""The fused RoPE kernel (te_parallel.ops.rope on CUDA) against an fp64 reference: outputs and gradients,
sbhd and bshd, strided views (q out of a fused QKV projection), partial rotation, every float dtype."""
import pytest
import torch

import te_parallel as te
from te_parallel import native
from te_parallel.ops.rope import apply_rope, rope_torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not native.available():
    pytest.skip("te_parallel._C is absent (built without nvcc)", allow_module_level=True)

# the kernel rounds once: within one unit in the last place of the dtype (relative to the output's scale)
ULP = {torch.float32: 2e-7, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _max_rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("rot_frac, offset", [(1.0, 0), (0.5, 0), (1.0, 1), (0.3125, 0)],
                         ids=["full", "half", "unaligned", "pairs-not-multiple-of-8"])
def test_rope_kernel_vs_fp64(dtype, fmt, rot_frac, offset):
    """16-byte runs of pairs where the layout allows (full, half), one pair per thread elsewhere (a view
    starting one element off, 20 pairs)."""
    torch.manual_seed(0)
    s, b, h, d = 257, 3, 5, 128
    rot = int(d * rot_frac)
    freqs = te.RotaryPositionEmbedding(d, rotary_percent=rot_frac).cuda()(s + 7)  # more positions than used
    qkv = torch.randn(s, b, h, 3 * d, device="cuda", dtype=dtype)
    q = qkv[..., d + offset: 2 * d + offset]  # a strided view, as the fused QKV projection gives
    if fmt == "bshd":
        q = q.transpose(0, 1)
    q = q.detach().requires_grad_()
    out = te.apply_rotary_pos_emb(q, freqs, fmt)
    assert out.shape == q.shape and out.dtype == dtype
    f = freqs[:s].double()
    qd = q.detach().double().requires_grad_()
    ref = rope_torch(qd, f.transpose(0, 1) if fmt == "bshd" else f)
    assert _max_rel(out, ref) < ULP[dtype]
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    assert _max_rel(q.grad, qd.grad) < 2 * ULP[dtype]
    # at least as close to fp64 as the torch path (which rounds each product)
    plain = rope_torch(q.detach(), (f.transpose(0, 1) if fmt == "bshd" else f).float())
    assert _max_rel(out, ref) <= _max_rel(plain, ref) + 1e-12
    if rot < d:  # the channels past rot are copied exactly
        assert torch.equal(out[..., rot:], q.detach()[..., rot:])


@pytest.mark.parametrize("s, b, h, d", [(513, 1, 1, 128), (100, 2, 3, 64), (37, 5, 1, 32), (5, 2, 1, 8192)],
                         ids=["one-key-head", "batch-2", "batch-5", "rot-8192"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_kernel_few_pairs_and_long_rot(s, b, h, d, dtype):
    """Few pairs per (s, b) row (a key head at batch 1; a block of several batch rows, batch 5 with one
    head), and rot = 8192, whose angles take 64 KB of shared memory. Every output and gradient element
    against fp64 (no row or position skipped)."""
    torch.manual_seed(1)
    freqs = te.RotaryPositionEmbedding(d).cuda()(s + 3)
    x = torch.randn(s, b, h, d, device="cuda", dtype=dtype, requires_grad=True)
    out = te.apply_rotary_pos_emb(x, freqs, "sbhd")
    xd = x.detach().double().requires_grad_()
    ref = rope_torch(xd, freqs[:s].double())
    err = (out.double() - ref).abs() / ref.abs().amax(dim=-1, keepdim=True)
    assert err.max().item() < ULP[dtype], f"worst at {divmod(err.argmax().item(), b * h * d)}"
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    assert _max_rel(x.grad, xd.grad) < 2 * ULP[dtype]


def test_layer_with_rope_uses_the_kernel(monkeypatch):
    """A Llama-style TransformerLayer's q and k go through the kernel (one call each way per tensor)."""
    from te_parallel.native import rope as native_rope

    calls = []
    real = native_rope.rope
    monkeypatch.setattr(native_rope, "rope", lambda *a, **k: calls.append(a[2] if len(a) > 2 else k.get("backward"))
                        or real(*a, **k))
    layer = te.TransformerLayer(256, 512, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu",
                                bias=False, hidden_dropout=0.0, attention_dropout=0.0, device="cuda",
                                params_dtype=torch.bfloat16)
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rope = te.RotaryPositionEmbedding(64).cuda()(64)
    layer(x, rotary_pos_emb=rope).sum().backward()
    assert calls.count(False) == 2 and calls.count(True) == 2


def test_apply_rope_falls_back_when_freqs_need_grad():
    t = torch.randn(8, 2, 2, 16, device="cuda")
    f = torch.randn(8, 1, 1, 16, device="cuda", requires_grad=True)
    out = apply_rope(t, f, bshd=False)
    out.sum().backward()
    assert f.grad is not None


def test_backward_takes_a_gradient_with_strided_last_dim():
    """A gradient that arrives transposed in its last two dims (as from a permuted consumer) is made
    contiguous for the kernel, not rejected."""
    t = torch.randn(16, 2, 4, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = te.RotaryPositionEmbedding(32).cuda()(16)
    out = apply_rope(t, f, bshd=False)
    g = torch.randn(16, 2, 32, 4, device="cuda", dtype=torch.bfloat16).transpose(-1, -2)  # stride(-1) != 1
    out.backward(g)
    td = t.detach().double().requires_grad_()
    apply_rope(td, f.double(), bshd=False).backward(g.double())  # (fp64 angles: the torch path)
    assert ((t.grad.double() - td.grad).abs().max() / td.grad.abs().max()).item() < 1.6e-2


def _split_then_rope(mixed, g, n, d, fq, fk):
    """The split's own path: q regrouped to [s, b, g·n, d], then each rotated."""
    s, b = mixed.shape[:2]
    grouped = mixed.view(s, b, g, n + 2, d)
    q, k, v = grouped.split([n, 1, 1], dim=-2)
    q = q.reshape(s, b, g * n, d)
    return apply_rope(q, fq[:s], bshd=False), apply_rope(k.squeeze(-2), fk[:s], bshd=False), v.squeeze(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("groups, per_group", [(2, 3), (4, 1), (1, 4)], ids=["gqa", "mha", "mqa"])
def test_qkv_rope_split_is_the_split_then_rope(dtype, groups, per_group):
    """q, k, v out of an interleaved fused QKV output with q and k rotated in place of the split: the same
    outputs and the same gradient of the fused output, bit for bit, for fresh random gradients (one of them
    transposed in memory, as a permuted consumer gives) and with v unused."""
    from te_parallel.ops.rope import qkv_rope_split

    torch.manual_seed(0)
    s, b, d = 96, 3, 64
    g, n = groups, per_group
    fq = te.RotaryPositionEmbedding(d).cuda()(s + 5)
    fk = te.RotaryPositionEmbedding(d, rotary_percent=0.5).cuda()(s)
    mixed = torch.randn(s, b, g * (n + 2) * d, device="cuda", dtype=dtype)
    a = mixed.clone().requires_grad_()
    got = qkv_rope_split(a, g, n, d, fq, fk)
    assert got is not None
    ref_in = mixed.clone().requires_grad_()
    want = _split_then_rope(ref_in, g, n, d, fq, fk)
    for x, y in zip(got, want):
        assert x.shape == y.shape and torch.equal(x, y)
    dq = torch.randn(b, g * n, s, d, device="cuda", dtype=dtype).permute(2, 0, 1, 3)  # [s, b, h, d], strided
    dk = torch.randn(s, b, g, d, device="cuda", dtype=dtype)
    for use_v in (True, False):
        a.grad = ref_in.grad = None
        used = 3 if use_v else 2
        grads = [dq, dk, torch.randn(s, b, g, d, device="cuda", dtype=dtype)][:used]
        torch.autograd.backward(list(got[:used]), grads, retain_graph=True)
        torch.autograd.backward(list(want[:used]), grads, retain_graph=True)
        assert torch.equal(a.grad, ref_in.grad)
        if not use_v:
            assert not a.grad.view(s, b, g, n + 2, d)[..., n + 1, :].any()


def test_llama_layer_takes_the_fused_split(monkeypatch):
    """A Llama-style TransformerLayer (GQA, RoPE, interleaved fused QKV) runs the split with RoPE in one
    Function: its output and every gradient equal the split-then-rotate path's, bit for bit."""
    from te_parallel.module import multi_head_attention as mha

    torch.manual_seed(0)
    kw = dict(num_gqa_groups=2, normalization="RMSNorm", activation="swiglu", bias=False, hidden_dropout=0.0,
              attention_dropout=0.0, fuse_qkv_params=True, device="cuda", params_dtype=torch.bfloat16)
    layers = [te.TransformerLayer(256, 512, 4, **kw) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    rope = te.RotaryPositionEmbedding(64).cuda()(64)
    real = mha.qkv_rope_split
    results = []
    for layer, fused in zip(layers, (True, False)):
        calls = []
        monkeypatch.setattr(mha, "qkv_rope_split", lambda *a: calls.append(1) or (real(*a) if fused else None))
        x.grad = None
        with te.fp8_autocast(fp8_recipe=te.recipe.DelayedScaling()):
            y = layer(x, rotary_pos_emb=rope)
        y.backward(dy)
        results.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
        assert calls == [1]
    for a, b in zip(*results):
        assert torch.equal(a, b)
