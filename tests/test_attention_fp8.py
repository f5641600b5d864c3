"""FP8 attention (recipes' fp8_dpa / fp8_mha) on CPU: the emulation of cuDNN's FP8 kernels against fp64
(the same quantization computed in fp64, and exact attention of the unquantized inputs) and against
high-precision attention, forward and gradients; the scale and amax bookkeeping across steps under delayed
and current scaling; the fallbacks and errors. The kernels themselves: tests/gpu/test_attention_fp8_cuda.py."""
import collections
import math
import types
import warnings

import pytest
import torch

import te_parallel as te
from te_parallel import recipe
from te_parallel.recipe import fp8_max
from te_parallel.fp8.te_extra_state import te_recipe
from te_parallel.ops import attention as attn_ops
from te_parallel.ops import attention_fp8 as fp8a
from te_parallel.ops import attention_fp8_emulation as fp8_emul
from te_parallel.ops import attention_fp8_graphs as fp8_graphs
from te_parallel.ops import attention_fp8_state as fp8_state
from te_parallel.ops import fp8_dequantize
from te_parallel.ops.attention import Band
from tests.attention_reference import causal, ref_attention
from tests.reference import rel_err
from tests import triton_interpreter

S, B, H, G, D = 64, 2, 4, 2, 32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CAUSAL, FULL = Band(False, -1, 0), Band(True, -1, -1)


def _qkv(s=S, skv=S, h=H, g=G, dtype=torch.float32, fmt="sbhd", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda n, s_: (s_, B, n, D)) if fmt == "sbhd" else (lambda n, s_: (B, s_, n, D))
    mk = lambda n, s_: (torch.randn(shape(n, s_), generator=gen) * 1.5).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(h, s), mk(g, skv), mk(g, skv)


def _bhsd(t):  # [s, b, n, d] -> [b, n, s, d]
    return t.permute(1, 2, 0, 3)


def _quantized(seed=0, band=CAUSAL, s=S):
    """FP8 q, k, v [b, n, s, d] with their current scales, and the forward's o8/stats for them."""
    q, k, v = (_bhsd(t.detach()) for t in _qkv(s, s, seed=seed))
    out = []
    for t in (q, k, v):
        scale = 448.0 / t.abs().amax()
        out += [fp8_emul.to_fp8(t, scale, E4M3), (1 / scale).float()]
    return out


