"""FP8 attention on a Hopper GPU: cuDNN's FP8 kernels (te_parallel.ops.attention_fp8) against their emulation
(the same quantization in fp32 torch ops, same scales) and against exact fp64 attention of the unquantized
inputs, forward and the gradients of q, k, v; then DotProductAttention under fp8_autocast for several steps.

Tolerances: the kernel's error against fp64 is within 1.25x (+ 0.005) the emulation's error (the kernels
quantize P per tile of keys against a running row max, the emulation against the row's final max, so the two
differ by FP8 roundings, not by more); kernel vs emulation directly: 0.08 forward, 0.15 gradients (two
roundings of P apart where a row's max is not in its first tile of keys). DotProductAttention over 5 steps:
within 0.10 (output) and 0.25 (gradients, E5M2) of bf16 attention from the second step on.
"""
import copy
import math

import pytest
import torch

import te_parallel as te
from te_parallel import recipe
from te_parallel.ops import attention as attn_ops
from te_parallel.ops import attention_cudnn_fe as cudnn_fe
from te_parallel.ops import attention_fp8 as fp8a
from te_parallel.ops import attention_fp8_graphs as fp8_graphs
from te_parallel.ops import attention_fp8_state as fp8_state
from te_parallel.ops.attention import Band
from tests.attention_reference import causal, ref_attention
from tests.reference import rel_err

HYBRID = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID)


@pytest.fixture
def hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip(f"cuDNN's FP8 attention kernels run on Hopper (sm_90); this GPU is sm_{major}{minor}")
    if not cudnn_fe.available():
        pytest.skip("needs the cuDNN frontend: pip install nvidia-cudnn-frontend")
    return torch.device("cuda")


def test_probe_builds_and_runs_both_graphs(hopper):
    fp8a.probe(hopper)


def _plan(state, kernel):
    return fp8_state.Plan(state, HYBRID, None, False, torch.float8_e4m3fn, torch.float8_e5m2, kernel)


def _copy(state):
    """An independent copy of an FP8 state (its cached slot views dropped: they name the original's buffers)."""
    other = copy.deepcopy(state)
    other._views.clear()
    return other


def _run(plan, q, k, v, dy, sbhd, band, scale):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fp8a.fp8_attention(q, k, v, sbhd, band, scale, plan)
    out.backward(dy)
    return out.detach(), (q.grad, k.grad, v.grad)


def _calibrated_state(q, k, v, dy, sbhd, band, scale):
    """A state whose scales come from one emulated pass over these inputs (as after a step of training)."""
    state = fp8_state.new_state(q.device)
    with torch.no_grad():
        for slot, t in enumerate((q, k, v)):
            state.fwd_scale[slot] = 448.0 / t.float().abs().max()
    _run(_plan(state, False), q, k, v, dy, sbhd, band, scale)  # the backward's update sets the backward scales
    with torch.no_grad():
        state.fwd_scale[3] = 448.0 / state.fwd_amax_history[0, 3]
        state.fwd_amax_history.zero_()
    return state


CASES = [  # (fmt, mask, h, g, b, s)
    ("sbhd", "causal", 16, 16, 2, 512),
    ("bshd", "causal", 16, 4, 2, 512),
    ("sbhd", "no_mask", 16, 4, 2, 1024),
    ("bshd", "no_mask", 8, 8, 1, 2048),
    ("sbhd", "causal", 16, 4, 1, 4096),
    ("bshd", "causal", 32, 8, 1, 4096),
]


@pytest.mark.parametrize("fmt,mask,h,g,b,s", CASES)
def test_kernel_vs_emulation_and_fp64(hopper, fmt, mask, h, g, b, s):
    d, sbhd = 128, fmt == "sbhd"
    band = Band(False, -1, 0) if mask == "causal" else Band(True, -1, -1)
    scale = 1 / math.sqrt(d)
    gen = torch.Generator(device="cuda").manual_seed(s + h + g)
    shape = (lambda n: (s, b, n, d)) if sbhd else (lambda n: (b, s, n, d))
    q, k, v = (torch.randn(shape(n), device="cuda", generator=gen).bfloat16() for n in (h, g, g))
    dy = torch.randn(*shape(h)[:2], h * d, device="cuda", generator=gen).bfloat16()
    state = _calibrated_state(q, k, v, dy, sbhd, band, scale)
    out_k, grads_k = _run(_plan(_copy(state), True), q, k, v, dy, sbhd, band, scale)
    out_e, grads_e = _run(_plan(_copy(state), False), q, k, v, dy, sbhd, band, scale)

    def sb(t):  # -> [s, b, ...] for the fp64 reference
        return t if sbhd else t.transpose(0, 1)
    qr, kr, vr = (sb(t).double().requires_grad_(True) for t in (q, k, v))
    ref = ref_attention(qr, kr, vr, causal(s, s).cuda() if mask == "causal" else None, scale=scale)
    ref.backward(sb(dy).double())
    ref_grads = (qr.grad, kr.grad, vr.grad)
    err_k, err_e = rel_err(sb(out_k).double(), ref), rel_err(sb(out_e).double(), ref)
    print(f"\n{fmt} {mask} h{h} g{g} b{b} s{s}: forward vs fp64 kernel {err_k:.4f} emulation {err_e:.4f} "
          f"kernel vs emulation {rel_err(out_k.double(), out_e.double()):.4f}")
    assert err_k <= 1.25 * err_e + 0.005
    assert rel_err(out_k.double(), out_e.double()) < 0.08
    for name, gk, ge, gr in zip("qkv", grads_k, grads_e, ref_grads):
        ek, ee = rel_err(sb(gk).double(), gr), rel_err(sb(ge).double(), gr)
        print(f"  d{name} vs fp64: kernel {ek:.4f} emulation {ee:.4f} kernel vs emulation "
              f"{rel_err(gk.double(), ge.double()):.4f}")
        assert gk.dtype == torch.bfloat16 and gk.shape == ge.shape
        assert ek <= 1.25 * ee + 0.005
        assert rel_err(gk.double(), ge.double()) < 0.15


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(fp8_dpa=True, amax_history_len=16),
                                 recipe.Float8CurrentScaling(fp8_dpa=True)], ids=["delayed", "current"])
