"""TE 2.x's quantizer API (te_parallel.fp8.quantizers) against fp64 references: delayed, current and block
scaling, usages, TE's layouts, ops on quantized tensors, recipes' quantizers, the one-line errors."""
import dataclasses
import enum
import io
import math

import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8 import quantizers as Q
from te_parallel.fp8.blockwise import quantize_blockwise_reference
from te_parallel.ops.cast import quantize
from tests.reference import FP8, block_qdq, quantize_ref, rel_err

CODES = {torch.float8_e4m3fn: Q.DType.kFloat8E4M3, torch.float8_e5m2: Q.DType.kFloat8E5M2}
SHAPES = [(37, 53), (3, 5, 7), (11,), ()]


def _values(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 values of TE's uint8 bytes, in fp64."""
    return t.view(dtype).double().cpu()


def _fp32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def _current_scale_ref(x: torch.Tensor, dtype: torch.dtype, pow2: bool, eps: float) -> float:
    """TE's current scale in fp64: fp8_max / max(amax, eps) rounded once to fp32 (exact: fp64 holds the quotient
    of two fp32 numbers to well past double rounding), then the power of two at or below it."""
    amax = max(x.detach().abs().max().float().item(), _fp32(eps))
    scale = _fp32(torch.finfo(dtype).max / amax)
    if pow2:
        scale = 2.0 ** (math.frexp(scale)[1] - 1)
    return scale


# --- per tensor -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FP8)
def test_delayed_quantizer_uses_the_given_scale_and_records_amax(dtype, shape, device):
    x = torch.randn(shape, device=device) * 30
    scale, amax = torch.tensor([3.7], device=device), torch.tensor([0.5], device=device)
    t = Q.Float8Quantizer(scale, amax, CODES[dtype])(x)
    assert isinstance(t, Q.Float8Tensor) and t.shape == x.shape and t.dtype == x.dtype
    assert t._data.dtype == torch.uint8 and t._fp8_dtype == CODES[dtype]
    ref = quantize_ref(x.cpu(), scale.cpu().reshape(()), dtype)  # fp8 values of fp32(x * scale), own rounding
    assert torch.equal(_values(t._data, dtype), ref)
    assert t._scale_inv.shape == (1,) and t._scale_inv.item() == _fp32(1 / _fp32(3.7))
    cols = (shape[-1], *shape[:-1]) if shape else ()
    assert t._transpose.shape == cols and not t._transpose_invalid
    assert torch.equal(_values(t._transpose, dtype), ref.movedim(-1, 0) if len(shape) > 1 else ref)
    assert amax.item() == x.abs().max().item()  # max(0.5, amax(x))
    Q.Float8Quantizer(scale, amax, CODES[dtype])(x / 100)  # a smaller amax leaves it
    assert amax.item() == x.abs().max().item()
    # fp8 value times fp32 scale_inv: exact in fp64, rounded once to fp32 as dequantize does
    assert torch.equal(t.dequantize().cpu(), (ref * t._scale_inv.double().cpu().reshape(())).float())


@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", FP8)
def test_current_scaling_scale_from_amax(dtype, pow2, eps, device):
    x = torch.randn(64, 96, device=device) * 7
    small = x * 1e-6  # amax ~3e-5: below eps=1e-3, so the floor sets the scale
    q = Q.Float8CurrentScalingQuantizer(dtype, device, force_pow_2_scales=pow2, amax_epsilon=eps)
    for v in (x, small):
        t = q(v)
        scale = _current_scale_ref(v, dtype, pow2, eps)
        assert t._scale_inv.item() == _fp32(1 / scale)
        assert torch.equal(_values(t._data, dtype), quantize_ref(v.cpu(), torch.tensor(scale), dtype))
    if pow2:
        assert math.frexp(t._scale_inv.item())[0] == 0.5  # a power of two
    if eps:
        assert t._scale_inv.item() == _fp32(1 / _current_scale_ref(small, dtype, pow2, eps))
        assert _current_scale_ref(small, dtype, pow2, eps) < _current_scale_ref(small, dtype, pow2, 0.0)


def test_current_scaling_reduces_the_amax_over_its_group(monkeypatch, device):
    """with_amax_reduction: the amax is all-reduced (MAX) over the group before the scale is made; here the
    other rank's amax is 4x larger."""
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append((op, group))
        t.mul_(4)

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    x = torch.randn(32, 48, device=device)
    q = Q.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device, with_amax_reduction=True,
                                        amax_reduction_group="group")
    t = q(x)
    assert calls == [(torch.distributed.ReduceOp.MAX, "group")]
    assert t._scale_inv.item() == _fp32(1 / _fp32(448 / (4 * x.abs().max().item())))
    assert q.with_amax_reduction and not t._quantizer.with_amax_reduction  # writes into t do not reduce
    t.quantize_(x)
    assert len(calls) == 1


