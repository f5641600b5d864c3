"""DotProductAttention and MultiheadAttention on bshd/sbhd vs independent fp64 references: masks, GQA,
windows, RoPE, backends, the "auto" rule and its errors. Packed (thd) inputs: tests/test_attention_thd.py."""
import pytest
import torch

import te_parallel as te
from te_parallel.ops.attention import Band, Case, choose_backend, fallback_of, make_band, unsupported_reason
from tests.attention_reference import causal, padding_masked, ref_attention, rope_ref, te_mask, window
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


def _padding(device, s=S, lengths=(S, S - 3, 5)):
    pad = torch.arange(s).view(1, s) >= torch.tensor(lengths).view(B, 1)  # True = padding
    return pad.view(B, 1, 1, s).to(device), pad


@pytest.mark.parametrize("backend", ["auto", "math", "unfused"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                                       "padding_causal_bottom_right", "arbitrary"])
def test_mask_types(mask_type, backend, device):
    dpa = te.DotProductAttention(H, D, attn_mask_type=mask_type, backend=backend)
    q, k, v = _qkv(device)
    mask, masked = None, None
    if "padding" in mask_type:
        mask, pad = _padding(device)
        masked = padding_masked(pad, pad)
    if mask_type == "arbitrary":
        masked = torch.rand(B, 1, S, S) < 0.3
        masked[..., 0] = False  # every query keeps one key
        mask = masked.to(device)
    if "causal" in mask_type:  # s_q == s_kv in every sequence: bottom-right is top-left
        masked = causal(S, S) if masked is None else masked | causal(S, S)
    _check(dpa, q, k, v, masked, attention_mask=mask)
    if backend != "auto":
        assert dpa.last_backend == backend
    elif device == "cpu":
        assert dpa.last_backend == "math"


def test_padded_query_rows_are_zero(device):
    dpa = te.DotProductAttention(H, D, attn_mask_type="padding_causal", qkv_format="bshd")
    q, k, v = _qkv(device)
    mask, pad = _padding(device, lengths=(S, 0, 1))  # a fully padded row and a single token
    out = dpa(*(t.transpose(0, 1) for t in (q, k, v)), attention_mask=mask)
    assert torch.all(out[pad.to(device)] == 0)
    assert torch.all(out[1] == 0) and out[2, 0].abs().sum() > 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_padding_from_cu_seqlens_matches_mask(device):
    """TE: bshd/sbhd padding may come as cu_seqlens (valid tokens first) instead of a mask."""
    dpa = te.DotProductAttention(H, D, attn_mask_type="padding_causal")
    q, k, v = _qkv(device)
    mask, _ = _padding(device)
    cu = torch.tensor([0, S, 2 * S - 3, 2 * S + 2], dtype=torch.int32, device=device)
    a, b = dpa(q, k, v, attention_mask=mask), dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert torch.equal(a, b)


def test_cross_attention_padding_pair(device):
    dpa = te.DotProductAttention(H, D, attn_mask_type="padding", attention_type="cross")
    q, k, v = _qkv(device, s=7)
    pad_q = torch.arange(7).view(1, 7) >= torch.tensor([7, 2, 0]).view(B, 1)
    _, pad_kv = _padding(device)
    masks = (pad_q.view(B, 1, 1, 7).to(device), pad_kv.view(B, 1, 1, S).to(device))
    _check(dpa, q, k, v, padding_masked(pad_q, pad_kv), attention_mask=masks)
    with pytest.raises(ValueError, match="one padding mask serves self-attention"):
        dpa(q, k, v, attention_mask=masks[1])


def test_causal_ignores_attention_mask(device):
    """Megatron passes attention_mask with attn_mask_type='causal'; TE ignores it, so do we."""
    dpa = te.DotProductAttention(H, D, attn_mask_type="causal")
    q, k, v = _qkv(device)
    garbage = torch.ones(B, 1, S, S, dtype=torch.bool, device=device)
    assert torch.equal(dpa(q, k, v, attention_mask=garbage), dpa(q, k, v))


@pytest.mark.parametrize("groups", [1, 2])
def test_gqa_and_mqa(groups, device):
    dpa = te.DotProductAttention(H, D, num_gqa_groups=groups, attn_mask_type="causal")
    _check(dpa, *_qkv(device, g=groups), causal(S, S))


@pytest.mark.parametrize("win, mask_type", [((3, 0), "causal"), ((2, 2), "no_mask"), ((-1, 1), "no_mask"),
                                            ((4, -1), "causal_bottom_right"), ((2, 1), "padding_causal")])
def test_sliding_window(win, mask_type, device):
    dpa = te.DotProductAttention(H, D, attn_mask_type=mask_type, window_size=win)
    masked = te_mask(S, S, mask_type, win)
    mask = None
    if "padding" in mask_type:
        mask = torch.zeros(B, 1, 1, S, dtype=torch.bool, device=device)
    _check(dpa, *_qkv(device), masked, attention_mask=mask)