def test_dot_product_attention_steps_under_fp8_autocast(hopper, rec):
    h, g, d, s, b = 16, 4, 128, 1024, 2
    dpa = te.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="causal")
    bf16 = te.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="causal")
    errs = []
    for step in range(5):
        torch.manual_seed(step)
        q, k, v = (torch.randn(s, b, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (h, g, g))
        with te.fp8_autocast(fp8_recipe=rec):
            out = dpa(q, k, v)
        assert dpa.last_backend == "cudnn_fe_fp8"
        dy = torch.randn_like(out)
        out.backward(dy)
        qb, kb, vb = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        ref = bf16(qb, kb, vb)
        ref.backward(dy)
        errs.append([rel_err(out.double(), ref.double())] + [rel_err(a.grad.double(), r.grad.double())
                                                               for a, r in ((q, qb), (k, kb), (v, vb))])
        assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    print(f"\n{type(rec).__name__}: per step [out, dq, dk, dv] vs bf16: " + "; ".join(
        ", ".join(f"{e:.4f}" for e in row) for row in errs))
    st = dpa.fp8_attention_state
    # the delayed slots have moved from 1: all of Q, K, V, O and dO, dP, dQ, dK, dV under DelayedScaling; under
    # current scaling only those the kernels write (O; dP, dQ, dK, dV): Q, K, V and dO are scaled from their
    # own amax at the cast and their slots are never written
    kept = slice(0, 4) if rec.scaling == "delayed" else slice(3, 4)
    bwd_kept = slice(0, 5) if rec.scaling == "delayed" else slice(1, 5)
    assert (st.fwd_scale[kept] != 1).all() and (st.bwd_scale[bwd_kept] != 1).all(), (st.fwd_scale, st.bwd_scale)
    if rec.scaling == "current":
        assert (st.fwd_scale[:3] == 1).all() and st.bwd_scale[0] == 1
    for row in errs[1:]:  # from the second step on the delayed scales have seen a pass
        assert row[0] < 0.10 and max(row[1:]) < 0.25


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_kernel_is_bitwise_the_torch_form(hopper, fp8, dtype):
    from te_parallel.ops import fp8_dequantize
    gen = torch.Generator(device="cuda").manual_seed(1)
    t8 = (torch.randn(4097, 333, device="cuda", generator=gen) * 300).to(fp8)
    descales = torch.tensor([2.0 ** -9, 3.3e-3, 0.7], device="cuda")
    for descale in (descales[1], descales[2:3], descales[0]):
        assert fp8_dequantize.usable(t8, dtype)
        got = fp8_dequantize.dequantize(t8, descale, dtype)
        want = fp8_dequantize.dequantize_torch(t8, descale, dtype)
        assert torch.equal(got.view(torch.uint8) if dtype != torch.float32 else got.view(torch.int32),
                           want.view(torch.uint8) if dtype != torch.float32 else want.view(torch.int32))


def test_graph_variant_is_bf16_outputs_or_fp8_outputs(hopper):
    """The graphs the call used: bf16 O and dQ, dK, dV where cuDNN builds them, else FP8 outputs (printed)."""
    d, s = 128, 512
    plan = _plan(fp8_state.new_state(hopper), True)
    q = torch.randn(s, 1, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(s, 1, 2, d, device="cuda", dtype=torch.bfloat16)
    key = fp8_graphs.graph_key(q, k, True, Band(False, -1, 0), 1 / math.sqrt(d), plan)
    used, fwd, bwd = fp8_graphs.choose_graphs(key, True, torch.bfloat16)
    print(f"\nFP8 attention graphs on {torch.cuda.get_device_name()}: outputs in "
          f"{used.hp_out or 'FP8 (dequantized after the kernels)'}")
    assert used.hp_out in (None, torch.bfloat16) and fwd is not None and bwd is not None
    # either way the kernel-written amaxes reach the state: one pass with the graphs fp8_attention picks
    q, k = q.requires_grad_(True), k.requires_grad_(True)
    v = torch.randn_like(k, requires_grad=True)
    fp8a.fp8_attention(q, k, v, True, Band(False, -1, 0), 1 / math.sqrt(d), plan).float().square().sum().backward()
    assert plan.state.fwd_amax_history[0, fp8_state.O] > 0 and (plan.state.bwd_scale[1:] != 1).all()


def test_unsupported_input_falls_back_to_bf16_with_a_warning(hopper):
    dpa = te.DotProductAttention(8, 128, attn_mask_type="causal", window_size=(64, 0))
    q, k, v = (torch.randn(256, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = dpa(q, k, v)
    attn_ops._WARNED.difference_update([w for w in attn_ops._WARNED if isinstance(w, tuple) and w[0] == "fp8_dpa"])
    with pytest.warns(UserWarning, match="FP8 attention .* cannot run this input"):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
            out = dpa(q, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
