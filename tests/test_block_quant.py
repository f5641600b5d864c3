"""quantize_blockwise_reference (1x128 tiles, 128x128 blocks) against a formulation of its own in fp64.

The formulation here works tile by tile in Python numbers: the amax of the elements that exist, the
scale from exact rational arithmetic (2 ** floor(log2(fp8_max / amax)) with power-of-two scales, else
fp8_max / amax rounded once to fp32), the product x * scale exact in fp64 and rounded once to fp32 (the
fp32 multiplication), and the FP8 rounding written out (nearest even on the format's grid, subnormals
included). It shares no code with te_parallel.fp8.blockwise.
"""
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from te_parallel.fp8.blockwise import BlockwiseTensor, quantize_blockwise, quantize_blockwise_reference
from te_parallel.ops import block_cast

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = [E4M3, E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp8 dtype -> (largest finite value, mantissa bits, smallest normal exponent)
FORMAT = {E4M3: (448.0, 3, -6), E5M2: (57344.0, 2, -14)}
FLT_MAX = 3.4028234663852886e38


def f32(v: float) -> float:
    """v rounded to the nearest fp32 (inf past the fp32 range)."""
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).item()


def fp8_round(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp64 values (already within +-fp8_max) rounded to nearest even on the FP8 grid; NaN stays NaN."""
    _, mbits, emin = FORMAT[fp8_dtype]
    a = v.abs()
    _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2(a)) = e - 1
    quantum = torch.pow(2.0, (e - 1).clamp(min=emin).to(torch.float64) - mbits)
    return torch.copysign(torch.round(a / quantum) * quantum, v)  # torch.round: half to even


def tile_scale(amax: float, fp8_dtype: torch.dtype, in_dtype: torch.dtype, pow2: bool, eps: float) -> float:
    """The scale of one tile from its amax, in exact arithmetic (the module doc's formula)."""
    fp8_max = FORMAT[fp8_dtype][0]
    if eps > 0:
        amax = max(amax, f32(eps))  # the floor is eps as an fp32
    if amax == 0 or math.isnan(amax) or math.isinf(amax):
        return 1.0
    ratio = Fraction(fp8_max) / Fraction(amax)
    if ratio >= 2 ** 128 - 2 ** 103:  # rounds to +inf in fp32: the input dtype's largest finite value instead
        value = float(torch.finfo(in_dtype).max)
        return 2.0 ** math.floor(math.log2(value)) if pow2 else value
    if not pow2:
        return f32(float(ratio))  # float(Fraction) is correctly rounded; fp64 -> fp32 then is exact rounding
    e = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    if Fraction(2) ** e > ratio:
        e -= 1
    return 2.0 ** e


def expected(x: torch.Tensor, fp8_dtype, tile_rows: int, tile_cols: int, pow2: bool, eps: float):
    """(values fp64 [M, K], scales fp64 [ceil(M/tr), ceil(K/tc)]) of x [M, K] in tile_rows x tile_cols tiles."""
    m, k = x.shape
    mt, kt = -(-m // tile_rows), -(-k // tile_cols)
    x64 = x.to(torch.float64)
    padded = torch.zeros(mt * tile_rows, kt * tile_cols, dtype=torch.float64)  # zeros: below every |x|
    padded[:m, :k] = x64.abs()
    tiles = padded.view(mt, tile_rows, kt, tile_cols)
    amaxes = tiles.amax(dim=(1, 3)) if m and k else torch.zeros(mt, kt, dtype=torch.float64)
    has_nan = tiles.isnan().any(dim=3).any(dim=1) if m and k else torch.zeros(mt, kt, dtype=torch.bool)
    scales = torch.tensor([[tile_scale(math.nan if n else a, fp8_dtype, x.dtype, pow2, eps)
                            for a, n in zip(row_a, row_n)] for row_a, row_n in zip(amaxes.tolist(), has_nan.tolist())],
                          dtype=torch.float64).view(mt, kt)
    scale_full = scales.repeat_interleave(tile_rows, 0)[:m].repeat_interleave(tile_cols, 1)[:, :k]
    prod = (x64 * scale_full).to(torch.float32).to(torch.float64)  # exact product, one fp32 rounding
    fp8_max = FORMAT[fp8_dtype][0]
    return fp8_round(prod.clamp(-fp8_max, fp8_max), fp8_dtype), scales


def assert_direction(data: torch.Tensor, scale_inv: torch.Tensor, want_values: torch.Tensor,
                     want_scales: torch.Tensor) -> None:
    """data's values equal want_values (NaN where it is NaN); scale_inv is fp32(1 / scale) bit for bit."""
    got = data.to(torch.float64)
    assert torch.equal(torch.isnan(got), torch.isnan(want_values))
    ok = ~torch.isnan(want_values)
    assert torch.equal(got[ok], want_values[ok]), (got[ok] - want_values[ok]).abs().max()
    want_inv = (1.0 / want_scales).to(torch.float32)
    assert scale_inv.dtype == torch.float32 and torch.equal(scale_inv, want_inv)


def check_reference(x: torch.Tensor, fp8_dtype, block_dim: int, pow2: bool, eps: float) -> BlockwiseTensor:
    """Both directions of quantize_blockwise_reference(x) against the fp64 formulation; returns them."""
    m, k = x.shape
    q = quantize_blockwise_reference(x, fp8_dtype, block_dim, rowwise=True, columnwise=True, pow2=pow2, eps=eps)
    assert q.data.shape == (m, k) and q.data_t.shape == (k, m) and q.data.dtype == fp8_dtype
    if block_dim == 1:
        values, scales = expected(x, fp8_dtype, 1, 128, pow2, eps)  # scales [M, kt]
        assert_direction(q.data, q.scale_inv, values, scales.t())  # stored [kt, M]
        values_t, scales_t = expected(x.t(), fp8_dtype, 1, 128, pow2, eps)  # tiles of 128 along M
        assert_direction(q.data_t, q.scale_inv_t, values_t, scales_t.t())  # stored [mt, K]
    else:
        values, scales = expected(x, fp8_dtype, 128, 128, pow2, eps)
        assert_direction(q.data, q.scale_inv, values, scales)
        assert_direction(q.data_t, q.scale_inv_t, values.t(), scales.t())
    for name in ("data", "scale_inv", "data_t", "scale_inv_t"):
        assert getattr(q, name).is_contiguous(), name
    return q


def wide_range(m: int, k: int, dtype: torch.dtype, seed: int, log_spread: float = 4.0) -> torch.Tensor:
    """Random x whose rows and columns differ in magnitude by up to e**(2 * log_spread)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    x = x * torch.exp(torch.randn(m, 1, generator=g, dtype=torch.float64) * log_spread / 2)
    x = x * torch.exp(torch.randn(1, k, generator=g, dtype=torch.float64) * log_spread / 2)
    limit = 6e4 if dtype == torch.float16 else 1e30
    return x.clamp(-limit, limit).to(dtype)


@FUZZ
@given(m=st.integers(1, 300), k=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       fp8=st.sampled_from(FP8_DTYPES), block_dim=st.sampled_from([1, 2]), pow2=st.booleans(),
       eps=st.sampled_from([0.0, 1e-3, 0.5]), seed=st.integers(0, 2 ** 31 - 1))
def test_reference_matches_fp64_formulation(m, k, dtype, fp8, block_dim, pow2, eps, seed):
    check_reference(wide_range(m, k, dtype, seed), fp8, block_dim, pow2, eps)


def special_matrix(dtype: torch.dtype) -> torch.Tensor:
    """[256, 384] with one special kind per 128-wide stretch of rows 0..3 and per 128x128 block (row block 0:
    zeros | +inf | NaN; row block 1: tiny | huge | -inf beside ordinary values)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 384, generator=g)
    x[0:128, 0:128] = 0.0
    x[0:128, 128:256][5, 7] = float("inf")
    x[0:128, 256:384][9, 1] = float("nan")
    tiny = 1e-40 if dtype != torch.float16 else 1e-7  # fp32 / bf16 subnormal: fp8_max / amax overflows fp32
    x[128:256, 0:128] = torch.randn(128, 128, generator=g) * tiny
    x[128:256, 128:256] *= 3e38 if dtype != torch.float16 else 6e4
    x[128:256, 256:384][3, 3] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
def test_special_values(dtype, fp8, block_dim, pow2):
    x = special_matrix(dtype)
    q = check_reference(x, fp8, block_dim, pow2, 0.0)
    fp8_max = FORMAT[fp8][0]
    scales = q.rowwise_scales()  # [M, kt] or [mt, kt]
    row0 = 0 if block_dim == 1 else slice(0, 1)
    # amax 0 / inf / NaN: scale 1; zeros stay 0, inf saturates, NaN stays NaN
    assert (scales[row0, 0] == 1).all() and (q.data[0:128, 0:128].float() == 0).all()
    assert (scales[5 if block_dim == 1 else 0, 1] == 1).all() and q.data[5, 135].float().item() == fp8_max
    assert (scales[9 if block_dim == 1 else 0, 2] == 1).all() and torch.isnan(q.data[9, 257].float()).item()
    assert q.data[128 + 3, 259].float().item() == -fp8_max
    if dtype != torch.float16:  # fp8_max / 1e-40 is +inf in fp32: the scale is the dtype's largest finite value
        value = float(torch.finfo(dtype).max)
        scale = 2.0 ** 127 if pow2 else value
        tiny_scale_inv = q.scale_inv[0, 128] if block_dim == 1 else q.scale_inv[1, 0]
        assert tiny_scale_inv.item() == f32(1.0 / scale) and 0 < tiny_scale_inv.item() < 1.1754943508222875e-38
        assert (q.data[128:256, 0:128].float() != 0).any()


def test_eps_floors_the_amax():
    x = torch.full((2, 128), 1e-6)
    x[1] = 0.0  # amax 0 with eps: eps is the amax, not the scale-1 case
    for pow2 in (True, False):
        q = quantize_blockwise_reference(x, E4M3, 1, pow2=pow2, eps=1e-3)
        scale = tile_scale(0.0, E4M3, torch.float32, pow2, 1e-3)
        assert q.scale_inv[0, 0].item() == q.scale_inv[0, 1].item() == f32(1.0 / scale)
        assert q.data[1].float().abs().max().item() == 0
        check_reference(x, E4M3, 1, pow2, 1e-3)


@pytest.mark.parametrize("shape", [(3, 130), (130, 3), (129, 257), (1, 1)])
@pytest.mark.parametrize("block_dim", [1, 2])
def test_ragged_last_tiles_take_the_amax_of_what_exists(shape, block_dim):
    m, k = shape
    x = torch.ones(m, k)
    x[-1, -1] = 0.25  # the last tile of the last row: 1x128 tile of one or two elements, or a corner block
    if k > 128:
        x[-1, 128:] = 0.25
    q = check_reference(x, E4M3, block_dim, True, 0.0)
    last = q.rowwise_scales()[-1, -1].item()
    if block_dim == 1 and k > 128:
        assert last == 1 / 1024  # amax 0.25 -> scale 2**floor(log2(1792)) = 1024, padding not counted
    q.dequantize()  # the layouts agree with dequantize


def expand(scales: torch.Tensor, rows: int, cols: int, m: int, k: int) -> torch.Tensor:
    """[M, K] fp64 from per-tile values, each tile rows x cols."""
    return scales.double().repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k]


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
def test_dequantize_error_bound(fp8, block_dim, pow2):
    """|deq - x| <= half an FP8 step: 2**-(mbits+1) |x| for normals, half the subnormal step (times
    scale_inv) below; so within amax_tile * 2**-mbits (2**-3 for E4M3, 2**-2 for E5M2) of every element."""
    fp8_max, mbits, emin = FORMAT[fp8]
    m, k = 200, 300
    x = wide_range(m, k, torch.float32, seed=11, log_spread=6.0)
    q = check_reference(x, fp8, block_dim, pow2, 0.0)
    columnwise = BlockwiseTensor(None, None, q.data_t, q.scale_inv_t, block_dim, fp8, x.shape)
    if block_dim == 1:  # rowwise tiles 1x128 along K, columnwise tiles 128x1 along M
        directions = [(q.dequantize(torch.float64), expand(q.scale_inv.t(), 1, 128, m, k)),
                      (columnwise.dequantize(torch.float64), expand(q.scale_inv_t, 128, 1, m, k))]
    else:
        directions = [(q.dequantize(torch.float64), expand(q.scale_inv, 128, 128, m, k)),
                      (columnwise.dequantize(torch.float64), expand(q.scale_inv_t.t(), 128, 128, m, k))]
    x64 = x.double()
    for deq, scale_inv in directions:
        err = (deq - x64).abs()
        bound = 2.0 ** -(mbits + 1) * x64.abs() * (1 + 2 ** -20) + 2.0 ** (emin - mbits - 1) * scale_inv
        assert (err <= bound).all(), (err - bound).max()
        amax_tile = scale_inv * fp8_max  # >= the tile's amax (a power-of-two scale is rounded down)
        assert (err <= amax_tile * 2.0 ** -mbits).all()
    if block_dim == 2:  # one scale per block: the transposed copy holds the same values
        assert torch.equal(directions[0][0], directions[1][0])


@pytest.mark.parametrize("shape", [(0, 256), (256, 0), (0, 0)])
@pytest.mark.parametrize("block_dim", [1, 2])
def test_empty(shape, block_dim):
    m, k = shape
    q = quantize_blockwise_reference(torch.empty(shape), E4M3, block_dim, rowwise=True, columnwise=True)
    mt, kt = -(-m // 128), -(-k // 128)
    assert q.data.shape == (m, k) and q.data_t.shape == (k, m)
    assert q.scale_inv.shape == ((kt, m) if block_dim == 1 else (mt, kt))
    assert q.scale_inv_t.shape == ((mt, k) if block_dim == 1 else (kt, mt))


@pytest.mark.parametrize("block_dim", [1, 2])
def test_directions_and_cpu_door(block_dim):
    """Rowwise-only and columnwise-only are the two halves of both; quantize_blockwise on CPU is the reference;
    a non-contiguous x quantizes as its contiguous copy."""
    x = wide_range(190, 260, torch.bfloat16, seed=3)
    both = quantize_blockwise_reference(x, E4M3, block_dim, rowwise=True, columnwise=True)
    row = quantize_blockwise(x, E4M3, block_dim)
    col = quantize_blockwise(x, E4M3, block_dim, rowwise=False, columnwise=True)
    assert row.data_t is None and col.data is None and col.scale_inv is None
    assert torch.equal(row.data.view(torch.uint8), both.data.view(torch.uint8))
    assert torch.equal(row.scale_inv, both.scale_inv)
    assert torch.equal(col.data_t.view(torch.uint8), both.data_t.view(torch.uint8))
    assert torch.equal(col.scale_inv_t, both.scale_inv_t)
    strided = quantize_blockwise_reference(x.t().contiguous().t(), E4M3, block_dim, rowwise=True, columnwise=True)
    assert torch.equal(strided.data_t.view(torch.uint8), both.data_t.view(torch.uint8))
    if block_dim == 2:
        assert torch.equal(both.data_t.view(torch.uint8), both.data.t().view(torch.uint8))
        assert torch.equal(both.scale_inv_t, both.scale_inv.t())


@pytest.mark.parametrize("shape", [(200, 300), (1, 128), (0, 256), (256, 0)])
@pytest.mark.parametrize("block_dim", [1, 2])
def test_kernel_op_shapes_match_the_reference(shape, block_dim):
    """te_parallel::block_quantize's fake kernel (what torch.compile traces with, run here on meta tensors)
    gives the reference's shapes, dtypes and contiguous strides for each direction set."""
    want = quantize_blockwise_reference(torch.zeros(shape), E4M3, block_dim, rowwise=True, columnwise=True)
    for rowwise, columnwise in [(True, False), (False, True), (True, True)]:
        outs = torch.ops.te_parallel.block_quantize(torch.empty(shape, device="meta"), E4M3, block_dim, rowwise,
                                                    columnwise, True, 0.0)
        names = ["data", "scale_inv"] * rowwise + ["data_t", "scale_inv_t"] * columnwise
        assert len(outs) == len(names)
        for name, out in zip(names, outs):
            ref = getattr(want, name)
            assert (out.shape, out.dtype, out.stride()) == (ref.shape, ref.dtype, ref.stride()), name


def test_kernels_not_used_on_cpu():
    assert not block_cast.usable(torch.zeros(4, 4))
    assert not block_cast.usable(torch.zeros(4, 4, device="meta"))