def _ref_forward_fp64(q8, k8, v8, dq, dk, dv, scale_o, attn_scale, masked):
    """The kernels' forward written out in fp64: P relative to the row max, quantized with scale_s = 448."""
    qd, kd, vd = (t.double() * s.double() for t, s in ((q8, dq), (k8, dk), (v8, dv)))
    kd, vd = (x.repeat_interleave(qd.shape[1] // x.shape[1], 1) for x in (kd, vd))
    s = (qd @ kd.transpose(-1, -2) * attn_scale).masked_fill(masked, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    pq = (p * 448).clamp(-448, 448).to(E4M3).double() / 448
    o = pq @ vd / p.sum(-1, keepdim=True)
    return o, (o * scale_o.double()).clamp(-448, 448).to(E4M3)


def test_emulated_forward_is_the_fp64_computation_of_the_same_quantization():
    q8, dq, k8, dk, v8, dv = _quantized()
    scale_o = torch.tensor(448.0 / 2.0)
    o8, stats, amax_o = fp8_emul.emulate_forward(q8, k8, v8, dq, dk, dv, scale_o, 1 / math.sqrt(D), CAUSAL)
    o_ref, o8_ref = _ref_forward_fp64(q8, k8, v8, dq, dk, dv, scale_o, 1 / math.sqrt(D), causal(S, S))
    assert o8.dtype == E4M3 and o8.shape == (B, H, S, D) and stats.shape == (B, H, S, 1)
    assert abs(amax_o.item() - o_ref.abs().max().item()) < 1e-5 * o_ref.abs().max().item()
    # fp32 vs fp64 arithmetic flips an FP8 rounding now and then: one FP8 step (6 %) on a few elements
    assert rel_err(o8.double(), o8_ref.double()) < 3e-3
    assert (o8.double() != o8_ref.double()).double().mean() < 0.01


@pytest.mark.parametrize("band", [CAUSAL, FULL], ids=["causal", "no_mask"])
def test_emulated_backward_fp32_matches_fp64(band):
    q8, dq, k8, dk, v8, dv = _quantized(band=band)
    scale_o = torch.tensor(100.0)
    o8, stats, _ = fp8_emul.emulate_forward(q8, k8, v8, dq, dk, dv, scale_o, 0.2, band, compute=torch.float64)
    do8 = fp8_emul.to_fp8(torch.randn(B, H, S, D), torch.tensor(2e4), E5M2)
    descales = (dq, dk, dv, 1 / scale_o, torch.tensor(1 / 2e4))
    scales = tuple(torch.tensor(x) for x in (2e4, 3e4, 3e4, 3e4))
    g32, a32 = fp8_emul.emulate_backward(q8, k8, v8, o8, do8, stats, descales, scales, 0.2, band)
    g64, a64 = fp8_emul.emulate_backward(q8, k8, v8, o8, do8, stats, descales, scales, 0.2, band, compute=torch.float64)
    for a, r in zip(g32, g64):
        assert a.dtype == E5M2
        assert rel_err(a.double(), r.double()) < 1e-2
    for a, r in zip(a32, a64):
        assert abs(a.item() - r.item()) <= 1e-5 * r.item()


def _assert_fresh(state):
    """The state of a layer that never ran FP8 attention: scales 1, histories and update counts 0."""
    for backward in (False, True):
        hist, scale, scale_inv = state.tensors(backward)
        assert not hist.any() and (scale == 1).all() and (scale_inv == 1).all()
    assert state.updates() == [0, 0]


def _fp8_step(dpa, q, k, v, rec, dy=None):
    with te.fp8_autocast(fp8_recipe=rec):
        out = dpa(q, k, v)
    out.backward(torch.ones_like(out) if dy is None else dy)
    return out


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(fp8_dpa=True, amax_history_len=4),
                                 recipe.DelayedScaling(fp8_mha=True, fp8_format=recipe.Format.E4M3),
                                 recipe.Float8CurrentScaling(fp8_dpa=True)], ids=["delayed", "delayed_e4m3", "current"])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_fp8_attention_vs_fp64_and_high_precision(rec, mask_type):
    """Output and gradients within FP8's error of exact fp64 attention, and within it of the layer's
    high-precision attention (second step: the delayed scales have seen one pass)."""
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type=mask_type)
    q, k, v = _qkv()
    dy = torch.randn(S, B, H * D)
    _fp8_step(dpa, q, k, v, rec, dy)
    for t in (q, k, v):
        t.grad = None
    out = _fp8_step(dpa, q, k, v, rec, dy)
    assert dpa.last_backend == "fp8_emulation"
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = ref_attention(qr, kr, vr, causal(S, S) if mask_type == "causal" else None)
    ref.backward(dy.double())
    bf16 = te.DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type=mask_type)(
        *(t.detach().bfloat16() for t in (q, k, v)))
    bwd_e5m2 = rec.fp8_format is recipe.Format.HYBRID
    # measured: forward 0.064 (causal) / 0.071 (no mask), bf16 0.004; gradients 0.095-0.126 (E5M2) / 0.069-0.095 (E4M3)
    assert rel_err(out, ref) < 0.08
    assert rel_err(out.double(), bf16.double()) < 0.08
    assert rel_err(bf16.double(), ref) < 0.01
    for a, r in ((q, qr), (k, kr), (v, vr)):
        assert rel_err(a.grad, r.grad) < (0.15 if bwd_e5m2 else 0.11)