# --- block scaling ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("usage", [(True, True), (True, False), (False, True)], ids=["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("shape", [(200, 300), (3, 130, 257)])
def test_block_quantizer_matches_the_blockwise_reference(shape, block_dim, usage, device):
    rowwise, columnwise = usage
    x = torch.randn(shape, device=device) * 5
    x[..., :128] *= 100  # tiles of different ranges
    q = Q.Float8BlockQuantizer(Q.DType.kFloat8E4M3, rowwise=rowwise, columnwise=columnwise, amax_epsilon=0.0,
                               force_pow_2_scales=True, block_scaling_dim=block_dim)
    t = q(x)
    m, k = math.prod(shape[:-1]), shape[-1]
    ref = quantize_blockwise_reference(x.reshape(m, k).cpu(), torch.float8_e4m3fn, block_dim, rowwise=rowwise,
                                       columnwise=columnwise)
    assert isinstance(t, Q.Float8BlockwiseQTensor) and t._is_2D_scaled == (block_dim == 2)
    assert t.get_usages() == {"rowwise": rowwise, "columnwise": columnwise}
    for data, scales, ref_data, ref_scales, cols, direction in (
            (t._rowwise_data, t._rowwise_scale_inv, ref.data, ref.scale_inv, shape, False),
            (t._columnwise_data, t._columnwise_scale_inv, ref.data_t, ref.scale_inv_t, (k, *shape[:-1]), True)):
        if ref_data is None:
            assert data is None and scales is None
            continue
        assert data.shape == cols and torch.equal(data.cpu().reshape(ref_data.shape), ref_data.view(torch.uint8))
        assert scales.shape == q.get_scale_shape(shape, columnwise=direction)  # TE's layout: last dim padded to 4
        n = ref_scales.shape[1]
        assert scales.shape[1] == 4 * math.ceil(n / 4) and not scales[:, n:].any()
        assert torch.equal(scales[:, :n].cpu(), ref_scales)
    # the value against fp64 quantize -> dequantize per tile (1x128 along the rows, or along the columns)
    tile = (1, 128) if block_dim == 1 else (128, 128)
    want = block_qdq(x.reshape(m, k), torch.float8_e4m3fn, tile) if rowwise else \
        block_qdq(x.reshape(m, k).t(), torch.float8_e4m3fn, tile).t()
    assert torch.equal(t.dequantize(torch.float64).reshape(m, k).cpu(), want)
    op = t.to_operand()
    assert op.block_dim == block_dim and op.shape == (m, k)
    assert (op.scale_inv is None or torch.equal(op.scale_inv.cpu(), ref.scale_inv))


@pytest.mark.parametrize("pow2,eps", [(False, 0.0), (True, 1e-2)])
def test_block_quantizer_passes_its_scale_options(pow2, eps, device):
    x = torch.randn(128, 256, device=device) * 1e-4  # amax ~4e-4, under eps=1e-2
    t = Q.Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=False, force_pow_2_scales=pow2,
                               amax_epsilon=eps, block_scaling_dim=1)(x)
    ref = quantize_blockwise_reference(x.cpu(), torch.float8_e4m3fn, 1, pow2=pow2, eps=eps)
    assert torch.equal(t._rowwise_scale_inv[:, :128].cpu(), ref.scale_inv)
    if eps:
        assert torch.all(t._rowwise_scale_inv[:, :128] == 2.0 ** math.ceil(math.log2(1e-2 / 448)))


# --- round trips, usages, ops ----------------------------------------------------------------------------------
def _quantizers(device, dtype):
    return {"delayed": Q.Float8Quantizer(torch.tensor([64.0], device=device), torch.zeros(1, device=device), dtype),
            "current": Q.Float8CurrentScalingQuantizer(dtype, device),
            "block1": Q.Float8BlockQuantizer(dtype, rowwise=True, columnwise=True, block_scaling_dim=1),
            "block2": Q.Float8BlockQuantizer(dtype, rowwise=True, columnwise=True, block_scaling_dim=2)}


