"""The GEMM modules' quantizers (te_parallel.fp8.gemm_quantizers): what each family declares, its casts
against the fp64 references, the registry (te_parallel.fp8.recipe_registry), and a recipe added through one
registration alone: the modules run it, and TE's API makes its quantizers."""
from dataclasses import dataclass

import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8 import gemm_quantizers as GQ
from te_parallel.fp8 import quantizers as Q
from te_parallel.fp8 import recipe_registry as RR
from te_parallel.fp8.blockwise import quantize_blockwise_reference
from te_parallel.fp8.quantizers.dtypes import torch_dtype
from te_parallel.fp8.scaling import current_scale_torch
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.ops.cast import dequantize_reference, quantize_reference
from te_parallel.ops.fp8_gemm_config import GemmFP8
from te_parallel.recipe import fp8_max


def _cfg(recipe, state=None, gemm=0):
    state = FP8ScalingState(1) if state is None else state
    return GemmFP8(recipe, GQ.gemm_quantizers(recipe), state, gemm, None, True, None)


def test_families_declare_what_the_gemm_path_asks():
    d = GQ.gemm_quantizers(R.DelayedScaling())
    c = GQ.gemm_quantizers(R.Float8CurrentScaling())
    b = GQ.gemm_quantizers(R.Float8BlockScaling(w_block_scaling_dim=2))
    assert [type(q) for q in (d.input, d.weight, d.grad)] == [GQ.DelayedScalingQuantizer] * 3
    assert [type(q) for q in (c.input, c.weight, c.grad)] == [GQ.CurrentScalingQuantizer] * 3
    assert (d.per_tensor, d.has_state, d.input.scale_known_before_cast) == (True, True, True)
    assert (c.per_tensor, c.has_state, c.input.scale_known_before_cast) == (True, False, False)
    assert (b.per_tensor, b.has_state, b.input.scale_known_before_cast) == (False, False, False)
    assert (d.native_fprop, c.native_fprop, b.native_fprop) == (True, True, False)
    assert (b.input.granularity, b.weight.granularity, b.grad.granularity) == (
        GQ.Granularity.TILE_1x128, GQ.Granularity.BLOCK_128x128, GQ.Granularity.TILE_1x128)
    # formats: forward operands in the forward dtype, gradients in the backward one
    hybrid = GQ.gemm_quantizers(R.DelayedScaling(fp8_format=R.Format.HYBRID))
    assert (hybrid.input.fp8_dtype, hybrid.weight.fp8_dtype, hybrid.grad.fp8_dtype) == (
        torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)
    # cached weights of another family are not reused
    assert len({d.weight.cache_key, c.weight.cache_key, b.weight.cache_key}) == 3


def test_same_objects_for_the_same_recipe_object():
    rec = R.Float8CurrentScaling()
    assert GQ.gemm_quantizers(rec) is GQ.gemm_quantizers(rec)
    assert GQ.gemm_quantizers(R.Float8CurrentScaling()) is not GQ.gemm_quantizers(rec)


def test_unregistered_recipes_are_refused_in_one_line():
    for rec in (R.MXFP8BlockScaling(), R.NVFP4BlockScaling()):
        with pytest.raises(NotImplementedError) as e:
            GQ.gemm_quantizers(rec)
        assert "\n" not in str(e.value) and type(rec).__name__ in str(e.value)
        assert "not implemented in te_parallel" in str(e.value)
    with pytest.raises(TypeError, match="subclass of te_parallel.recipe.Recipe, got <class 'int'>"):
        GQ.register_recipe(int, gemm=lambda r: None, quantizer=None)
    with pytest.raises(ValueError, match="_ThirdRangeScaling was given neither gemm= nor quantizer="):
        RR.register_recipe(_ThirdRangeScaling, gemm=None, quantizer=None)
    with pytest.raises(TypeError, match="quantizer of _ThirdRangeScaling must be a callable or None, got 3"):
        RR.register_recipe(_ThirdRangeScaling, gemm=None, quantizer=3)
    assert RR.factories_of(_ThirdRangeScaling()) is None  # (nothing was registered by the refused calls)
    with pytest.raises(ValueError, match="role must be 'x', 'w' or 'grad', got 'y'"):
        GQ.CurrentScalingQuantizer("y", torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="not known before the cast"):
        GQ.CurrentScalingQuantizer("x", torch.float8_e4m3fn).scale_cell(None)