def test_bshd_is_sbhd_transposed():
    rec = recipe.Float8CurrentScaling(fp8_dpa=True)
    q, k, v = _qkv()
    dy = torch.randn(S, B, H * D)
    outs = []
    for fmt in ("sbhd", "bshd"):
        dpa = te.DotProductAttention(H, D, num_gqa_groups=G, qkv_format=fmt)
        args = (q, k, v) if fmt == "sbhd" else tuple(t.detach().transpose(0, 1).requires_grad_(True) for t in (q, k, v))
        out = _fp8_step(dpa, *args, rec, dy if fmt == "sbhd" else dy.transpose(0, 1))
        outs.append((out if fmt == "sbhd" else out.transpose(0, 1), [a.grad if fmt == "sbhd" else a.grad.transpose(0, 1) for a in args]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_delayed_bookkeeping_across_steps():
    """Forward amaxes of q, k, v (the casts) and O (the kernel), backward amaxes of dO, dP, dQ, dK, dV, land in
    the histories, and the scales follow fp8_max / max(history) after each pass."""
    rec = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=3)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G)
    seen_fwd, seen_bwd = [], []
    for step in range(4):
        q, k, v = _qkv(seed=step)
        st = dpa.fp8_attention_state
        scales_before = (st.fwd_scale.clone(), st.bwd_scale.clone())
        dy = torch.randn(S, B, H * D) * (step + 1)
        out = _fp8_step(dpa, q, k, v, rec, dy)
        st = dpa.fp8_attention_state
        # what the pass recorded, recomputed from its inputs and the scales it used
        q8, dq = fp8_emul.to_fp8(q.detach(), scales_before[0][0], E4M3), 1 / scales_before[0][0]
        k8, dk = fp8_emul.to_fp8(k.detach(), scales_before[0][1], E4M3), 1 / scales_before[0][1]
        v8, dv = fp8_emul.to_fp8(v.detach(), scales_before[0][2], E4M3), 1 / scales_before[0][2]
        _, _, amax_o = fp8_emul.emulate_forward(*(_bhsd(t) for t in (q8, k8, v8)), dq, dk, dv, scales_before[0][3],
                                            1 / math.sqrt(D), CAUSAL)
        fwd = torch.stack([q.detach().abs().max(), k.detach().abs().max(), v.detach().abs().max(), amax_o])
        seen_fwd.append(fwd)
        torch.testing.assert_close(st.fwd_amax_history[1, :4], fwd, rtol=1e-6, atol=0)
        assert st.bwd_amax_history[1, 0] == dy.abs().max()
        assert (st.bwd_amax_history[1, 1:] > 0).all()
        seen_bwd.append(st.bwd_amax_history[1].clone())
        window = torch.stack(seen_fwd[-3:]).amax(0)
        torch.testing.assert_close(st.fwd_scale[:4], 448.0 / window, rtol=1e-6, atol=0)
        assert (st.fwd_scale[4:] == 1).all()  # unused slots
        torch.testing.assert_close(st.bwd_scale, 57344.0 / torch.stack(seen_bwd[-3:]).amax(0), rtol=1e-6, atol=0)
        assert out.dtype == q.dtype


def test_current_scaling_scales_qkv_from_the_tensors():
    """Q, K, V from their own amax (nothing recorded for them), O from the previous pass's amax."""
    rec = recipe.Float8CurrentScaling(fp8_dpa=True)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type="no_mask")
    amax_o_prev = None
    for step in range(2):
        q, k, v = _qkv(seed=10 + step)
        scale_o = dpa.fp8_attention_state.fwd_scale[3].clone()
        with te.fp8_autocast(fp8_recipe=rec):
            out = dpa(q, k, v)
        parts = []
        for t in (q, k, v):
            scale = 448.0 / t.detach().abs().max()
            parts += [_bhsd(fp8_emul.to_fp8(t.detach(), scale, E4M3)), 1 / scale]
        o8, _, amax_o = fp8_emul.emulate_forward(*parts[0::2], *parts[1::2], scale_o, 1 / math.sqrt(D), FULL)
        expect = (o8.float() / scale_o).permute(2, 0, 1, 3).reshape(S, B, H * D)
        torch.testing.assert_close(out.detach(), expect, rtol=1e-6, atol=1e-6)
        st = dpa.fp8_attention_state
        assert (st.fwd_amax_history[:, :3] == 0).all()
        torch.testing.assert_close(st.fwd_scale[3], 448.0 / amax_o, rtol=1e-6, atol=0)
        if amax_o_prev is not None:
            torch.testing.assert_close(scale_o, 448.0 / amax_o_prev, rtol=1e-6, atol=0)
        amax_o_prev = amax_o
        assert st.fwd_amax_history.shape[0] == 1


