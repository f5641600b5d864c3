"""Packed sequences (qkv_format="thd", TE's cu_seqlens API) vs fp64 references that run each sequence
on its own: ragged lengths with empty and one-token sequences, causal alignments, windows, GQA/MQA,
cross attention, gaps between sequences; outputs and the gradients of q, k, v. Then the same at layer
level: MultiheadAttention and TransformerLayer in thd vs the sequences one by one in bshd."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import te_parallel as te
from te_parallel.ops import attention_dispatch as dispatch
from te_parallel.ops.attention import make_band
from tests.attention_reference import padding_masked, ref_attention, ref_thd, te_mask
from tests.reference import rel_err

H, D = 4, 16
LENGTHS = (5, 0, 1, 7, 3)


def _cu(lengths, device="cpu"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _packed(lengths, heads, device, dtype=torch.float32):
    t = sum(lengths)
    return torch.randn(t, heads, D, device=device, dtype=dtype, requires_grad=True)


def _check_thd(dpa, q, k, v, cu_q, cu_kv, mask_type, win=None, tol=1e-5, **fwd):
    out = dpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **fwd)
    assert out.shape == (q.shape[0], q.shape[1] * D)
    dy = torch.randn_like(out)
    out.backward(dy)
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    ref = ref_thd(qr, kr, vr, cu_q.cpu(), cu_kv.cpu(), mask_type, win)
    ref.backward(dy.double().cpu())
    assert rel_err(out.detach().cpu(), ref) < tol
    for a, r in ((q, qr), (k, kr), (v, vr)):  # (no gradient at all = zero: a pack of empty sequences)
        got, want = (torch.zeros_like(t) if t.grad is None else t.grad for t in (a, r))
        if want.numel() == 0 or want.abs().max() == 0:  # (a window of one key: softmax of one score has no gradient)
            assert got.numel() == 0 or got.abs().max().item() < tol, "gradient"
        else:
            assert rel_err(got.cpu(), want) < tol, "gradient"
    return out


@pytest.mark.parametrize("backend", ["auto", "math", "unfused"])
@pytest.mark.parametrize("groups", [H, 2, 1])
@pytest.mark.parametrize("mask_type, ref_type", [("causal", "causal"), ("padding_causal", "causal"),
                                                 ("no_mask", "no_mask"), ("padding", "no_mask")])
def test_thd_vs_each_sequence(mask_type, ref_type, groups, backend, device):
    dpa = te.DotProductAttention(H, D, num_gqa_groups=groups, qkv_format="thd", attn_mask_type=mask_type, backend=backend)
    cu = _cu(LENGTHS, device)
    q, k, v = _packed(LENGTHS, H, device), _packed(LENGTHS, groups, device), _packed(LENGTHS, groups, device)
    _check_thd(dpa, q, k, v, cu, cu, ref_type)
    assert dpa.last_backend == (backend if backend != "auto" else "math" if device == "cpu" else dpa.last_backend)


@pytest.mark.parametrize("mask_type, win", [("causal", (2, 0)), ("padding_causal", (0, 0)), ("padding", (1, 2)),
                                            ("no_mask", (-1, 1)), ("causal_bottom_right", (3, 0))])
def test_thd_sliding_window(mask_type, win, device):
    dpa = te.DotProductAttention(H, D, num_gqa_groups=2, qkv_format="thd", attn_mask_type=mask_type, window_size=win)
    cu = _cu(LENGTHS, device)
    q, k, v = _packed(LENGTHS, H, device), _packed(LENGTHS, 2, device), _packed(LENGTHS, 2, device)
    _check_thd(dpa, q, k, v, cu, cu, mask_type, win)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd_cross_attention(mask_type, device):
    """Different query and key lengths per sequence, including keys for no query and a query with no key."""
    lq, lkv = (3, 0, 2, 1, 4), (5, 2, 0, 1, 6)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=1, qkv_format="thd", attn_mask_type=mask_type,
                                 attention_type="cross")
    q, k, v = _packed(lq, H, device), _packed(lkv, 1, device), _packed(lkv, 1, device)
    out = _check_thd(dpa, q, k, v, _cu(lq, device), _cu(lkv, device), mask_type)
    assert torch.all(out[3:5] == 0)  # sequence 2 has no keys


def test_thd_gaps_between_sequences(device):
    """cu_seqlens_*_padded: sequence i starts at row cu_padded[i]; rows in the gaps give zeros."""
    lengths, slots = (4, 0, 2, 5), (6, 1, 2, 8)
    cu, cu_pad = _cu(lengths, device), _cu(slots, device)
    dpa = te.DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal")
    q, k, v = _packed(slots, H, device), _packed(slots, H, device), _packed(slots, H, device)
    out = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_pad.tolist(), lengths)]).to(device)
    gaps = torch.ones(q.shape[0], dtype=torch.bool, device=device)
    gaps[rows] = False
    assert torch.all(out[gaps] == 0)
    ref = ref_thd(*(t.detach().double().cpu()[rows.cpu()] for t in (q, k, v)), cu.cpu(), cu.cpu(), "causal")
    assert rel_err(out[rows].detach().cpu(), ref) < 1e-5


def test_max_seqlen_given_or_read(device):
    dpa = te.DotProductAttention(H, D, qkv_format="thd")
    cu = _cu(LENGTHS, device)
    q, k, v = (_packed(LENGTHS, H, device) for _ in range(3))
    a = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    b = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    assert rel_err(a.detach().cpu(), b.detach().cpu()) < 1e-6
    if device == "cpu":
        with pytest.raises(ValueError, match="has a sequence of 7 tokens, more than its max_seqlen 6"):
            dpa(q, k, v, cu_seqlens_q=cu, max_seqlen_q=6)


@pytest.mark.parametrize("make, match", [
    (lambda cu: dict(cu_seqlens_q=cu.long()), r"cu_seqlens_q must be an int32 tensor \[batch \+ 1\].*got torch.int64"),
    (lambda cu: dict(cu_seqlens_q=cu.view(1, -1)), r"cu_seqlens_q must be an int32 tensor.*shape \(1, 6\)"),
    (lambda cu: dict(cu_seqlens_q=cu.flip(0)), "cu_seqlens_q must start at 0, never decrease and end at the token count 16"),
    (lambda cu: dict(cu_seqlens_q=torch.tensor([0, 5, 4, 16], dtype=torch.int32)), "smallest step -1"),
    (lambda cu: dict(cu_seqlens_q=cu[:-1]), "end at the token count 16; got first 0, last 13"),
    (lambda cu: dict(cu_seqlens_q=cu, cu_seqlens_kv=cu[:-1]), r"must both be \[batch \+ 1\]; got 6 and 5 entries"),
    (lambda cu: dict(), "qkv_format='thd' needs cu_seqlens_q"),
    (lambda cu: dict(cu_seqlens_q=cu, attn_mask_type="arbitrary"), "takes no arbitrary mask"),
    (lambda cu: dict(cu_seqlens_q=cu, cu_seqlens_q_padded=cu[:-1]), "must have as many entries as cu_seqlens_q"),
    (lambda cu: dict(cu_seqlens_q=cu, cu_seqlens_q_padded=cu - 1), "cu_seqlens_q_padded must start at 0"),
])
def test_bad_cu_seqlens(make, match):
    dpa = te.DotProductAttention(H, D, qkv_format="thd")
    q, k, v = (_packed(LENGTHS, H, "cpu") for _ in range(3))
    with pytest.raises(ValueError, match=match) as err:
        dpa(q, k, v, **make(_cu(LENGTHS)))
    assert "\n" not in str(err.value)


def test_thd_shapes_checked():
    dpa = te.DotProductAttention(H, D, qkv_format="thd")
    q = _packed(LENGTHS, H, "cpu")
    with pytest.raises(ValueError, match=r"q/k/v must be 3-D \[thd\]"):
        dpa(q.unsqueeze(0), q, q, cu_seqlens_q=_cu(LENGTHS))
    with pytest.raises(ValueError, match="key/value have 15 tokens and the query 16"):
        dpa(q, q[1:], q[1:], cu_seqlens_q=_cu(LENGTHS))


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5), groups=st.sampled_from([1, 2, 4]),
       mask_type=st.sampled_from(["padding", "padding_causal", "padding_causal_bottom_right"]),
       win=st.sampled_from([None, (1, 0), (2, 1)]))
def test_thd_random_packs(lengths, groups, mask_type, win):
    torch.manual_seed(len(lengths))
    dpa = te.DotProductAttention(H, D, num_gqa_groups=groups, qkv_format="thd", attn_mask_type=mask_type, window_size=win)
    cu = _cu(lengths)
    q, k, v = _packed(lengths, H, "cpu"), _packed(lengths, groups, "cpu"), _packed(lengths, groups, "cpu")
    _check_thd(dpa, q, k, v, cu, cu, mask_type, win)


# -- the varlen kernels' layout conversions, checked on the CPU -----------------------------------

@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("padded", [True, False])
def test_unpad_and_pad_back(fmt, padded):
    """bshd/sbhd -> packed tokens + cu_seqlens (what flash_varlen / cudnn_fe receive) -> back: a packed
    reference on the packed tokens, padded back, equals the padded reference; padded rows are zero."""
    b, s = 3, 6
    lengths = torch.tensor([6, 0, 4]) if padded else torch.full((3,), s)
    shape = (b, s, H, D) if fmt == "bshd" else (s, b, H, D)
    q, k, v = (torch.randn(*shape, dtype=torch.float64) for _ in range(3))
    valid = torch.arange(s).view(1, s) < lengths.view(b, 1)
    batch = dispatch.Batch("padded", q, k, v, valid_q=valid, valid_kv=valid) if padded else dispatch.Batch("dense", q, k, v)
    call = dispatch.Call("test", fmt, "padding_causal", make_band("padding_causal", None), 0.25, 0.0, "auto")
    qp, kp, vp, packed, restore = dispatch._to_packed(call, batch)
    assert qp.shape == (int(lengths.sum()), H, D) and packed.cu_q.dtype == torch.int32
    out = restore(ref_thd(qp, kp, vp, packed.cu_q, packed.cu_kv, "causal", scale=0.25).view(-1, H, D))
    to_sbhd = (lambda t: t.transpose(0, 1)) if fmt == "bshd" else (lambda t: t)
    masked = padding_masked(~valid, ~valid) | te_mask(s, s, "causal")
    ref = ref_attention(to_sbhd(q), to_sbhd(k), to_sbhd(v), masked, scale=0.25)
    assert rel_err(to_sbhd(out), ref) < 1e-12


# -- layers ------------------------------------------------------------------------------------------

def _pair(cls, device, **kw):
    torch.manual_seed(0)
    thd = cls(**kw, attn_input_format="thd", device=device) if cls is te.TransformerLayer else cls(**kw, qkv_format="thd", device=device)
    torch.manual_seed(0)
    bshd = cls(**kw, attn_input_format="bshd", device=device) if cls is te.TransformerLayer else cls(**kw, qkv_format="bshd", device=device)
    bshd.load_state_dict(thd.state_dict())
    return thd, bshd


def _one_by_one(layer, x, lengths, **fwd):
    outs, start = [], 0
    for n in lengths:
        if n:
            outs.append(layer(x[start:start + n].unsqueeze(0), **fwd).squeeze(0))
        start += n
    return torch.cat(outs)


def _compare_layers(thd, bshd, lengths, device, hidden, rope=None, tol=1e-5):
    cu = _cu(lengths, device)
    x = torch.randn(sum(lengths), hidden, device=device, requires_grad=True)
    x1 = x.detach().clone().requires_grad_(True)
    kw = {} if rope is None else dict(rotary_pos_emb=rope)
    out = thd(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths), **kw)
    ref = _one_by_one(bshd, x1, lengths, **kw)
    out = out[0] if isinstance(out, tuple) else out
    assert rel_err(out.detach().cpu(), ref.detach().cpu()) < tol
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy)
    assert rel_err(x.grad.cpu(), x1.grad.cpu()) < tol
    ref_grads = dict(bshd.named_parameters())
    for name, p in thd.named_parameters():
        assert rel_err(p.grad.cpu(), ref_grads[name].grad.cpu()) < tol, name


@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_mha_thd_vs_sequences_one_by_one(fuse_qkv, device):
    kw = dict(hidden_size=H * D, num_attention_heads=H, num_gqa_groups=2, attention_dropout=0.0, input_layernorm=True,
              attn_mask_type="causal", fuse_qkv_params=fuse_qkv)
    thd, bshd = _pair(te.MultiheadAttention, device, **kw)
    rope = te.RotaryPositionEmbedding(D)(max(LENGTHS)).to(device)
    _compare_layers(thd, bshd, LENGTHS, device, H * D, rope=rope)


def test_transformer_layer_thd_vs_sequences_one_by_one(device):
    kw = dict(hidden_size=H * D, ffn_hidden_size=128, num_attention_heads=H, num_gqa_groups=1, hidden_dropout=0.0,
              attention_dropout=0.0, normalization="RMSNorm", activation="swiglu", bias=False, window_size=(3, 0))
    thd, bshd = _pair(te.TransformerLayer, device, **kw)
    _compare_layers(thd, bshd, (6, 1, 0, 9, 2), device, H * D)


def test_thd_layer_input_checks(device):
    layer = te.TransformerLayer(H * D, 128, H, attn_input_format="thd", device=device)
    with pytest.raises(ValueError, match=r"hidden_states must be 2-D \[total_tokens, hidden\]"):
        layer(torch.randn(4, 1, H * D, device=device), cu_seqlens_q=_cu((4,), device))