def test_cross_attention_lengths_and_bshd(device):
    dpa = te.DotProductAttention(H, D, attn_mask_type="no_mask", attention_type="cross")
    _check(dpa, *_qkv(device, s=7, skv=S), None)
    for mask_type in ("causal", "causal_bottom_right"):  # s_q < s_kv: the alignments differ
        dpa = te.DotProductAttention(H, D, attn_mask_type=mask_type, attention_type="cross", window_size=(2, 0))
        _check(dpa, *_qkv(device, s=7, skv=S), te_mask(7, S, mask_type, (2, 0)))
    dpa = te.DotProductAttention(H, D, attn_mask_type="causal", qkv_format="bshd")
    q, k, v = _qkv(device)
    out = dpa(*(t.transpose(0, 1) for t in (q, k, v)))
    ref = ref_attention(*(t.detach().double().cpu() for t in (q, k, v)), causal(S, S))
    assert rel_err(out.transpose(0, 1).cpu(), ref) < 1e-5


def test_explicit_backend_that_cannot_run_is_an_error():
    dpa = te.DotProductAttention(H, D, attn_mask_type="causal", backend="cudnn")
    q, k, v = _qkv("cpu", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^DotProductAttention: backend='cudnn' cannot run this input \(sbhd "
                                         r"torch.float64 on cpu.*it needs a CUDA tensor") as err:
        dpa(q, k, v)
    assert "\n" not in str(err.value)


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
    (dict(num_attention_heads=4, kv_channels=D, qkv_format="tbhd"), "qkv_format must be one of"),
    (dict(num_attention_heads=4, kv_channels=D, window_size=(2,)), "window_size"),
    (dict(num_attention_heads=4, kv_channels=D, backend="fast"), "backend must be one of"),
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
    with pytest.raises(ValueError, match="padding masks need attention_mask"):
        dpa(q, k, v)
    with pytest.raises(ValueError, match="expected q with 4 heads"):
        dpa(q[:, :, :2], k, v, attention_mask=torch.zeros(B, 1, 1, S, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        dpa(q, k, v, attn_mask_type="diagonal")
    with pytest.raises(ValueError, match="alibi_slopes not supported"):
        dpa(q, k, v, alibi_slopes=torch.ones(H))
    with pytest.raises(ValueError, match="needs attention_mask"):
        te.DotProductAttention(H, D, attn_mask_type="arbitrary")(q, k, v)
    with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_attention_heads=3"):
        te.MultiheadAttention(100, 3, device=device)


# -- the "auto" rule, on described inputs (no GPU needed) --------------------------------------------

def _case(dtype=torch.bfloat16, cap=(9, 0), d=128, ragged=False, arbitrary=False, band=None, same=True,
          dropout=False, fe=True, device="cuda", compiling=False):
    band = band or make_band("causal", None)
    return Case(device, cap, dtype, d, ragged, arbitrary, band, same, dropout, fe, compiling)


@pytest.mark.parametrize("case, want", [
    (_case(), "cudnn_fe"),                                         # Llama GQA causal on H100: cuDNN through the frontend
    (_case(dropout=True), "cudnn_fe"),                             # GPT: causal with attention dropout
    (_case(fe=False), "cudnn"),                                    # ... without the frontend: SDPA's cuDNN, GQA native
    (_case(compiling=True), "cudnn"),                              # ... and inside torch.compile
    (_case(cap=(8, 0)), "flash"),                                  # A100: SDPA flash
    (_case(d=256), "flash"),                                       # cuDNN head_dim <= 128
    (_case(ragged=True), "cudnn_fe"),                              # thd / padding with the cuDNN frontend
    (_case(ragged=True, fe=False), "flash_varlen"),                # ... without it
    (_case(ragged=True, dropout=True), "cudnn_fe"),                # dropout: cuDNN's Philox
    (_case(ragged=True, dropout=True, same=False, band=make_band("padding_causal_bottom_right", None)),
     "flash_varlen"),                                              # cuDNN: no dropout with bottom-right, s_q != s_kv
    (_case(ragged=True, cap=(8, 0)), "flash_varlen"),
    (_case(band=make_band("causal", (128, 0))), "cudnn_fe"),       # sliding window, dense input
    (_case(band=make_band("causal", (128, 0)), fe=False), "flash_varlen"),
    (_case(band=make_band("causal", None), same=False), "cudnn_fe"),   # top-left causal, s_q != s_kv
    (_case(band=make_band("causal", None), same=False, fe=False), "efficient"),
    (_case(band=make_band("causal_bottom_right", None), same=False, fe=False), "flash_varlen"),
    (_case(arbitrary=True), "efficient"),
    (_case(dtype=torch.float32), "efficient"),
    (_case(dtype=torch.float64), "math"),
    (_case(device="cpu", cap=(0, 0)), "math"),
])
def test_auto_rule(case, want):
    assert choose_backend(case) == want


def test_unsupported_reasons_and_fallbacks():
    assert unsupported_reason("cudnn", _case(ragged=True)).startswith("a dense input")
    assert unsupported_reason("cudnn_fe", _case(fe=False)).startswith("the cuDNN frontend")
    assert unsupported_reason("cudnn_fe", _case(ragged=True, dropout=True)) is None
    assert unsupported_reason("cudnn_fe", _case(ragged=True, dropout=True, same=False, band=make_band(
        "causal_bottom_right", None))) == "no attention dropout with a bottom-right diagonal where s_q != s_kv"
    assert unsupported_reason("flash_varlen", _case(dtype=torch.float32)) == "float16 or bfloat16"
    assert unsupported_reason("flash", _case(device="cpu")) == "a CUDA tensor"
    assert unsupported_reason("math", _case(arbitrary=True)) is None
    assert fallback_of("cudnn", _case()) == "flash"
    assert fallback_of("cudnn_fe", _case()) == "cudnn"                     # dense: SDPA's cuDNN
    assert fallback_of("cudnn_fe", _case(ragged=True)) == "flash_varlen"
    assert fallback_of("cudnn_fe", _case(band=make_band("causal", None), same=False)) == "efficient"
    assert fallback_of("flash_varlen", _case(ragged=True)) == "efficient"


def test_band_alignment_follows_te():
    assert make_band("causal", (4, 2)) == Band(False, 4, 0)            # causal: right bound 0, top-left
    assert make_band("causal_bottom_right", None) == Band(True, -1, 0)
    assert make_band("padding", (3, 1)) == Band(True, 3, 1)             # non-causal: bottom-right
    assert make_band("no_mask", None).full
    assert torch.equal(window(S, S, 2, 0) | causal(S, S), te_mask(S, S, "causal", (2, 0)))


# -- q, k, v as views of one fused projection output (no GPU needed) --------------------------------

def _qkv_views(s, b, h, d, interleaved):
    if interleaved:
        return lambda m: m.view(s, b, h, 3, d).unbind(-2)
    return lambda m: tuple(t.view(s, b, h, d) for t in m.split(h * d, dim=-1))


@pytest.mark.parametrize("interleaved", [True, False])
def test_shared_base_finds_a_tiling_split(interleaved):
    from te_parallel.ops.attention_cudnn_fe import shared_base
    s, b, h, d = 5, 3, 4, 8
    root = torch.randn(s * b, 3 * h * d)  # a GEMM's 2-D output, viewed [s, b, 3·h·d]
    q, k, v = _qkv_views(s, b, h, d, interleaved)(root.view(s, b, -1))
    assert shared_base(q, k, v) is root
    assert shared_base(q, q, v) is None                      # the same view twice: k's slots left out
    assert shared_base(q, k, v[:, :, :2]) is None            # part of the tensor left out
    assert shared_base(q, k, torch.randn_like(v)) is None    # not views of one tensor
    shifted = root.view(-1)[1:1 + s * b * h * d].view(s, b, h, d)  # overlapping q
    assert shared_base(shifted, k, v) is None


class _WritesIntoOneTensor(torch.autograd.Function):
    """out = q + 2k + 3v; the backward writes dq, dk, dv as views of one new tensor shaped like their base
    (what the cuDNN frontend's dense attention does), or as separate tensors."""

    @staticmethod
    def forward(ctx, q, k, v, views, shape, tiled):
        ctx.views, ctx.shape, ctx.tiled = views, shape, tiled
        return q + 2 * k + 3 * v

    @staticmethod
    def backward(ctx, g):
        if not ctx.tiled:
            return g.clone(), 2 * g, 3 * g, None, None, None
        base = torch.empty(ctx.shape)
        parts = ctx.views(base.view(ctx.shape[0] // g.shape[1], g.shape[1], -1))
        for part, f in zip(parts, (1, 2, 3)):
            part.copy_(f * g)
        return (*parts, None, None, None)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("tiled", [True, False])
def test_split_views_passes_a_tiled_gradient_on(interleaved, tiled):
    """split_views' backward returns the attention's one gradient tensor itself when dq, dk, dv are its
    views (no join), and joins separate gradients otherwise; the gradient is the same either way."""
    from te_parallel.ops.attention_dispatch import split_views
    s, b, h, d = 4, 2, 3, 5
    views = _qkv_views(s, b, h, d, interleaved)
    joins = []

    def join(dq, dk, dv):
        joins.append(1)
        if interleaved:
            return torch.stack([dq, dk, dv], dim=-2).view(s, b, -1)
        return torch.cat([t.reshape(s, b, -1) for t in (dq, dk, dv)], dim=-1)

    root = torch.randn(s * b, 3 * h * d, requires_grad=True)
    mixed = root.view(s, b, -1)
    seen = []
    mixed.register_hook(seen.append)
    q, k, v = split_views(mixed, views, join)
    out = _WritesIntoOneTensor.apply(q, k, v, views, root.shape, tiled)
    dy = torch.randn_like(out)
    out.backward(dy)
    assert joins == ([] if tiled else [1])
    if tiled:
        assert seen[0]._base is not None and seen[0]._base.shape == root.shape  # the backward's own tensor
    want = torch.zeros(s, b, 3 * h * d)
    for part, f in zip(views(want), (1, 2, 3)):
        part.copy_(f * dy)
    assert torch.equal(root.grad.view(s, b, -1), want)