@pytest.mark.parametrize("case", ["padding", "thd", "window", "dropout", "arbitrary"])
def test_inputs_fp8_attention_does_not_take_run_in_high_precision_with_one_warning(case):
    rec = recipe.DelayedScaling(fp8_dpa=True)
    kw, fwd = {}, {}
    q, k, v = _qkv()
    if case == "padding":
        kw["attn_mask_type"] = "padding"
        fwd["attention_mask"] = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    elif case == "thd":
        kw["qkv_format"] = "thd"
        q, k, v = (t.detach()[:, 0].contiguous() for t in (q, k, v))
        fwd["cu_seqlens_q"] = fwd["cu_seqlens_kv"] = torch.tensor([0, 20, S], dtype=torch.int32)
    elif case == "window":
        kw["window_size"] = (8, 0)
    elif case == "dropout":
        kw["attention_dropout"] = 0.1
    else:
        kw["attn_mask_type"] = "arbitrary"
        fwd["attention_mask"] = torch.rand(B, 1, S, S) < 0.2
    torch.manual_seed(0)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G, **kw)
    hp = dpa(q, k, v, **fwd)
    attn_ops._WARNED.difference_update([w for w in attn_ops._WARNED if isinstance(w, tuple) and w[0] == "fp8_dpa"])
    with pytest.warns(UserWarning, match="FP8 attention .* cannot run this input"):
        torch.manual_seed(0)
        with te.fp8_autocast(fp8_recipe=rec):
            out = dpa(q, k, v, **fwd)
    torch.testing.assert_close(out, hp, rtol=0, atol=0)
    assert dpa.last_backend != "fp8_emulation"
    _assert_fresh(dpa.fp8_attention_state)


def test_errors():
    rec = recipe.DelayedScaling(fp8_dpa=True)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend='flash' runs attention in .* use backend='auto'"):
        with te.fp8_autocast(fp8_recipe=rec):
            te.DotProductAttention(H, D, num_gqa_groups=G, backend="flash")(q, k, v)
    with pytest.raises(ValueError, match="fp8_output"):
        with te.fp8_autocast(fp8_recipe=rec):
            te.DotProductAttention(H, D, num_gqa_groups=G)(q, k, v, fp8_output=True)
    with pytest.raises(TypeError, match="fp8_dpa must be a bool"):
        recipe.DelayedScaling(fp8_dpa="yes")
    with pytest.raises(TypeError, match="fp8_mha must be a bool"):
        recipe.Float8CurrentScaling(fp8_mha=1)
    with pytest.raises(ValueError, match="fp8_dpa / fp8_mha"):
        recipe.Float8BlockScaling(fp8_dpa=True)