@pytest.mark.parametrize("dtype,bound", [(torch.float8_e4m3fn, 0.04), (torch.float8_e5m2, 0.08)])
@pytest.mark.parametrize("name", ["delayed", "current", "block1", "block2"])
def test_dequantize_round_trip_error(name, dtype, bound, device):
    """Round to nearest with m mantissa bits is within 2^-(m+1) of each normal value: the relative error of
    a Gaussian tensor is about a third of that (E4M3: 0.0625 -> ~0.02; E5M2: 0.125 -> ~0.04)."""
    x = torch.randn(256, 384, device=device)
    t = _quantizers(device, dtype)[name](x)
    for v in (t.dequantize(), t.dequantize(torch.bfloat16).float()):
        err = rel_err(v, x)
        assert 0 < err < bound
    assert rel_err(t.dequantize(), -x) > 1  # not trivially close


@pytest.mark.parametrize("name", ["delayed", "current", "block1", "block2"])
def test_usage_flags(name, device):
    x = torch.randn(256, 384, device=device) * torch.logspace(-2, 1, 256, device=device)[:, None]  # rows' ranges differ
    q = _quantizers(device, torch.float8_e4m3fn)[name]
    both = q(x)
    q.set_usage(rowwise=True, columnwise=False)
    row = q(x)
    q.set_usage(rowwise=False, columnwise=True)
    col = q(x)
    assert row.get_usages() == {"rowwise": True, "columnwise": False}
    assert col.get_usages() == {"rowwise": False, "columnwise": True}
    assert torch.equal(row.dequantize(), both.dequantize())
    if name != "block1":  # one scale or square blocks: both directions hold the same values
        assert torch.equal(col.dequantize(), both.dequantize())
        col.update_usage(rowwise_usage=True)
        row.update_usage(columnwise_usage=True)
        assert torch.equal(row.to_operand().transposed().float(), both.to_operand().transposed().float())
    else:  # tiles along the other dim: another quantization of the same values
        assert 0 < rel_err(col.dequantize(), x) < 0.04 and not torch.equal(col.dequantize(), both.dequantize())
        with pytest.raises(RuntimeError, match="quantize again"):
            row.update_usage(columnwise_usage=True)
    q.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="both False"):
        q(x)


def test_per_tensor_operand_is_the_cast_of_ops(device):
    x = torch.randn(48, 80, device=device)
    scale = torch.tensor([12.0], device=device)
    t = Q.Float8Quantizer(scale, torch.zeros(1, device=device), torch.float8_e5m2)(x)
    op, ref = t.to_operand(), quantize(x, scale, torch.float8_e5m2, transpose=True)
    assert op.data.dtype == torch.float8_e5m2 and torch.equal(op.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(op.data_t.view(torch.uint8), ref.data_t.view(torch.uint8))
    assert op.scale_inv.shape == () and op.scale_inv.item() == ref.scale_inv.item()


@pytest.mark.parametrize("name", ["current", "block1"])
def test_ops_run_on_the_dequantized_value(name, device):
    x, y = torch.randn(128, 256, device=device), torch.randn(128, 256, device=device)
    q = _quantizers(device, torch.float8_e4m3fn)[name]
    t = q(x)
    v = t.dequantize()
    for got, want in ((t + y, v + y), (torch.sin(t), torch.sin(v)), (t @ y.t(), v @ y.t()), (t.sum(0), v.sum(0)),
                      (t.to(torch.float64), v.double()), (t.float(), v), (t[3:7], v[3:7]), (-t, -v)):
        assert type(got) is torch.Tensor and torch.equal(got, want)
    for same in (t.detach(), t.clone(), t.reshape(2, 64, 256), t.view(-1, 256)):  # same format, same bytes
        assert type(same) is type(t) and torch.equal(same.dequantize().reshape(v.shape), v)
    assert type(t.view(256, 128)) is (Q.Float8Tensor if name == "current" else torch.Tensor)
    t2 = t.clone()
    t2 += y  # in place: computed on the value, quantized back with the tensor's quantizer
    assert type(t2) is type(t) and torch.equal(t2.dequantize(), q(v + y).dequantize())
    t2.copy_(y)
    assert torch.equal(t2.dequantize(), q(y).dequantize())
    buf = io.BytesIO()
    torch.save(t, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert type(loaded) is type(t) and torch.equal(loaded.dequantize(), v)


def test_autograd_passes_straight_through(device):
    x = torch.randn(64, 128, device=device, requires_grad=True)
    q = Q.Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1)
    t = q(x)
    assert t.requires_grad and isinstance(t, Q.QuantizedTensor)
    g = torch.randn(64, 128, device=device)
    (t.dequantize() * g).sum().backward()
    assert torch.equal(x.grad, g)
    leaf = q(torch.randn(64, 128, device=device)).requires_grad_(True)
    (leaf * g).sum().backward()
    assert torch.equal(leaf.grad, g)


def test_update_quantized_writes_in_place(device):
    q = Q.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device)
    t = q(torch.randn(32, 64, device=device))
    data, alias = t._data, t.detach()
    y = torch.randn(32, 64, device=device)
    assert q.update_quantized(y, t) is t and t._data is data
    assert torch.equal(alias.dequantize(), q(y).dequantize())
    q.update_quantized(torch.randn(32, 64, device=device), t, noop_flag=torch.ones(1, device=device))
    assert torch.equal(t.dequantize(), q(y).dequantize())