def test_delayed_cast_uses_the_state_scale_and_records_the_amax(device):
    rec = R.DelayedScaling()
    state = FP8ScalingState(1, device=torch.device(device))
    state.fwd_scale.fill_(4.0)
    cfg = _cfg(rec, state)
    x = torch.randn(64, 32, device=device) * 3
    q = cfg.cast_input(x, transpose=True)
    ref = quantize_reference(x, torch.tensor(4.0), torch.float8_e4m3fn)
    assert torch.equal(q.data.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(q.data_t.view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    cell = state.slot_views(False, FP8ScalingState.input_slot(0))[1]
    assert cell.item() == x.abs().max().item()
    # the weight records into its own slot; calibration records what the cast would have
    w = torch.randn(32, 32, device=device)
    cfg.record_weight_amax(w)
    assert state.slot_views(False, FP8ScalingState.weight_slot(0))[1].item() == w.abs().max().item()
    dy = torch.randn(64, 32, device=device) * 7
    cfg.record_amax(dy, backward=True)
    assert state.slot_views(True, 0)[1].item() == dy.abs().max().item()


def test_current_cast_scales_from_the_tensor(device):
    x = torch.randn(48, 64, device=device, dtype=torch.float64).to(torch.float32) * 5
    q = _cfg(R.Float8CurrentScaling()).cast_grad(x, transpose=False)
    scale = torch.tensor(fp8_max(torch.float8_e5m2), dtype=torch.float64) / x.abs().max().double()
    ref = quantize_reference(x, scale.float(), torch.float8_e5m2)
    assert torch.equal(q.data.view(torch.uint8), ref.view(torch.uint8))
    err = (dequantize_reference(q.data, q.scale_inv) - x.double()).norm() / x.double().norm()
    assert 0 < err.item() < 0.1  # E5M2: 2 mantissa bits


@pytest.mark.parametrize("w_dim", [1, 2])
def test_block_casts_equal_the_reference(device, w_dim):
    rec = R.Float8BlockScaling(w_block_scaling_dim=w_dim)
    cfg = _cfg(rec)
    x = torch.randn(256, 384, device=device)
    qx = cfg.cast_input(x, transpose=True)
    ref = quantize_blockwise_reference(x, torch.float8_e4m3fn, 1, rowwise=True, columnwise=True)
    for got, want in ((qx.data, ref.data), (qx.scale_inv, ref.scale_inv), (qx.data_t, ref.data_t),
                      (qx.scale_inv_t, ref.scale_inv_t)):
        assert torch.equal(got.float(), want.float())
    qw = cfg.quantize_weight(x)
    ref_w = quantize_blockwise_reference(x, torch.float8_e4m3fn, w_dim, rowwise=True, columnwise=w_dim == 1)
    assert torch.equal(qw.data.float(), ref_w.data.float()) and torch.equal(qw.scale_inv, ref_w.scale_inv)
    assert (qw.data_t is None) == (w_dim == 2)  # a 1x128 weight's dgrad tiles come with the cast
    # backward re-encodes an unkept weight's columnwise direction from the high-precision one: the same bytes
    cfg.weight, cfg.weight_src = qw if w_dim == 2 else ref_w.only_columnwise(), x
    src = cfg.weight_for_backward()
    if w_dim == 2:
        assert type(src) is GQ.BlockWeightSource
        assert torch.equal(src.with_transpose().data_t.float(), qw.with_transpose().data_t.float())
    dbias = torch.empty(384, device=device)
    cfg.cast_grad(x, transpose=False, dbias_out=dbias)
    torch.testing.assert_close(dbias.double(), x.double().sum(0), rtol=1e-5, atol=1e-4)


@dataclass(frozen=True, kw_only=True)
class _ThirdRangeScaling(R.Recipe):
    """A test recipe: current scaling that uses a third of the FP8 range (scale from 3 * amax)."""

    scaling = "third_range"


FACTOR = 3  # (not a power of two: the bytes differ from current scaling's)


class _ThirdRangeLinearOnlyQuantizer(GQ.CurrentScalingQuantizer):
    """The test recipe's cast and nothing more: te.Linear runs it; GroupedLinear, which casts all its experts'
    weights at once, needs their scales from it too (expert_scales) and refuses it."""

    __slots__ = ()
    scale_from_amax = False  # (its scale is not fp8_max / amax: kernels computing that may not cast for it)

    def quantize(self, x, cfg, transpose=False, amax_group=None, dbias_out=None, keep_scale=False):
        from te_parallel.ops import cast
        amax = FACTOR * cast.amax_of(x)
        if GQ.spans_ranks(amax_group):
            amax = GQ.reduce_amax(amax, amax_group)
        return cast.quantize_current(x, self.fp8_dtype, amax=amax, transpose=transpose, dbias_out=dbias_out,
                                     keep_scale=keep_scale)


class _ThirdRangeQuantizer(_ThirdRangeLinearOnlyQuantizer):
    """The test recipe's quantizer: its cast, each expert's scale for GroupedLinear, and a row alignment of its
    own (te.Fp8Padding pads each expert's tokens to it)."""

    __slots__ = ()
    row_alignment = 32

    def expert_scales(self, amax, cfg, amax_group=None):
        if GQ.spans_ranks(amax_group):
            amax = GQ.reduce_amax(amax, amax_group)
        return current_scale_torch(FACTOR * amax, fp8_max(self.fp8_dtype))


def _third_range(recipe):
    fmt = recipe.fp8_format
    return GQ.GemmQuantizers(_ThirdRangeQuantizer("x", fmt.fwd_dtype), _ThirdRangeQuantizer("w", fmt.fwd_dtype),
                             _ThirdRangeQuantizer("grad", fmt.bwd_dtype))


class _ThirdRangePublicQuantizer(Q.Float8CurrentScalingQuantizer):
    """The test recipe's quantizer in TE's API: current scaling's, with the scale from 3 * amax."""

    def scale_of(self, x):
        from te_parallel.ops import cast
        largest = torch.full((1,), fp8_max(torch_dtype(self.dtype)), device=x.device)
        return largest / (FACTOR * cast.amax_of(x).reshape(1))


def _third_range_public(recipe, kind, *, rowwise, columnwise, scale, amax, device):
    return _ThirdRangePublicQuantizer(recipe.fp8_format.bwd_dtype if kind == "grad" else recipe.fp8_format.fwd_dtype,
                                      device, rowwise=rowwise, columnwise=columnwise)


def _fp8_third_range(t):
    """The test recipe's quantization (E4M3), in fp64: quantize with fp8_max / (3 amax), then dequantize."""
    scale = torch.tensor(fp8_max(torch.float8_e4m3fn), dtype=torch.float64) / (FACTOR * t.abs().max().double())
    return dequantize_reference(quantize_reference(t, scale.float(), torch.float8_e4m3fn),
                                torch.reciprocal(scale.float()))


@dataclass(frozen=True, kw_only=True)
class _ThirdRangeSubclass(_ThirdRangeScaling):
    """A subclass of the test recipe that registers nothing: it takes its base's registration."""


def test_a_registered_recipe_runs_the_modules(device, monkeypatch):
    """A recipe added through one registration alone runs te.Linear forward and backward: its casts are the
    ones used (checked against an fp64 model of them), and nothing else needed to know about it."""
    monkeypatch.setattr(RR, "_REGISTERED", dict(RR._REGISTERED))
    monkeypatch.setattr(GQ, "_MADE", {})
    with pytest.raises(NotImplementedError, match="_ThirdRangeScaling"):
        with te.fp8_autocast(fp8_recipe=_ThirdRangeScaling()):
            pass
    RR.register_recipe(_ThirdRangeScaling, gemm=_third_range, quantizer=_third_range_public)
    assert not GQ.gemm_quantizers(_ThirdRangeScaling()).native_fprop  # (the one-call CUDA Linear leaves it alone)
    assert type(GQ.gemm_quantizers(_ThirdRangeSubclass()).grad) is _ThirdRangeQuantizer  # (a subclass: its base's)
    rec = _ThirdRangeScaling(fp8_format=R.Format.E4M3)
    m = te.Linear(64, 32, bias=False, device=device)
    x = torch.randn(16, 64, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=rec):
        y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    w = m.weight.detach()
    xq, wq, dyq = _fp8_third_range(x.detach()), _fp8_third_range(w), _fp8_third_range(dy)
    torch.testing.assert_close(y.double(), xq @ wq.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), dyq @ wq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.weight.grad.double(), dyq.t() @ xq, rtol=1e-5, atol=1e-5)


def test_the_same_registration_gives_tes_quantizers(device, monkeypatch):
    """The registration that runs the modules also gives the recipe's quantizers in TE's API (make_quantizer,
    recipe_quantizers), each writing the usages asked for, with the recipe's casts (fp64 model); before it, and
    for a recipe registered without a public quantizer, make_quantizer refuses in one line."""
    monkeypatch.setattr(RR, "_REGISTERED", dict(RR._REGISTERED))
    monkeypatch.setattr(GQ, "_MADE", {})
    role = te.QuantizerRole(tensor_type="weight")
    with pytest.raises(ValueError) as e:
        te.make_quantizer(_ThirdRangeScaling(), role)
    msg = str(e.value)
    assert "\n" not in msg and "no quantizer is registered for _ThirdRangeScaling" in msg
    assert "registered: DelayedScaling, Float8CurrentScaling, Float8BlockScaling" in msg
    RR.register_recipe(_ThirdRangeScaling, gemm=_third_range, quantizer=None)  # (modules only)
    with pytest.raises(ValueError, match="no quantizer is registered for _ThirdRangeSubclass"):
        te.make_quantizer(_ThirdRangeSubclass(), role)
    RR.register_recipe(_ThirdRangeScaling, gemm=_third_range, quantizer=_third_range_public)
    for rec in (_ThirdRangeScaling(fp8_format=R.Format.E4M3), _ThirdRangeSubclass(fp8_format=R.Format.E4M3)):
        qs = te.recipe_quantizers(rec, device=device)
        assert all(type(getattr(qs, f)) is _ThirdRangePublicQuantizer for f in qs.__dataclass_fields__)
        assert qs.dgrad_weight.get_usages() == {"rowwise": False, "columnwise": True}
        assert qs.fprop_input.dtype == qs.dgrad_grad_output.dtype == Q.DType.kFloat8E4M3
        x = torch.randn(48, 64, device=device) * 5
        qx = te.make_quantizer(rec, te.QuantizerRole(tensor_type="input"))(x)
        assert qx.get_usages() == {"rowwise": True, "columnwise": True}
        torch.testing.assert_close(qx.dequantize().double(), _fp8_third_range(x), rtol=1e-6, atol=0)
        # the transpose holds the same bytes as the rowwise data
        assert torch.equal(qx._transpose, qx._data.t())
        # and the bytes are those the modules' family writes for the same tensor
        op = GQ.gemm_quantizers(rec).input.quantize(x, None)
        assert torch.equal(qx._data, op.data.view(torch.uint8))


@dataclass(frozen=True, kw_only=True)
class _ThirdRangeLinearOnly(R.Recipe):
    """A test recipe whose weight quantizer gives no per-expert scales."""

    scaling = "third_range_linear_only"


@dataclass(frozen=True, kw_only=True)
class _TiledInputScaling(R.Recipe):
    """A test recipe with 1x128 tiles of the input and gradient but one scale for the weight."""

    scaling = "tiled_input"


class _BlockInputScaling(R.Recipe):
    """A test recipe with 128x128 blocks of the input, 1x128 tiles of the weight and gradient."""

    scaling = "block_input"


def _linear_only(recipe):
    fmt = recipe.fp8_format
    return GQ.GemmQuantizers(_ThirdRangeQuantizer("x", fmt.fwd_dtype),
                             _ThirdRangeLinearOnlyQuantizer("w", fmt.fwd_dtype),
                             _ThirdRangeQuantizer("grad", fmt.bwd_dtype))


def _tiled_input(recipe):
    fmt, qp = recipe.fp8_format, R.QParams()
    return GQ.GemmQuantizers(GQ.BlockScalingQuantizer("x", fmt.fwd_dtype, 1, qp),
                             GQ.CurrentScalingQuantizer("w", fmt.fwd_dtype),
                             GQ.BlockScalingQuantizer("grad", fmt.bwd_dtype, 1, qp))


def _block_input(recipe):
    fmt, qp = recipe.fp8_format, R.QParams()
    return GQ.GemmQuantizers(GQ.BlockScalingQuantizer("x", fmt.fwd_dtype, 2, qp),
                             GQ.BlockScalingQuantizer("w", fmt.fwd_dtype, 1, qp),
                             GQ.BlockScalingQuantizer("grad", fmt.bwd_dtype, 1, qp))


def test_quantizers_that_mix_per_tensor_and_tiled_scales_are_refused_in_one_line(device, monkeypatch):
    """The dense and grouped GEMMs pair per-tensor operands with per-tensor ones and tiled with tiled: a
    registered recipe whose quantizers mix them is refused by fp8_autocast, in one line naming the recipe and
    each operand's scales, before any module runs."""
    monkeypatch.setattr(RR, "_REGISTERED", dict(RR._REGISTERED))
    monkeypatch.setattr(GQ, "_MADE", {})
    RR.register_recipe(_TiledInputScaling, gemm=_tiled_input, quantizer=None)
    m = te.Linear(128, 128, device=device)
    x = torch.randn(16, 128, device=device)
    with pytest.raises(ValueError) as e:
        with te.fp8_autocast(fp8_recipe=_TiledInputScaling(fp8_format=R.Format.E4M3)):
            m(x)
    msg = str(e.value)
    assert "\n" not in msg and "_TiledInputScaling's quantizers mix one scale per tensor with tiled scales" in msg
    assert "input 1x128 tiles, weight one scale per tensor, gradient 1x128 tiles" in msg, msg
    assert m.fp8_state.fwd_amax_history.abs().max() == 0  # nothing ran in FP8


def test_a_registered_recipe_runs_grouped_linear_and_fp8_padding(device, monkeypatch):
    """The registration that runs te.Linear also runs te.GroupedLinear between te.Fp8Padding and te.Fp8Unpadding:
    the padding takes the registered quantizers' row alignment (32), and the output and every gradient (input,
    each expert's weight and bias) match fp64 per-expert linear layers over the recipe's quantization (x and dy
    with one scale for all the experts' rows, each expert's weight with its own scale)."""
    monkeypatch.setattr(RR, "_REGISTERED", dict(RR._REGISTERED))
    monkeypatch.setattr(GQ, "_MADE", {})
    RR.register_recipe(_ThirdRangeScaling, gemm=_third_range, quantizer=_third_range_public)
    rec = _ThirdRangeScaling(fp8_format=R.Format.E4M3)
    assert GQ.gemm_quantizers(rec).input.row_alignment == 32 and GQ.gemm_quantizers(rec).weight.gives_expert_scales
    g, k, n, m_splits = 3, 64, 48, [5, 0, 37]
    m = te.GroupedLinear(g, k, n, bias=True, device=device)
    with torch.no_grad():  # experts of different ranges: one scale for all their weights would miss
        for i in range(g):
            getattr(m, f"weight{i}").mul_(4.0 ** i)
            getattr(m, f"bias{i}").normal_()
    pad, unpad = te.Fp8Padding(g), te.Fp8Unpadding(g)
    x = (torch.randn(sum(m_splits), k, device=device) * 2.0 ** torch.randint(-3, 4, (sum(m_splits), 1),
                                                                              device=device)).requires_grad_(True)
    with te.fp8_autocast(fp8_recipe=rec):
        xp, padded = pad(x, m_splits)
        y = unpad(m(xp, padded), m_splits)
    assert pad.align_size == unpad.align_size == 32 and padded == [32, 0, 64]
    dy = torch.randn_like(y)
    y.backward(dy)

    xq, dyq = _fp8_third_range(x.detach()), _fp8_third_range(dy)  # (padding rows are zeros: the amaxes are these)
    outs, dxs, start = [], [], 0
    for i, c in enumerate(m_splits):
        w, b = getattr(m, f"weight{i}").detach(), getattr(m, f"bias{i}").detach()
        wq, rows = _fp8_third_range(w), slice(start, start + c)
        outs.append(xq[rows] @ wq.t() + b.double())
        dxs.append(dyq[rows] @ wq)
        torch.testing.assert_close(getattr(m, f"weight{i}").grad.double(), dyq[rows].t() @ xq[rows], rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(getattr(m, f"bias{i}").grad.double(), dy[rows].double().sum(0), rtol=1e-5,
                                   atol=1e-5)
        start += c
    torch.testing.assert_close(y.double(), torch.cat(outs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), torch.cat(dxs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe_type, factory, words", [
    (_ThirdRangeLinearOnly, _linear_only, ("_ThirdRangeLinearOnlyQuantizer", "gives no per-expert scales",
                                           "expert_scales")),
    (_BlockInputScaling, _block_input, ("128x128 blocks (x_block_scaling_dim=2)", "1x128 tiles of the input")),
])
def test_grouped_linear_refuses_quantizers_it_cannot_run_in_one_line(device, monkeypatch, recipe_type, factory,
                                                                     words):
    """A registered recipe whose quantizers lack what GroupedLinear needs: refused before any work, in one line
    naming the recipe and what it lacks (te.Linear runs the recipe whose weights lack only per-expert scales)."""
    monkeypatch.setattr(RR, "_REGISTERED", dict(RR._REGISTERED))
    monkeypatch.setattr(GQ, "_MADE", {})
    RR.register_recipe(recipe_type, gemm=factory, quantizer=None)
    rec = recipe_type(fp8_format=R.Format.E4M3)
    m = te.GroupedLinear(2, 128, 128, device=device)
    x = torch.randn(256, 128, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=rec):
        with pytest.raises(ValueError) as e:
            m(x, [128, 128])
        if recipe_type is _ThirdRangeLinearOnly:  # (what it lacks is GroupedLinear's alone)
            te.Linear(128, 128, device=device)(x).sum().backward()
    msg = str(e.value)
    assert "\n" not in msg and f"GroupedLinear: cannot run FP8 under {recipe_type.__name__}: " in msg
    assert all(w in msg for w in words), msg
    assert m.weight0.grad is None and (x.grad is not None) == (recipe_type is _ThirdRangeLinearOnly)


def test_te_checkpoint_layout_asks_the_quantizers(monkeypatch):
    """TE's extra state (fp8.te_extra_state) writes per-slot scales and histories where the recipe's quantizers
    keep state, and writes a recipe as its TE class; a registered recipe TE has no class for is refused in one
    line naming it."""
    from te_parallel.fp8 import te_extra_state as tex

    monkeypatch.setattr(RR, "_REGISTERED", dict(RR._REGISTERED))
    monkeypatch.setattr(GQ, "_MADE", {})
    RR.register_recipe(_ThirdRangeScaling, gemm=_third_range, quantizer=None)
    state = FP8ScalingState(2)
    state.fwd_scale.uniform_(1, 2)
    tensors = tex.state_tensors(state)
    for rec, name, slots in ((R.DelayedScaling(), "DelayedScaling", True),
                             (R.Float8CurrentScaling(), "Float8CurrentScaling", False),
                             (R.Float8BlockScaling(), "Float8BlockScaling", False)):
        te_state = tex.state_to_te(tensors, 2, rec)
        assert te_state["recipe"].name == name and ("scale_fwd" in te_state) == slots
    assert torch.equal(tex.state_to_te(tensors, 2, R.DelayedScaling())["scale_fwd"][[0, 1, 3, 4]], state.fwd_scale)
    with pytest.raises(ValueError) as e:
        tex.state_to_te(tensors, 2, _ThirdRangeScaling())
    assert "\n" not in str(e.value) and "_ThirdRangeScaling has no TE recipe" in str(e.value)
