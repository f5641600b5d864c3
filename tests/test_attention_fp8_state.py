"""FP8 attention's scaling state (te_parallel.ops.attention_fp8_state) on CPU: made with the layer, carried by
state_dict / load_state_dict and by plain torch.distributed.checkpoint into a freshly built layer (scales and
histories equal, the next step bit-identical); and the recipe read from its quantizers: a recipe registered with
per-tensor quantizers runs FP8 attention as the built-in one of its family, anything else is refused in one
line naming it."""
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8 import gemm_quantizers as GQ
from te_parallel.fp8 import recipe_registry as RR
from te_parallel.fp8.state import DEFAULT_HISTORY_LEN
from te_parallel.ops import attention_fp8_state as fp8_state

HID, HEADS, GROUPS, S, B = 64, 4, 2, 32, 2  # head dim 16: FP8 attention takes it
_STATE = ("fwd_amax_history", "fwd_scale", "fwd_scale_inv", "bwd_amax_history", "bwd_scale", "bwd_scale_inv")


def _layer(seed: int):
    torch.manual_seed(seed)
    return te.MultiheadAttention(HID, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, attn_mask_type="causal",
                                 device="cpu")


def _step(layer, rec, seed: int, backward: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, HID, generator=gen).requires_grad_(True)
    with te.fp8_autocast(fp8_recipe=rec):
        out = layer(x)
    if backward:
        out.backward(torch.randn(out.shape, generator=gen))
    assert layer.core_attention.last_backend == "fp8_emulation"
    return out.detach(), x.grad


def _assert_states_equal(a, b):
    for name in _STATE:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.updates() == b.updates()


def _assert_fresh(state, rows=DEFAULT_HISTORY_LEN):
    assert state.fwd_amax_history.shape == (rows, 2 * fp8_state.NUM_GEMMS)
    assert state.bwd_amax_history.shape == (rows, fp8_state.NUM_GEMMS)
    for name in _STATE:
        t = getattr(state, name)
        assert (t == (0 if "history" in name else 1)).all(), name
    assert state.updates() == [0, 0]


def test_the_state_exists_from_construction_with_its_shapes():
    layer = _layer(0)
    sd = layer.state_dict()
    keys = sorted(k for k in sd if ".fp8_attention_state." in k)
    assert keys == sorted(f"core_attention.fp8_attention_state.{n}" for n in (*_STATE, "update_count"))
    assert sd["core_attention.fp8_attention_state.fwd_scale"].shape == (2 * fp8_state.NUM_GEMMS,)
    _assert_fresh(layer.core_attention.fp8_attention_state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
@pytest.mark.parametrize("rec", [R.DelayedScaling(fp8_dpa=True, amax_history_len=5),
                                 R.Float8CurrentScaling(fp8_dpa=True)], ids=["delayed", "current"])
def test_plain_dcp_round_trip_into_a_fresh_layer(tmp_path, rec):
    """Three FP8 steps, dcp.save of the plain state dict (one process, no process group), dcp.load into a layer
    built with another seed: attention scales and histories equal, the next step bit-identical."""
    layer = _layer(0)
    for step in range(3):
        _step(layer, rec, step)
    saved = layer.core_attention.fp8_attention_state
    assert saved.fwd_scale[fp8_state.O] != 1 and (saved.bwd_scale[fp8_state.DP:] != 1).all()
    assert saved.updates() == [3, 3]
    dcp.save(layer.state_dict(), checkpoint_id=str(tmp_path))
    fresh = _layer(1)
    _assert_fresh(fresh.core_attention.fp8_attention_state)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))
    fresh.load_state_dict(sd, strict=True)
    _assert_states_equal(fresh.core_attention.fp8_attention_state, saved)
    rows = fresh.core_attention.fp8_attention_state.fwd_amax_history.shape[0]
    assert rows == (5 if rec.delayed() else 1)  # the saved length, not the fresh layer's 1024
    out_a, dx_a = _step(layer, rec, 7)
    out_b, dx_b = _step(fresh, rec, 7)
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    _assert_states_equal(fresh.core_attention.fp8_attention_state, layer.core_attention.fp8_attention_state)