def test_make_empty_has_tes_shapes(device):
    q = Q.Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1)
    e = q.make_empty((2, 130, 260), dtype=torch.bfloat16, device=device)
    assert e.dtype == torch.bfloat16 and e.shape == (2, 130, 260) and e._columnwise_data.shape == (260, 2, 130)
    assert e._rowwise_scale_inv.shape == (3, 260) and e._columnwise_scale_inv.shape == (3, 260)
    f = Q.Float8Quantizer(torch.tensor([2.0], device=device), torch.zeros(1, device=device),
                          torch.float8_e4m3fn).make_empty((5, 6), device=device)
    assert f._data.shape == (5, 6) and f._transpose.shape == (6, 5) and f._scale_inv.item() == 0.5


# --- recipes' quantizers ------------------------------------------------------------------------------------------
def test_recipe_quantizers_for_each_recipe(device):
    block = R.Float8BlockScaling(fp8_format=R.Format.HYBRID, fp8_quant_fwd_weight=R.QParams(amax_epsilon=1e-3),
                                 fp8_quant_bwd_grad=R.QParams(power_2_scale=False))
    qs = te.recipe_quantizers(block)
    assert all(isinstance(getattr(qs, f), Q.Float8BlockQuantizer) for f in qs.__dataclass_fields__)
    dims = (qs.fprop_input.block_scaling_dim, qs.fprop_weight.block_scaling_dim, qs.dgrad_grad_output.block_scaling_dim)
    assert dims == (1, 2, 1)
    assert qs.fprop_weight.amax_epsilon == 1e-3 and qs.fprop_input.amax_epsilon == 0.0
    assert qs.wgrad_grad_output.force_pow_2_scales is False and qs.wgrad_input.force_pow_2_scales is True
    assert qs.fprop_input.dtype == Q.DType.kFloat8E4M3 and qs.dgrad_grad_output.dtype == Q.DType.kFloat8E5M2
    # each GEMM operand in the direction its GEMM reads (fprop rows of x and W, dgrad dy rows and Wᵀ, wgrad columns)
    rows = {f: getattr(qs, f).get_usages() for f in qs.__dataclass_fields__}
    assert rows["fprop_input"] == rows["fprop_weight"] == rows["dgrad_grad_output"] == {"rowwise": True,
                                                                                        "columnwise": False}
    assert rows["dgrad_weight"] == rows["wgrad_grad_output"] == rows["wgrad_input"] == {"rowwise": False,
                                                                                         "columnwise": True}
    current = te.recipe_quantizers(R.Float8CurrentScaling(fp8_format=R.Format.E4M3), device=device)
    assert isinstance(current.wgrad_grad_output, Q.Float8CurrentScalingQuantizer)
    assert current.wgrad_grad_output.dtype == Q.DType.kFloat8E4M3
    state = {k: torch.tensor([float(i + 2)], device=device) for i, k in enumerate(("input", "weight", "grad_output"))}
    amaxes = {k: torch.zeros(1, device=device) for k in state}
    delayed = te.recipe_quantizers(R.DelayedScaling(), scales=state, amaxes=amaxes)
    assert delayed.fprop_weight.scale is state["weight"] and delayed.dgrad_weight.amax is amaxes["weight"]
    x = torch.randn(16, 32, device=device)
    delayed.fprop_input(x)
    assert amaxes["input"].item() == x.abs().max().item() and amaxes["weight"].item() == 0
    with pytest.raises(ValueError, match="scale= and amax="):
        te.recipe_quantizers(R.DelayedScaling())
    mx = te.recipe_quantizers(R.MXFP8BlockScaling())  # made, as TE makes them; used, they refuse
    with pytest.raises(NotImplementedError, match="Blackwell"):
        mx.fprop_input(torch.randn(4, 128))
    with pytest.raises(ValueError, match="tensor_type"):
        te.make_quantizer(block, te.QuantizerRole(tensor_type="qkv"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BlockScalingOfMine(R.Float8BlockScaling):
    """A user's subclass of a registered recipe: it takes the base's quantizers."""


def test_recipe_quantizers_follow_the_recipe_type(device):
    """The factory is the one the recipe's type (or its nearest registered base) registered: a subclass of
    Float8BlockScaling gets block quantizers with its own settings; an unregistered recipe type is refused
    in one line naming it and the registered ones."""
    sub = _BlockScalingOfMine(x_block_scaling_dim=1, w_block_scaling_dim=1)
    qs = te.recipe_quantizers(sub, device=device)
    assert all(type(getattr(qs, f)) is Q.Float8BlockQuantizer for f in qs.__dataclass_fields__)
    assert qs.fprop_weight.block_scaling_dim == 1
    with pytest.raises(ValueError) as e:
        te.make_quantizer(R.Recipe(), te.QuantizerRole(tensor_type="input"))
    message = _one_line(e)
    assert "no quantizer is registered for Recipe" in message
    assert ("registered: DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, "
            "NVFP4BlockScaling") in message


# --- errors and availability ------------------------------------------------------------------------------------
class _ForeignDType(enum.IntEnum):  # another enum with TE's codes (as transformer_engine_torch.DType)
    kFloat8E4M3 = 7
    kBFloat16 = 6


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_one_line_errors(device):
    x = torch.randn(4, 128, device=device)
    for make in (lambda: Q.MXFP8Quantizer(Q.DType.kFloat8E4M3)(x), lambda: Q.NVFP4Quantizer().quantize(x),
                 lambda: Q.MXFP8Quantizer(Q.DType.kFloat8E4M3).make_empty((4, 128)), lambda: Q.MXFP8Tensor(),
                 lambda: Q.NVFP4Tensor(shape=(2,), dtype=torch.float32)):
        with pytest.raises(NotImplementedError) as e:
            make()
        assert "Blackwell" in _one_line(e) and "not implemented in te_parallel" in _one_line(e)
    for bad in (torch.float16, "e4m3", Q.DType.kBFloat16, _ForeignDType.kBFloat16, 3.0):
        with pytest.raises(ValueError) as e:
            Q.Float8CurrentScalingQuantizer(bad, device)
        assert "fp8_dtype must be" in _one_line(e) and repr(bad) in _one_line(e)
    assert Q.Float8CurrentScalingQuantizer(_ForeignDType.kFloat8E4M3, device).dtype is Q.DType.kFloat8E4M3
    with pytest.raises(ValueError) as e:
        Q.Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=3)
    assert "block_scaling_dim must be 1" in _one_line(e) and "got 3" in _one_line(e)
    block = Q.Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1)
    with pytest.raises(ValueError) as e:
        block(torch.randn(300, device=device))
    assert "1-D tensor of shape (300,)" in _one_line(e)
    with pytest.raises(ValueError) as e:
        Q.Float8Quantizer(torch.tensor([1.0, 2.0]), torch.zeros(1), torch.float8_e4m3fn)
    assert "scale must be a one-element fp32 tensor" in _one_line(e)
    with pytest.raises(TypeError) as e:
        per_tensor = Q.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(torch.randn(4, 4))
        block.update_quantized(torch.randn(4, 4), per_tensor)
    assert "dst must be a Float8BlockwiseQTensor" in _one_line(e)


def test_availability(monkeypatch):
    from te_parallel.fp8 import autocast as autocast_mod

    monkeypatch.setattr(autocast_mod, "_FP8_CAPABLE", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert te.is_fp8_block_scaling_available(return_reason=True) == (True, "")
    assert te.is_bf16_available() is True and te.get_device_compute_capability() == (0, 0)
    for check in (te.is_mxfp8_available, te.is_nvfp4_available):
        ok, reason = check(return_reason=True)
        assert ok is False and "Blackwell" in reason and check() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    for cc, cuda, ok in (((9, 0), "12.9", True), ((9, 0), "12.8", False), ((10, 0), "12.9", False),
                         ((8, 9), "13.0", False)):
        monkeypatch.setattr(autocast_mod, "_FP8_CAPABLE", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cc=cc: cc)
        monkeypatch.setattr(torch.version, "cuda", cuda)
        got, reason = te.is_fp8_block_scaling_available(return_reason=True)
        assert got is ok and (ok or ("9.x" in reason and "12.9" in reason and cuda in reason))
    assert isinstance(te.get_default_fp8_recipe(), R.DelayedScaling)
