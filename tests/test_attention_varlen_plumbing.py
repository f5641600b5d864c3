"""The flash_varlen path on the CPU, with aten's flash-attention ops replaced by a slow stand-in that
follows flash-attention's documented conventions (cu_seqlens int32, bottom-right windows, window right
= 0 when is_causal, GQA by head groups, lse [h, t_q]). This checks what the GPU cannot be asked on CPU
CI: the argument order of both aten calls, the mask-to-window mapping, the autograd wiring, and the
unpad / pad-back around the kernel for every input kind, against the fp64 per-sequence reference."""
import pytest
import torch

from te_parallel.ops import attention_dispatch as dispatch
from te_parallel.ops import attention_varlen as vl
from te_parallel.ops.attention import make_band
from tests.attention_reference import padding_masked, ref_attention, ref_thd, te_mask, window
from tests.reference import rel_err

H, G, D = 4, 2, 8


def _stand_in(q, k, v, cu_q, cu_k, is_causal, scale, left, right):
    """Flash-attention semantics, one sequence at a time: [t_q, h, d] out."""
    right = 0 if is_causal else right
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        sq, skv = qs.shape[0], ks.shape[0]
        if sq == 0 or skv == 0:
            continue
        masked = window(sq, skv, left, right)  # (bottom-right aligned, as flash's window)
        o = ref_attention(qs.unsqueeze(1), ks.unsqueeze(1), vs.unsqueeze(1), masked, scale)
        out[cq[i]:cq[i + 1]] = o.view(sq, q.shape[1], -1)
    return out


@pytest.fixture
def fake_flash(monkeypatch):
    calls = []

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
            window_size_left=None, window_size_right=None):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
        assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and not return_debug_mask and q.stride(-1) == 1
        calls.append((window_size_left, window_size_right, is_causal))
        out = _stand_in(q, k, v, cu_q, cu_k, is_causal, scale, window_size_left, window_size_right)
        lse = torch.zeros(q.shape[1], q.shape[0])
        return out, lse, torch.zeros(2, dtype=torch.int64), torch.empty(0), torch.empty(0)

    def bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
            scale=None, window_size_left=None, window_size_right=None):
        assert lse.shape == (q.shape[1], q.shape[0]) and grad_out.is_contiguous()
        with torch.enable_grad():
            xs = [t.detach().requires_grad_(True) for t in (q, k, v)]
            o = _stand_in(*xs, cu_q, cu_k, is_causal, scale, window_size_left, window_size_right)
            return torch.autograd.grad(o, xs, grad_out)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fwd)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", bwd)
    return calls


def _cu(lengths):
    return vl.cu_from_lengths(torch.tensor(lengths, dtype=torch.int32))


@pytest.mark.parametrize("mask_type, win, want", [
    ("padding_causal", None, (-1, 0)), ("padding", None, (-1, -1)), ("padding_causal", (3, 0), (3, 0)),
    ("padding", (2, 1), (2, 1)), ("padding_causal_bottom_right", (1, 5), (1, 0))])
def test_flash_varlen_function(mask_type, win, want, fake_flash):
    lengths = (5, 0, 1, 7, 3)
    cu = _cu(lengths)
    q = torch.randn(sum(lengths), H, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lengths), G, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    band = make_band(mask_type, win)
    out = vl.flash_varlen(q, k, v, vl.Packed(cu, cu, 7, 7, True), band, D ** -0.5, 0.0)
    assert fake_flash[-1][:2] == want
    dy = torch.randn_like(out)
    out.backward(dy)
    xs = [t.detach().requires_grad_(True) for t in (q, k, v)]
    ref = ref_thd(*xs, cu, cu, mask_type, win)
    ref.backward(dy.flatten(1))
    assert rel_err(out.detach().flatten(1), ref) < 1e-12
    for a, r in zip((q, k, v), xs):
        assert rel_err(a.grad, r.grad) < 1e-12


def test_flash_varlen_refuses_top_left_with_unequal_lengths():
    with pytest.raises(ValueError, match="bottom-right"):
        vl.flash_window(make_band("padding_causal", None), same_lengths=False)
    assert vl.flash_window(make_band("padding_causal_bottom_right", None), same_lengths=False) == (-1, 0)


def _call(fmt, mask_type, win=None):
    return dispatch.Call("DotProductAttention", fmt, mask_type, make_band(mask_type, win), D ** -0.5, 0.0, "flash_varlen")


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask_type, win", [("causal", None), ("causal", (2, 0)), ("no_mask", (1, 1)),
                                            ("padding_causal", None), ("padding", (2, 0))])
def test_dense_and_padded_inputs_through_flash_varlen(fmt, mask_type, win, fake_flash):
    b, s = 3, 6
    shape = (lambda n: (b, s, n, D)) if fmt == "bshd" else (lambda n: (s, b, n, D))
    q = torch.randn(*shape(H), dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(*shape(G), dtype=torch.float64, requires_grad=True) for _ in range(2))
    pad = torch.arange(s).view(1, s) >= torch.tensor([6, 0, 2]).view(b, 1)
    mask = pad.view(b, 1, 1, s) if "padding" in mask_type else None
    call = _call(fmt, mask_type, win)
    batch = dispatch.make_batch("DotProductAttention", fmt, q, k, v, mask_type, call.band, mask, None, None, None, None,
                                None, None)
    out = dispatch._execute(call, batch, "flash_varlen")
    out.backward(torch.ones_like(out))
    to_sbhd = (lambda t: t.transpose(0, 1)) if fmt == "bshd" else (lambda t: t)
    xs = [to_sbhd(t.detach()).requires_grad_(True) for t in (q, k, v)]
    masked = te_mask(s, s, mask_type, win) | (padding_masked(pad, pad) if mask is not None else False)
    ref = ref_attention(*xs, masked)
    ref.backward(torch.ones_like(ref))
    assert rel_err(to_sbhd(out.detach()), ref) < 1e-12
    for a, r in zip((q, k, v), xs):
        assert rel_err(to_sbhd(a.grad), r.grad) < 1e-12


def test_packed_input_with_gaps_through_flash_varlen(fake_flash):
    lengths, slots = (4, 0, 2, 5), (6, 1, 2, 8)
    cu, cu_pad = _cu(lengths), _cu(slots)
    q, k, v = (torch.randn(sum(slots), H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    call = _call("thd", "padding_causal")
    batch = dispatch.make_batch("DotProductAttention", "thd", q, k, v, "padding_causal", call.band, None, cu, cu,
                                cu_pad, cu_pad, None, None)
    out = dispatch._execute(call, batch, "flash_varlen")
    rows = torch.cat([torch.arange(st, st + n) for st, n in zip(cu_pad.tolist(), lengths)])
    ref = ref_thd(*(t.detach()[rows] for t in (q, k, v)), cu, cu, "causal")
    assert rel_err(out.detach()[rows], ref) < 1e-12
    gaps = torch.ones(q.shape[0], dtype=torch.bool)
    gaps[rows] = False
    assert torch.all(out[gaps] == 0)