def test_state_dict_round_trip_into_a_fresh_layer():
    rec = R.DelayedScaling(fp8_dpa=True, amax_history_len=4)
    layer = _layer(0)
    for step in range(2):
        _step(layer, rec, step)
    fresh = _layer(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(layer.state_dict(), strict=True)
    _assert_states_equal(fresh.core_attention.fp8_attention_state, layer.core_attention.fp8_attention_state)
    assert torch.equal(_step(layer, rec, 5, backward=False)[0], _step(fresh, rec, 5, backward=False)[0])


def test_checkpoint_without_the_state_loads_fresh_without_a_warning():
    """A state dict written without FP8 attention's state (TE's layout, or before the layer had it) loads strictly
    and leaves that state fresh, the rest as saved."""
    rec = R.DelayedScaling(fp8_dpa=True, amax_history_len=4)
    source, layer = _layer(0), _layer(1)
    _step(layer, rec, 0)
    sd = {k: v for k, v in source.state_dict().items() if ".fp8_attention_state." not in k}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(sd, strict=True)
    _assert_fresh(layer.core_attention.fp8_attention_state, rows=4)
    assert torch.equal(layer.proj.weight, source.proj.weight)


def test_meta_construction_then_materialisation_gives_a_fresh_state():
    with torch.device("meta"):
        dpa = te.DotProductAttention(HEADS, 16, num_gqa_groups=GROUPS)
    assert dpa.fp8_attention_state.fwd_scale.is_meta
    dpa.to_empty(device="cpu")
    dpa.reset_parameters()
    _assert_fresh(dpa.fp8_attention_state)


# -- the recipe, read from its quantizers ----------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class _MyDelayed(R.DelayedScaling):
    """A recipe of its own, registered with the delayed family's quantizers."""


@dataclass(frozen=True, kw_only=True)
class _MyCurrent(R.Float8CurrentScaling):
    """A recipe of its own, registered with the current family's quantizers."""


@dataclass(frozen=True, kw_only=True)
class _TiledInputs(R.Float8CurrentScaling):
    """Inputs and gradients in 1x128 tiles: no per-tensor scale for FP8 attention."""


@dataclass(frozen=True, kw_only=True)
class _ThirdRange(R.Float8CurrentScaling):
    """Per tensor, but scale = fp8_max / (3 amax): neither from a history nor fp8_max / amax."""


class _ThirdRangeQuantizer(GQ.CurrentScalingQuantizer):
    __slots__ = ()
    scale_from_amax = False


def _delayed_family(recipe):
    fmt = recipe.fp8_format
    return GQ.GemmQuantizers(GQ.DelayedScalingQuantizer("x", fmt.fwd_dtype),
                             GQ.DelayedScalingQuantizer("w", fmt.fwd_dtype),
                             GQ.DelayedScalingQuantizer("grad", fmt.bwd_dtype))


def _current_family(recipe, kind=GQ.CurrentScalingQuantizer):
    fmt = recipe.fp8_format
    return GQ.GemmQuantizers(kind("x", fmt.fwd_dtype), kind("w", fmt.fwd_dtype), kind("grad", fmt.bwd_dtype))


def _tiled(recipe):
    fmt, qp = recipe.fp8_format, R.QParams()
    return GQ.GemmQuantizers(GQ.BlockScalingQuantizer("x", fmt.fwd_dtype, 1, qp),
                             GQ.BlockScalingQuantizer("w", fmt.fwd_dtype, 2, qp),
                             GQ.BlockScalingQuantizer("grad", fmt.bwd_dtype, 1, qp))


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(RR, "_REGISTERED", dict(RR._REGISTERED))
    monkeypatch.setattr(GQ, "_MADE", {})
    return RR.register_recipe


@pytest.mark.parametrize("mine, builtin, family", [
    (_MyDelayed, R.DelayedScaling, _delayed_family),
    (_MyCurrent, R.Float8CurrentScaling, _current_family)], ids=["delayed", "current"])
def test_a_registered_per_tensor_recipe_runs_fp8_attention(registry, mine, builtin, family):
    """Registered with its family's quantizers, the recipe's FP8 attention is the built-in recipe's, bit for bit
    (outputs, input gradients, attention state) over two steps."""
    registry(mine, gemm=family, quantizer=None)
    kw = dict(fp8_dpa=True, fp8_format=R.Format.HYBRID)
    if builtin is R.DelayedScaling:
        kw["amax_history_len"] = 3
    runs = []
    for rec in (builtin(**kw), mine(**kw)):
        layer = _layer(0)
        runs.append([_step(layer, rec, step) for step in range(2)] + [layer.core_attention.fp8_attention_state])
    for (out_a, dx_a), (out_b, dx_b) in zip(runs[0][:2], runs[1][:2]):
        assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    _assert_states_equal(runs[0][2], runs[1][2])


@pytest.mark.parametrize("rec_type, family, what", [
    (_TiledInputs, _tiled, "TILE_1x128 scales"),
    (_ThirdRange, lambda r: _current_family(r, _ThirdRangeQuantizer), "from neither an amax history")],
    ids=["tiles", "other per-tensor rule"])
def test_other_quantizers_are_refused_in_one_line_naming_the_recipe(registry, rec_type, family, what):
    registry(rec_type, gemm=family, quantizer=None)
    rec = rec_type(fp8_dpa=True)
    with pytest.raises(ValueError) as err:
        fp8_state.scaling_of(rec, GQ.gemm_quantizers(rec))
    msg = str(err.value)
    assert "\n" not in msg and rec_type.__name__ in msg and what in msg and "fp8_dpa=False" in msg
    dpa = te.DotProductAttention(HEADS, 16, num_gqa_groups=GROUPS)
    q = torch.randn(S, B, HEADS, 16)
    kv = torch.randn(S, B, GROUPS, 16)
    with pytest.raises(ValueError, match=rec_type.__name__):
        with te.fp8_autocast(fp8_recipe=rec):
            dpa(q, kv, kv)
    assert dpa.fp8_attention_state.updates() == [0, 0] and not dpa.fp8_attention_state.fwd_amax_history.any()


def test_the_formats_come_from_the_quantizers():
    for fmt in R.Format:
        for rec in (R.DelayedScaling(fp8_format=fmt), R.Float8CurrentScaling(fp8_format=fmt)):
            scaling = fp8_state.scaling_of(rec, GQ.gemm_quantizers(rec))
            assert (scaling.fwd_dtype, scaling.bwd_dtype) == (fmt.fwd_dtype, fmt.bwd_dtype)
            assert scaling.current == (not rec.delayed())
            if rec.delayed():
                assert scaling.update is rec
            else:
                assert scaling.update.amax_history_len == 1 and scaling.update.fp8_format is fmt
