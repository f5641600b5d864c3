"""Block-scaled FP8 quantization kernels (Triton): 1x128 tiles in both directions from one read of x, and
128x128 blocks with their transposed copy from the same read.

The bytes and scales are te_parallel.fp8.blockwise.quantize_blockwise_reference's, bit for bit (see that
module's doc for the scale formula and the layouts). What keeps them equal:

* the scale is one IEEE division (`div_rn`: Triton's `/` on fp32 is the approximate `div.full.f32`), and so
  is scale_inv = 1 / scale, which is subnormal where the scale is near the fp32 maximum;
* the tile amax propagates NaN (`tl.max` drops it), so a tile holding a NaN takes scale 1 as in torch;
* the product x * scale is one fp32 multiplication, clamped to +-fp8_max by comparisons (NaN fails both
  and stays NaN), then rounded to nearest even by the hardware conversion.

The grid has one program per 128x128 tile of x [M, K] (a tile past the edge is masked, its missing elements
read as 0, which no |x| is below). With 1x128 tiles a program reduces its tile along K for the rowwise
direction (128 row scales) and along M for the columnwise one (128 column scales), and writes the
columnwise bytes transposed into data_t [K, M]; with 128x128 blocks it reduces the whole tile to one scale
and writes data and, if asked, data_t (from an FP8 tile of its own: one tile stored both ways hits a ptxas
bug, see the kernel). One program per tile, 4 warps, no loop: the kernel is a single pass over x.

Eager calls launch the kernel directly (host time: this runs for every GEMM operand); traced code
calls the custom op te_parallel::block_quantize, whose fake kernel gives the output shapes, so that
torch.compile graphs and CUDA graphs hold it as one opaque node.
"""
from __future__ import annotations

import contextlib
from typing import List

import torch

from te_parallel.fp8.blockwise import BLOCK, BlockwiseTensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: usable() is False and the torch reference runs
    triton = None

__all__ = ["usable", "quantize"]

# fp8 dtype -> (fp8_max, E5M2 flag of the kernel)
_FP8 = {torch.float8_e4m3fn: (448.0, False), torch.float8_e5m2: (57344.0, True)}
# input dtype -> the scale that replaces an infinite fp8_max / amax: the dtype's largest finite value
_INF_SCALE = {dt: float(torch.finfo(dt).max) for dt in (torch.bfloat16, torch.float16, torch.float32)}
_DEVICE_OK: dict = {}  # CUDA device index -> capability >= 8.9 and triton importable
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device  # (the C binding: host time)


def usable(x: torch.Tensor) -> bool:
    """True for a CUDA tensor of a dtype the kernels read (bf16, fp16, fp32) on an sm_89+ GPU with triton
    importable; the capability is asked once per device."""
    return x.is_cuda and x.dtype in _INF_SCALE and _device_ok(x.get_device())


# Traced code asks usable(): dynamo runs this while tracing and keeps its answer as a constant (traced, the
# cache's first fill would fail the graph's guard on the cache).
@torch.compiler.assume_constant_result
def _device_ok(index: int) -> bool:
    ok = _DEVICE_OK.get(index)
    if ok is None:
        ok = _DEVICE_OK[index] = triton is not None and torch.cuda.get_device_capability(index) >= (8, 9)
    return ok


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, block_dim: int, *, rowwise: bool = True,
             columnwise: bool = False, pow2: bool = True, eps: float = 0.0) -> BlockwiseTensor:
    """quantize_blockwise of a 2-D CUDA x (any strides) in one kernel launch; fresh output tensors."""
    if torch.compiler.is_compiling():
        outs = torch.ops.te_parallel.block_quantize(x, fp8_dtype, block_dim, rowwise, columnwise, pow2, eps)
    else:
        outs = _launch(x, fp8_dtype, block_dim, rowwise, columnwise, pow2, eps)
    data, scale_inv = (outs[0], outs[1]) if rowwise else (None, None)
    data_t, scale_inv_t = (outs[-2], outs[-1]) if columnwise else (None, None)
    return BlockwiseTensor(data, scale_inv, data_t, scale_inv_t, block_dim, fp8_dtype, x.shape)