def test_no_fp8_attention_without_the_recipe_field_or_outside_autocast():
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G)
    q, k, v = _qkv()
    hp = dpa(q, k, v)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        out = dpa(q, k, v)
    torch.testing.assert_close(out, hp, rtol=0, atol=0)
    with te.fp8_autocast(enabled=False, fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        out = dpa(q, k, v)
    torch.testing.assert_close(out, hp, rtol=0, atol=0)
    _assert_fresh(dpa.fp8_attention_state)


def test_state_dict_round_trip_and_te_recipe_record():
    rec = recipe.DelayedScaling(fp8_dpa=True, amax_history_len=5)
    dpa = te.DotProductAttention(H, D, num_gqa_groups=G)
    q, k, v = _qkv()
    for _ in range(2):
        _fp8_step(dpa, q, k, v, rec)
    sd = dpa.state_dict()
    assert "fp8_attention_state.fwd_scale" in sd
    fresh = te.DotProductAttention(H, D, num_gqa_groups=G)
    fresh.load_state_dict(sd)  # strict: the fresh layer has the state, of the same slots
    for key, value in sd.items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out_a = _fp8_step(dpa, q, k, v, rec)
        out_b = _fp8_step(fresh, q, k, v, rec)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    assert te_recipe(rec).fields["fp8_dpa"] is True
    assert te_recipe(recipe.DelayedScaling()).fields["fp8_dpa"] is False


def test_compat_recipe_carries_fp8_dpa():
    compat = pytest.importorskip("transformer_engine.common.recipe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = compat.to_te_parallel(compat.DelayedScaling(fp8_dpa=True, amax_history_len=3))
    assert converted.fp8_dpa and not converted.fp8_mha
    assert compat.to_te_parallel(compat.Float8CurrentScaling(fp8_mha=True)).fp8_mha


# -- the kernel path's plumbing against a stand-in of the cuDNN frontend's pygraph ----------------------
# (the kernels themselves run in tests/gpu; here: every described tensor gets a buffer of its dtype and
# size, the graphs are built before anything is recorded, and a refused E5M2 backward turns into E4M3)

class _FakeTensor:
    def __init__(self, name, dim=None, stride=None, dt=None, virtual=False):
        self.name, self.dim, self.stride, self.dt, self.virtual = name, dim, stride, dt, virtual

    def set_output(self, flag):
        self.virtual = not flag
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, dt):
        self.dt = dt
        return self


class _FakeGraph:
    refuse_e5m2 = False
    refuse_hp_backward = False  # refuse bf16/fp16 dQ, dK, dV (as the frontend does on Hopper)
    executed = []
    kinds = []  # per execution: "fwd"/"bwd" and the dtype of o / dq

    def __init__(self, **kwargs):
        self.tensors = []

    def tensor(self, name, dim, stride, data_type):
        self.tensors.append(_FakeTensor(name, list(dim), list(stride), data_type))
        return self.tensors[-1]

    def _outputs(self, n):
        self.tensors += [_FakeTensor(f"out{i}", virtual=True) for i in range(n)]
        return self.tensors[-n:]

    def sdpa_fp8(self, **kw):
        assert set(kw) >= {"q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"}
        return self._outputs(4)

    def sdpa_fp8_backward(self, **kw):
        if self.refuse_e5m2 and kw["dO"].dt == torch.float8_e5m2:
            raise RuntimeError("E5M2 dO not supported here")
        return self._outputs(7)

    def validate(self):
        outputs = [t for t in self.tensors if t.name.startswith("out") and not t.virtual]
        if self.refuse_hp_backward and len(outputs) >= 7 and outputs[0].dt in (torch.bfloat16, torch.float16):
            raise RuntimeError("sdpa fp8 backward with HALF/BFLOAT16 output is only supported on Blackwell")

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        pass

    def get_workspace_size(self):
        return 0

    def execute(self, pack, workspace, handle=None):
        described = [t for t in self.tensors if not t.virtual]
        assert set(pack) == set(described), "every described tensor and nothing else is bound"
        for t, buf in pack.items():
            assert buf.dtype == t.dt and buf.numel() == math.prod(t.dim), (t.name, buf.dtype, t.dt, buf.shape, t.dim)
            assert max(st * (n - 1) for st, n in zip(t.stride, t.dim)) < buf.numel()
        _FakeGraph.executed.append(sorted(t.name for t in described))
        for t, buf in pack.items():  # the amaxes the kernels report: 2
            if t.name.startswith("out") and t.dim == [1, 1, 1, 1]:
                buf.fill_(2.0)
        first = next(t for t in self.tensors if t.name.startswith("out"))
        _FakeGraph.kinds.append(("bwd" if "dO" in _FakeGraph.executed[-1] else "fwd", first.dt))


@pytest.fixture
def fake_frontend(monkeypatch):
    from te_parallel.ops import attention_cudnn_fe as fe
    dt = types.SimpleNamespace(FP8_E4M3=torch.float8_e4m3fn, FP8_E5M2=torch.float8_e5m2, FLOAT=torch.float32,
                               BFLOAT16=torch.bfloat16, HALF=torch.float16)
    monkeypatch.setitem(fe._frontend, "module", types.SimpleNamespace(
        pygraph=_FakeGraph, data_type=dt, heur_mode=types.SimpleNamespace(A=0, FALLBACK=1)))
    monkeypatch.setattr(fe, "_handle", lambda index: None)
    monkeypatch.setattr(fe, "_index", lambda device: 0)
    monkeypatch.setattr(fe, "_graphs", collections.OrderedDict())
    monkeypatch.setattr(fp8_graphs, "_CHOSEN", {})
    monkeypatch.setattr(fp8_graphs, "high_precision_outputs", lambda device: True)  # (a GPU that may build them)
    monkeypatch.setattr(_FakeGraph, "executed", [])
    monkeypatch.setattr(_FakeGraph, "kinds", [])
    return _FakeGraph


@pytest.mark.parametrize("sbhd", [True, False])
def test_kernel_path_binds_every_graph_tensor(fake_frontend, sbhd):
    plan = fp8_state.Plan(fp8_state.new_state("cpu"), recipe.DelayedScaling(), None, False, E4M3, E5M2, True)
    q, k, v = _qkv(fmt="sbhd" if sbhd else "bshd")
    out = fp8a.fp8_attention(q, k, v, sbhd, CAUSAL, 0.125, plan)
    out.sum().backward()
    fwd, bwd = fake_frontend.executed
    assert {"q", "k", "v", "scale_o", "descale_s"} <= set(fwd) and {"dO", "o", "stats", "scale_dP"} <= set(bwd)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and out.shape == (*q.shape[:2], H * D)
    assert plan.state.bwd_scale[0] == 57344.0  # dO's amax (1) recorded, E5M2's max


@pytest.mark.parametrize("refused", [False, True], ids=["bf16 outputs", "refused: FP8 outputs"])
def test_bf16_output_graphs_first_fp8_output_graphs_where_refused(fake_frontend, monkeypatch, refused):
    """bf16 inputs: the graphs that write O, dQ, dK, dV in bf16 where cuDNN builds both, else the FP8-output pair
    (forward too: the backward reads the forward's O); the kernels' amaxes land in the histories either way."""
    monkeypatch.setattr(fake_frontend, "refuse_hp_backward", refused)
    plan = fp8_state.Plan(fp8_state.new_state("cpu"), recipe.DelayedScaling(), None, False, E4M3, E5M2, True)
    q, k, v = (t.detach().bfloat16().requires_grad_(True) for t in _qkv())
    out = fp8a.fp8_attention(q, k, v, True, CAUSAL, 0.125, plan)
    out.float().sum().backward()
    want = (E4M3, E5M2) if refused else (torch.bfloat16, torch.bfloat16)
    assert fake_frontend.kinds == [("fwd", want[0]), ("bwd", want[1])]
    assert fp8_graphs.outputs_of(q, k, True) == ("fp8" if refused else "bf16")
    fp8a.fp8_attention(q, k, v, True, CAUSAL, 0.125, plan).float().sum().backward()  # the choice, looked up
    assert fake_frontend.kinds[2:] == fake_frontend.kinds[:2]
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
    assert plan.state.fwd_amax_history[0, fp8_state.O] == 2.0
    assert plan.state.bwd_scale[fp8_state.DP:].tolist() == [57344.0 / 2] * 4  # updated at the end of the backward


def test_refused_e5m2_backward_runs_e4m3_with_one_warning(fake_frontend, monkeypatch):
    monkeypatch.setattr(fake_frontend, "refuse_e5m2", True)
    attn_ops._WARNED.discard(("fp8_dpa", "e4m3 backward"))
    plan = fp8_state.Plan(fp8_state.new_state("cpu"), recipe.DelayedScaling(), None, False, E4M3, E5M2, True)
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match="refuses E5M2 gradients .* runs in E4M3"):
        out = fp8a.fp8_attention(q, k, v, True, CAUSAL, 0.125, plan)
    out.sum().backward()
    assert q.grad.dtype == q.dtype
    assert plan.state.bwd_scale[0] == 448.0  # updated with E4M3's max


