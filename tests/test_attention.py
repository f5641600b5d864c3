"""DotProductAttention and MultiheadAttention vs independent fp64 references: masks, GQA, windows, RoPE, backends."""
import warnings

import pytest
import torch

import te_parallel as te
from tests.attention_reference import causal, ref_attention, rope_ref, window
from tests.reference import rel_err

S, B, H, D = 12, 3, 4, 16


def _qkv(device, s=S, skv=S, h=H, g=H, dtype=torch.float32):
    mk = lambda s_, n: torch.randn(s_, B, n, D, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    return mk(s, h), mk(skv, g), mk(skv, g)


def _check(dpa, q, k, v, masked, tol=1e-5, **fwd):
    out = dpa(q, k, v, **fwd)
    dy = torch.randn_like(out)
    out.backward(dy)
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    ref = ref_attention(qr, kr, vr, masked)
    ref.backward(dy.double().cpu())
    assert out.shape == (q.shape[0], B, q.shape[2] * D)
    assert rel_err(out.cpu(), ref) < tol
    for a, r in ((q, qr), (k, kr), (v, vr)):
        assert rel_err(a.grad.cpu(), r.grad) < tol


def _padding(device, s=S):
    lengths = torch.tensor([s, s - 3, 5])
    pad = torch.arange(s).view(1, s) >= lengths.view(B, 1)  # True = padding
    return pad.view(B, 1, 1, s).to(device), pad.view(B, 1, 1, s)


@pytest.mark.parametrize("backend", ["auto", "math", "unfused"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding", "padding_causal", "arbitrary"])
def test_mask_types(mask_type, backend, device):
    dpa = te.DotProductAttention(H, D, attn_mask_type=mask_type, backend=backend)
    q, k, v = _qkv(device)
    mask, masked = None, None
    if mask_type in ("padding", "padding_causal"):
        mask, masked = _padding(device)
    if mask_type == "arbitrary":
        masked = torch.rand(B, 1, S, S) < 0.3
        masked[..., 0] = False  # every query keeps one key
        mask = masked.to(device)
    if "causal" in mask_type:
        masked = causal(S, S) if masked is None else masked | causal(S, S)
    _check(dpa, q, k, v, masked, attention_mask=mask)
    assert dpa.last_backend in ("cudnn", "flash", "efficient", "math", "unfused")
    if backend != "auto":
        assert dpa.last_backend == backend


@pytest.mark.parametrize("groups", [1, 2])
def test_gqa_and_mqa(groups, device):
    dpa = te.DotProductAttention(H, D, num_gqa_groups=groups, attn_mask_type="causal")
    _check(dpa, *_qkv(device, g=groups), causal(S, S))


@pytest.mark.parametrize("win, mask_type", [((3, 0), "causal"), ((2, 2), "no_mask"), ((-1, 1), "no_mask")])
def test_sliding_window(win, mask_type, device):
    dpa = te.DotProductAttention(H, D, attn_mask_type=mask_type, window_size=win)
    masked = window(S, S, *win) | (causal(S, S) if mask_type == "causal" else False)
    _check(dpa, *_qkv(device), masked)


def test_cross_attention_lengths_and_bshd(device):
    dpa = te.DotProductAttention(H, D, attn_mask_type="no_mask", attention_type="cross")
    _check(dpa, *_qkv(device, s=7, skv=S), None)
    dpa = te.DotProductAttention(H, D, attn_mask_type="causal", qkv_format="bshd")
    q, k, v = _qkv(device)
    out = dpa(*(t.transpose(0, 1) for t in (q, k, v)))
    ref = ref_attention(*(t.detach().double().cpu() for t in (q, k, v)), causal(S, S))
    assert rel_err(out.transpose(0, 1).cpu(), ref) < 1e-5


def test_unavailable_backend_falls_back_once(device):
    dpa = te.DotProductAttention(H, D, attn_mask_type="causal", backend="cudnn")
    q, k, v = _qkv(device, dtype=torch.float64) if device == "cpu" else _qkv(device, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = dpa(q, k, v)
        dpa(q, k, v)
    assert dpa.last_backend == "unfused" and len([x for x in w if "cudnn" in str(x.message)]) == 1
    assert rel_err(out.cpu(), ref_attention(*(t.detach().double().cpu() for t in (q, k, v)), causal(S, S))) < 1e-10


def test_rope_in_mha(device):
    m = te.MultiheadAttention(H * D, H, attention_dropout=0.0, input_layernorm=False, attn_mask_type="causal", device=device)
    x = torch.randn(S, B, H * D, device=device)
    freqs = te.RotaryPositionEmbedding(D)(S).to(device)
    out = m(x, rotary_pos_emb=freqs)
    p = {n: t.detach().double().cpu() for n, t in m.named_parameters()}
    xr = x.double().cpu()
    q, k, v = (xr @ p[f"qkv.{n}_weight"].t() + p[f"qkv.{n}_bias"] for n in ("query", "key", "value"))
    q, k, v = (t.reshape(S, B, H, D) for t in (q, k, v))
    ctx = ref_attention(rope_ref(q), rope_ref(k), v, causal(S, S))
    ref = ctx @ p["proj.weight"].t() + p["proj.bias"]
    assert rel_err(out.cpu(), ref) < 1e-5


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_attention_heads=6, kv_channels=D, tp_size=4), "num_attention_heads=6 is not divisible by tp_size=4"),
    (dict(num_attention_heads=4, kv_channels=D, num_gqa_groups=3), "not divisible by num_gqa_groups=3"),
    (dict(num_attention_heads=4, kv_channels=D, attn_mask_type="triangle"), "attn_mask_type must be one of"),
    (dict(num_attention_heads=4, kv_channels=D, qkv_format="thd"), "qkv_format must be one of"),
    (dict(num_attention_heads=4, kv_channels=D, window_size=(2,)), "window_size"),
])
def test_bad_attention_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        te.DotProductAttention(**kwargs)


def test_bad_masks_and_shapes(device):
    q, k, v = _qkv(device)
    dpa = te.DotProductAttention(H, D, attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"broadcastable to \[batch, heads, s_q, s_kv\] = \[3, 1, 1, 12\].*got \(3, 1, 1, 11\)"):
        dpa(q, k, v, attention_mask=torch.zeros(B, 1, 1, S - 1, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="torch.float32"):
        dpa(q, k, v, attention_mask=torch.zeros(B, 1, 1, S, device=device))
    with pytest.raises(ValueError, match="needs attention_mask"):
        dpa(q, k, v)
    with pytest.raises(ValueError, match="expected q with 4 heads"):
        dpa(q[:, :, :2], k, v, attention_mask=torch.zeros(B, 1, 1, S, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        dpa(q, k, v, attn_mask_type="diagonal")
    with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_attention_heads=3"):
        te.MultiheadAttention(100, 3, device=device)