def _outputs(x: torch.Tensor, fp8_dtype: torch.dtype, block_dim: int, rowwise: bool,
             columnwise: bool) -> List[torch.Tensor]:
    """Empty outputs: [data, scale_inv] if rowwise, then [data_t, scale_inv_t] if columnwise."""
    m, k = x.shape
    mt, kt = -(-m // BLOCK), -(-k // BLOCK)
    outs = []
    if rowwise:  # data [M, K]; scale_inv [ceil(K/128), M] (1x128) or [ceil(M/128), ceil(K/128)] (128x128)
        outs.append(x.new_empty((m, k), dtype=fp8_dtype))
        outs.append(x.new_empty((kt, m) if block_dim == 1 else (mt, kt), dtype=torch.float32))
    if columnwise:  # data_t [K, M]; scale_inv_t [ceil(M/128), K] (1x128) or [ceil(K/128), ceil(M/128)]
        outs.append(x.new_empty((k, m), dtype=fp8_dtype))
        outs.append(x.new_empty((mt, k) if block_dim == 1 else (kt, mt), dtype=torch.float32))
    return outs


def _launch(x: torch.Tensor, fp8_dtype: torch.dtype, block_dim: int, rowwise: bool, columnwise: bool, pow2: bool,
            eps: float) -> List[torch.Tensor]:
    fp8 = _FP8.get(fp8_dtype)
    if fp8 is None or x.dim() != 2 or block_dim not in (1, 2) or not (rowwise or columnwise):
        raise ValueError(f"block_cast.quantize: got x {tuple(x.shape)} {x.dtype}, fp8_dtype {fp8_dtype}, block_dim "
                         f"{block_dim!r}, rowwise={rowwise}, columnwise={columnwise}; need a 2-D x, "
                         "torch.float8_e4m3fn or torch.float8_e5m2, block_dim 1 or 2 and at least one direction")
    outs = _outputs(x, fp8_dtype, block_dim, rowwise, columnwise)
    m, k = x.shape
    if m == 0 or k == 0:
        return outs
    data, scale_inv = (outs[0], outs[1]) if rowwise else (None, None)
    data_t, scale_inv_t = (outs[-2], outs[-1]) if columnwise else (None, None)
    # the tile is 128x128 in every mode: a 1x128 direction needs 128 along its own dim, and with both
    # directions one read of a 128x128 tile serves the two. 4 warps: on an H200 (bf16 4096x14336) every mode
    # ran as fast or faster than with 8 (1x128 both directions 1850 GB/s against 1458). Triton launches on
    # the current device.
    index = x.get_device()
    guard = contextlib.nullcontext() if index == _current_device() else torch.cuda.device(index)
    with guard:
        _block_cast_kernel[(-(-m // BLOCK), -(-k // BLOCK))](
            x, data, scale_inv, data_t, scale_inv_t, m, k, x.stride(0), x.stride(1), float(eps),
            BLOCK_M=BLOCK, BLOCK_K=BLOCK, BLOCKS_2D=block_dim == 2, ROWWISE=rowwise, COLWISE=columnwise,
            POW2=pow2, FP8_MAX=fp8[0], INF_SCALE=_INF_SCALE[x.dtype], E5M2=fp8[1], num_warps=4)
    return outs


# ------------------------------------------------------------------------------------------------
# The op of traced code (torch.compile, CUDA graphs made from compiled graphs): the same launch behind
# torch's dispatcher. It returns the directions asked for, in _outputs' order.
@torch.library.custom_op("te_parallel::block_quantize", mutates_args=(), device_types="cuda")
def _block_quantize_op(x: torch.Tensor, fp8_dtype: torch.dtype, block_dim: int, rowwise: bool, columnwise: bool,
                       pow2: bool, eps: float) -> List[torch.Tensor]:
    return _launch(x, fp8_dtype, block_dim, rowwise, columnwise, pow2, eps)


@_block_quantize_op.register_fake
def _(x, fp8_dtype, block_dim, rowwise, columnwise, pow2, eps):
    return _outputs(x, fp8_dtype, block_dim, rowwise, columnwise)


# ------------------------------------------------------------------------------------------------
# The kernel (pointers, sizes and strides only).
if triton is not None:
    _FLT_MAX = tl.constexpr(3.4028234663852886e38)

    @triton.jit
    def _nan_max(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _scales(amax, eps, FP8_MAX: tl.constexpr, INF_SCALE: tl.constexpr, POW2: tl.constexpr):
        """(scale, scale_inv) from each tile's amax, as blockwise.scales_from_amax (eps 0 changes nothing)."""
        amax = tl.where(amax < eps, eps, amax)
        bad = (amax == 0.0) | (amax != amax) | (amax > _FLT_MAX)  # 0, NaN, inf: scale 1
        scale = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax)
        scale = tl.where(scale > _FLT_MAX, INF_SCALE, scale)
        if POW2:  # keep sign and exponent: 2 ** floor(log2(scale))
            scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        scale = tl.where(bad, 1.0, scale)
        return scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)

    @triton.jit
    def _to_fp8(y, FP8_MAX: tl.constexpr, E5M2: tl.constexpr):
        """fp8(clamp(y, -FP8_MAX, FP8_MAX)), nearest even; NaN fails both comparisons and stays NaN."""
        y = tl.where(y > FP8_MAX, FP8_MAX, y)
        y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
        if E5M2:
            q = y.to(tl.float8e5, fp_downcast_rounding="rtne")
        else:
            q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        return q

    @triton.jit
    def _block_cast_kernel(x_ptr, data_ptr, scale_inv_ptr, data_t_ptr, scale_inv_t_ptr, M, K, stride_xm, stride_xk,
                           eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKS_2D: tl.constexpr,
                           ROWWISE: tl.constexpr, COLWISE: tl.constexpr, POW2: tl.constexpr,
                           FP8_MAX: tl.constexpr, INF_SCALE: tl.constexpr, E5M2: tl.constexpr):
        # program (pid_m, pid_k): x[m0:m0+BM, k0:k0+BK]; offsets of the tile in int64, inside it in int32.
        # data [M, K] at m * K + k; data_t [K, M] at k * M + m (the transposed store).
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        m0 = pid_m.to(tl.int64) * BLOCK_M
        k0 = pid_k.to(tl.int64) * BLOCK_K
        r = tl.arange(0, BLOCK_M)[:, None]  # [BM, 1]
        c = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        row_ok = r < M - pid_m * BLOCK_M
        col_ok = c < K - pid_k * BLOCK_K
        mask = row_ok & col_ok
        x = tl.load(x_ptr + (m0 * stride_xm + k0 * stride_xk) + r * stride_xm + c * stride_xk, mask=mask,
                    other=0.0).to(tl.float32)
        ax = tl.abs(x)
        row_offsets = (m0 * K + k0) + r * K + c  # into data
        col_offsets = (k0 * M + m0) + c * M + r  # into data_t
        if BLOCKS_2D:  # one scale per 128x128 block: scale_inv [mt, kt], scale_inv_t [kt, mt]
            amax = tl.reduce(tl.reduce(ax, 1, _nan_max, keep_dims=True), 0, _nan_max, keep_dims=True)  # [1, 1]
            scale, scale_inv = _scales(amax, eps, FP8_MAX, INF_SCALE, POW2)
            one = tl.zeros([1, 1], dtype=tl.int64)
            if ROWWISE:
                tl.store(data_ptr + row_offsets, _to_fp8(x * scale, FP8_MAX, E5M2), mask=mask)
                tl.store(scale_inv_ptr + (pid_m.to(tl.int64) * tl.num_programs(1) + pid_k) + one, scale_inv)
            if COLWISE:
                if ROWWISE:
                    # One FP8 tile stored both ways comes out corrupted in the transposed store (Triton 3.6,
                    # sm_90; a ptxas bug). The transposed store takes a tile of its own, from the same amax
                    # reduced in the other order so that the compiler does not merge the two.
                    amax_t = tl.reduce(tl.reduce(ax, 0, _nan_max, keep_dims=True), 1, _nan_max, keep_dims=True)
                    scale = _scales(amax_t, eps, FP8_MAX, INF_SCALE, POW2)[0]
                tl.store(data_t_ptr + col_offsets, _to_fp8(x * scale, FP8_MAX, E5M2), mask=mask)
                tl.store(scale_inv_t_ptr + (pid_k.to(tl.int64) * tl.num_programs(0) + pid_m) + one, scale_inv)
        else:
            if ROWWISE:  # 1x128 tiles along K: a scale per row, scale_inv [kt, M]
                scale_r, scale_inv_r = _scales(tl.reduce(ax, 1, _nan_max, keep_dims=True), eps, FP8_MAX, INF_SCALE,
                                               POW2)  # [BM, 1]
                tl.store(data_ptr + row_offsets, _to_fp8(x * scale_r, FP8_MAX, E5M2), mask=mask)
                tl.store(scale_inv_ptr + (pid_k.to(tl.int64) * M + m0) + r, scale_inv_r, mask=row_ok)
            if COLWISE:  # 1x128 tiles along M: a scale per column, scale_inv_t [mt, K]; data_t transposed
                scale_c, scale_inv_c = _scales(tl.reduce(ax, 0, _nan_max, keep_dims=True), eps, FP8_MAX, INF_SCALE,
                                               POW2)  # [1, BK]
                tl.store(data_t_ptr + col_offsets, _to_fp8(x * scale_c, FP8_MAX, E5M2), mask=mask)
                tl.store(scale_inv_t_ptr + (pid_m.to(tl.int64) * K + k0) + c, scale_inv_c, mask=col_ok)