def test_refused_graph_records_nothing(fake_frontend, monkeypatch):
    monkeypatch.setattr(fake_frontend, "sdpa_fp8", lambda self, **kw: (_ for _ in ()).throw(RuntimeError("no")))
    plan = fp8_state.Plan(fp8_state.new_state("cpu"), recipe.DelayedScaling(), None, False, E4M3, E5M2, True)
    from te_parallel.ops.attention_cudnn_fe import CudnnFeUnsupported
    with pytest.raises(CudnnFeUnsupported, match="cannot describe this FP8 attention graph"):
        fp8a.fp8_attention(*_qkv(), True, CAUSAL, 0.125, plan)
    assert not plan.state.fwd_amax_history.any()


def test_transformer_layer_with_fp8_attention():
    """The layer's core attention takes q, k, v as views of its fused QKV output; FP8 attention changes the
    layer's output and input gradient by FP8 attention's error only (against the same layer, same FP8 GEMMs)."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(128, 256, H, num_gqa_groups=G, fuse_qkv_params=True, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal")
    x = torch.randn(S, B, 128, requires_grad=True)
    outs = []
    for rec in (recipe.DelayedScaling(), recipe.DelayedScaling(fp8_dpa=True)):
        for _ in range(2):  # the second pass: scales from the first
            x.grad = None
            with te.fp8_autocast(fp8_recipe=rec):
                y = layer(x)
            y.sum().backward()
        outs.append((y.detach(), x.grad.clone(), layer.self_attention.core_attention.last_backend))
    assert outs[1][2] == "fp8_emulation" and outs[0][2] != "fp8_emulation"
    # measured 0.0012 and 0.0078 (the residual carries most of the output)
    assert 0 < rel_err(outs[1][0], outs[0][0]) < 0.005
    assert 0 < rel_err(outs[1][1], outs[0][1]) < 0.03


def run_dequantize_interpreted() -> None:
    """The one-launch dequantize against its torch form (run with TRITON_INTERPRET=1 set before triton is
    imported): fp32 outputs bit for bit; bf16/fp16 within one rounding (the interpreter truncates where the GPU
    rounds to nearest even: the GPU test compares bytes). A ragged tail, a descale that is a view into a vector."""
    gen = torch.Generator().manual_seed(0)
    descales = torch.tensor([0.0, 3.0e-3, 7.5])
    for dtype in (E4M3, E5M2):
        t8 = (torch.randn(3, 5001, generator=gen) * 100).to(dtype)
        t8[0, :4] = torch.tensor([0.0, -0.0, fp8_max(dtype), -fp8_max(dtype)]).to(dtype)
        for descale in (descales[1], descales[2:3]):
            want = fp8_dequantize.dequantize_torch(t8, descale, torch.float32)
            out = torch.empty(t8.shape, dtype=torch.float32)
            fp8_dequantize._launch(t8, descale, out)
            assert torch.equal(out, want), dtype
            for hp in (torch.bfloat16, torch.float16):
                out = torch.empty(t8.shape, dtype=hp)
                fp8_dequantize._launch(t8, descale, out)
                ulp = 2.0 ** -7 if hp is torch.bfloat16 else 2.0 ** -10
                over = want.to(hp).isinf()  # past fp16's range (E5M2 x 7.5): inf in both
                assert torch.equal(out.isinf(), over) and torch.equal(out[over], want.to(hp)[over]), (dtype, hp)
                assert bool(((out.float() - want).abs() <= want.abs() * ulp)[~over].all()), (dtype, hp)
    print("dequantize interpreted: ok")


@pytest.mark.skipif(fp8_dequantize.triton is None, reason="needs triton (import triton failed)")
def test_dequantize_kernel_under_the_triton_interpreter():
    triton_interpreter.run_interpreted("tests.test_attention_fp8", "run_dequantize_interpreted")


def test_dequantize_checks_and_cpu_path():
    t8 = torch.tensor([1.0, -2.5, 448.0]).to(E4M3)
    out = fp8_dequantize.dequantize(t8, torch.tensor(0.5), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.tolist() == [0.5, -1.25, 224.0]
    with pytest.raises(ValueError, match="need torch.float8_e4m3fn or torch.float8_e5m2 bytes and one descale"):
        fp8_dequantize.dequantize(t8, torch.ones(2), torch.bfloat16)
    with pytest.raises(ValueError, match="got torch.bfloat16 bytes"):
        fp8_dequantize.dequantize(out, torch.tensor(1.0), torch.float32)


def test_activation_recompute_runs_attention_in_high_precision_with_one_warning():
    """Under te.checkpoint the original forward and its replay both run high-precision attention (FP8 attention
    does not replay its forward's scales): one warning naming it, and the gradients of a checkpointed step equal
    those of the same step without FP8 attention."""
    torch.manual_seed(0)
    mk = lambda n: torch.randn(32, 2, n, 16, dtype=torch.float32, requires_grad=True)  # noqa: E731
    q, k, v = mk(4), mk(2), mk(2)
    dpa = te.DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type="causal")
    attn_ops._WARNED.clear()
    with pytest.warns(UserWarning, match="activation recompute"):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
            out = te.checkpoint(dpa, q, k, v)
    assert dpa.last_backend not in ("cudnn_fe_fp8", "fp8_emulation")
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    dpa(q, k, v).square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        assert torch.equal(g, t.grad)
