"""FP8 GEMM through cuBLASLt, in the three layouts of a linear layer.

Two callers of cuBLASLt: `torch._scaled_mm`, and te_parallel's own call (csrc/gemm, `native.gemm.fp8_gemm`),
which also adds a C matrix in the epilogue (`accumulate=`: D = A·B + C, rounded once) and caches its
plans. GEMMs with `accumulate` always take the native call where it is usable (else _scaled_mm and an
add); the others take it when their MMParams say backend="native" (the default; "torch": _scaled_mm).

For y = x·Wᵀ with x [M, K] (tokens × in), W [N, K] (out × in), dy [M, N]:

    fprop  y  = x  · Wᵀ   A = x     [M, K] row-major, B = Wᵀ [K, N] column-major = W.t()
    dgrad  dx = dy · W    A = dy    [M, N] row-major, B = W  [N, K] column-major = (Wᵀ copy).t()
    wgrad  dW = dyᵀ · x   A = dyᵀ   [N, M] row-major (dyᵀ copy), B = x [M, K] column-major = (xᵀ copy).t()

cuBLASLt takes FP8 only as "TN" (A row-major, B column-major), hence the transposed copies that
the casts emit. cuBLASLt also needs every dimension to be a multiple of 16 and cannot multiply two
E5M2 operands. A dimension that is not a multiple of 16 (the token count of a small batch: TE accepts
any multiple of 8, Lightning's and accelerate's test models send 8) is zero-padded here, on every
device: zero rows and columns add nothing to any product, and the casts (and so the amaxes) have
already seen the real data. The padding copies the FP8 operands, which only small GEMMs (or features
that are not multiples of 16, on every call) pay.
"""
from __future__ import annotations

from typing import Optional

import torch

from te_parallel.native import gemm as native_gemm
from te_parallel.native import torch_ops as native_ops
from te_parallel.fp8.blockwise import BLOCK, BlockwiseTensor
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.recipe import MMParams

EXACT = MMParams()  # exact accumulation, native call: the GEMM of a caller that names no MMParams

HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _check(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, what: str) -> None:
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"FP8 {what} GEMM: inner dims differ, A is {tuple(a.shape)} and B is {tuple(b.shape)}")
    if a.dtype is torch.float8_e5m2 and b.dtype is torch.float8_e5m2:
        raise ValueError(
            f"FP8 {what} GEMM of two E5M2 operands is not supported by cuBLASLt; use Format.HYBRID or Format.E4M3"
        )
    if out_dtype not in HIGH_PRECISION:
        raise ValueError(f"FP8 GEMM output dtype must be float32, bfloat16 or float16, got {out_dtype}")


def fp8_mm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    what: str = "",
    out: Optional[torch.Tensor] = None,
    mm: MMParams = EXACT,
    accumulate: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(a · a_scale_inv) @ (b · b_scale_inv) + bias (+ accumulate), accumulated in fp32.

    mm: the accumulation (use_split_accumulator=False is cuBLASLt's FAST_ACCUM: no periodic
    promotion of the tensor cores' partial sums to fp32 registers; faster, less exact for long K)
    and which call issues the GEMM (te_parallel.recipe.MMParams).

    a: [M, K] FP8 row-major (contiguous); b: [K, N] FP8 column-major (b.t() contiguous).
    out: optional contiguous [M, N] of out_dtype to write into (e.g. rows of a larger output).
    accumulate: optional contiguous [M, N] of out_dtype added in the GEMM's fp32 epilogue (one rounding).
    """
    _check(a, b, out_dtype, what)
    if not a.is_contiguous() or not _column_major(b):
        raise ValueError(f"FP8 {what} GEMM needs A row-major and B column-major (cuBLASLt 'TN')")
    shape = (a.shape[0], b.shape[1])
    if out is not None and (out.shape != shape or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"FP8 {what} GEMM: out is {tuple(out.shape)} {out.dtype}; need contiguous {shape} {out_dtype}")
    if accumulate is not None and (accumulate.shape != shape or accumulate.dtype != out_dtype
                                   or not accumulate.is_contiguous()):
        raise ValueError(f"FP8 {what} GEMM: accumulate is {tuple(accumulate.shape)} {accumulate.dtype}; need "
                         f"contiguous {shape} {out_dtype}")
    if (shape[0] | a.shape[1] | shape[1]) & 15:
        return _padded_fp8_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, what, out, mm, accumulate)
    if a.is_cpu:
        result = _cpu_fp8_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, accumulate)
        return result if out is None else out.copy_(result)
    # cuBLASLt fuses a bias only into a bf16/fp16 output; add it afterwards for fp32.
    fuse_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
    fast_accum = not mm.use_split_accumulator
    if (accumulate is not None or mm.backend == "native") and native_gemm.usable():
        if out is None and native_ops.usable():
            # the same cuBLASLt call as the binding's below, with the checks, the output, the stream and the
            # launch in C++ behind one dispatcher call: ~20 µs less host time per GEMM (docs/benchmarks.md)
            out = native_ops.fp8_gemm(a, _scalar_f32(a_scale_inv), b.t(), _scalar_f32(b_scale_inv), out_dtype,
                                      bias if fuse_bias else None, accumulate, fast_accum)
        else:
            if out is None:
                out = torch.empty(shape, dtype=out_dtype, device=a.device)
            native_gemm.fp8_gemm(a, _scalar_f32(a_scale_inv), b.t(), _scalar_f32(b_scale_inv), out, accumulate,
                                 bias if fuse_bias else None, fast_accum)
        return out if bias is None or fuse_bias else out.add_(bias.to(out_dtype))
    if torch.compiler.is_compiling() and native_ops.usable():  # eager's cuBLASLt call, as one traced node
        result = native_ops.fp8_gemm(a, _scalar_f32(a_scale_inv), b.t(), _scalar_f32(b_scale_inv), out_dtype,
                                     bias if fuse_bias else None, accumulate, fast_accum)
        if bias is not None and not fuse_bias:
            result = result + bias.to(out_dtype)
        return result if out is None else out.copy_(result)
    kwargs = {} if out is None else {"out": out}
    result = torch._scaled_mm(
        a,
        b,
        scale_a=_scalar_f32(a_scale_inv),
        scale_b=_scalar_f32(b_scale_inv),
        bias=bias if fuse_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
        **kwargs,
    )
    if bias is not None and not fuse_bias:
        result = result.add_(bias.to(out_dtype)) if out is not None else result + bias.to(out_dtype)
    if accumulate is not None:  # (no native GEMM here: the sum is rounded twice)
        result = result.add_(accumulate)
    return result


def _padded_fp8_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, what, out, mm, accumulate):
    """fp8_mm with M, K and N rounded up to multiples of 16 by zero padding (A [M, K] row-major, B [K, N]
    column-major); the [m, n] corner of the result is the product."""
    (m, k), n = a.shape, b.shape[1]
    rows, inner, cols = (-(-v // 16) * 16 for v in (m, k, n))
    a_pad = _zero_padded(a, rows, inner)  # [rows, inner]
    b_pad = _zero_padded(b.t(), cols, inner).t()  # [inner, cols], column-major
    bias_pad = None if bias is None else torch.nn.functional.pad(bias, (0, cols - n))
    acc_pad = None if accumulate is None else torch.nn.functional.pad(accumulate, (0, cols - n, 0, rows - m))
    result = fp8_mm(a_pad, a_scale_inv, b_pad, b_scale_inv, out_dtype, bias_pad, what, None, mm, acc_pad)[:m, :n]
    return result.contiguous() if out is None else out.copy_(result)


def _zero_padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t [r, c] (FP8) in the top-left corner of a zero [rows, cols] tensor of its dtype."""
    if tuple(t.shape) == (rows, cols):
        return t.contiguous()
    padded = torch.zeros((rows, cols), dtype=torch.uint8, device=t.device)
    padded[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
    return padded.view(t.dtype)


def _column_major(b: torch.Tensor) -> bool:
    """b.t().is_contiguous(), without making the view in the usual case."""
    return (b.stride(0) == 1 and b.stride(1) == b.shape[0]) or b.t().is_contiguous()


def _scalar_f32(t: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 tensor as _scaled_mm takes its scales (the casts already make them so: no new view)."""
    return t if t.dim() == 0 and t.dtype == torch.float32 else t.reshape(()).to(torch.float32)


def _cpu_fp8_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, accumulate=None):
    """The same math on the CPU BLAS: FP8 values widen to fp32 exactly and their products are exact
    in fp32, so this is an fp32-accumulated FP8 GEMM like cuBLASLt's. torch's CPU `_scaled_mm` is a
    scalar loop (290 s for 2048×768×3072), too slow even for tests."""
    acc = a.to(torch.float32) @ b.to(torch.float32)
    out = acc * (a_scale_inv.to(torch.float32) * b_scale_inv.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    if accumulate is not None:
        out = out + accumulate.to(torch.float32)
    # (an fp32 result as it is: dynamo traces a same-dtype .to() as an alias of `out`, and an autograd
    # Function may not keep such an alias of its own intermediate for backward)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def fprop(x: Float8Tensor, w: Float8Tensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
          out: Optional[torch.Tensor] = None, accumulate: Optional[torch.Tensor] = None, mm: MMParams = EXACT):
    """y [M, N] = x [M, K] · W[N, K]ᵀ (+ accumulate); mm: the recipe's fp8_gemm_fprop."""
    if type(x) is BlockwiseTensor:
        return block_mm(*_rows_operand(x), *_rows_operand_b(w), out_dtype, bias, "fprop", out, accumulate)
    return fp8_mm(x.data, x.scale_inv, w.data.t(), w.scale_inv, out_dtype, bias, "fprop", out, mm, accumulate)


def dgrad(dy: Float8Tensor, w: Float8Tensor, out_dtype: torch.dtype, out: Optional[torch.Tensor] = None,
          accumulate: Optional[torch.Tensor] = None, mm: MMParams = EXACT):
    """dx [M, K] = dy [M, N] · W [N, K] (+ accumulate); mm: the recipe's fp8_gemm_dgrad."""
    if type(dy) is BlockwiseTensor:
        return block_mm(*_rows_operand(dy), *_cols_operand_b(w), out_dtype, None, "dgrad", out, accumulate)
    return fp8_mm(dy.data, dy.scale_inv, w.transposed().t(), w.scale_inv, out_dtype, None, "dgrad", out, mm,
                  accumulate)


def wgrad(dy: Float8Tensor, x: Float8Tensor, out_dtype: torch.dtype, mm: MMParams = EXACT):
    """dW [N, K] = dy [M, N]ᵀ · x [M, K]; mm: the recipe's fp8_gemm_wgrad."""
    if type(dy) is BlockwiseTensor:
        return block_mm(*_cols_operand(dy), *_cols_operand_b(x), out_dtype, None, "wgrad")
    return fp8_mm(dy.transposed(), dy.scale_inv, x.transposed().t(), x.scale_inv, out_dtype, None, "wgrad", mm=mm)


def fp8_mm_reference(a: Float8Tensor, b: Float8Tensor) -> torch.Tensor:
    """fp64 reference of fprop: dequantize both operands, multiply in fp64 (a [M, K], b [N, K])."""
    return (a.data.double() * a.scale_inv.double()) @ (b.data.double() * b.scale_inv.double()).t()


# --- block-scaled operands (Float8BlockScaling) -----------------------------------------------------------
# The GEMM is chosen by the pair of operand granularities: two per-tensor operands take fp8_mm above; a
# 1x128-tiled A with a 1x128-tiled or 128x128-block B takes block_mm, cuBLASLt's block-scaled FP8 modes
# through torch._scaled_mm (CUDA >= 12.9 on sm_90). Operands reach block_mm in the layouts that call reads,
# with no copy (te_parallel.fp8.blockwise's module doc): A [M, K] row-major with its scales [M, K/128]
# (strides (1, M)); B [K, N] column-major with [K/128, N] (1x128 tiles) or [K/128, N/128] (blocks).
# cuBLASLt's block-scaled modes always accumulate with split accumulation (Float8BlockScaling enforces it).


def _rows_operand(t: BlockwiseTensor):
    """A operand from the rowwise direction of t [M, K]: (data, scales as the GEMM reads them, block dim)."""
    if t.block_dim == 1:
        return t.data, t.scale_inv.t(), 1
    return t.data, t.scale_inv, 2


def _cols_operand(t: BlockwiseTensor):
    """A operand from the columnwise direction of t [M, N] (A = tᵀ [N, M], a GEMM over M)."""
    data_t = t.transposed()
    if t.block_dim == 1:
        return data_t, t.scale_inv_t.t(), 1
    return data_t, t.scale_inv_t, 2


def _rows_operand_b(w: BlockwiseTensor):
    """B = wᵀ [K, N] column-major from w [N, K]'s rowwise direction (fprop's weight)."""
    if w.block_dim == 1:
        return w.data.t(), w.scale_inv, 1
    return w.data.t(), w.scale_inv.t(), 2


def _cols_operand_b(w):
    """B [N, K] column-major from w [N, K]'s columnwise direction: dgrad's W (its transposed bytes) and
    wgrad's x. A weight whose columnwise bytes are made from the high-precision values in backward comes
    as a source that makes them (fp8.gemm_quantizers.BlockWeightSource)."""
    if not isinstance(w, BlockwiseTensor):
        w = w.with_transpose()
    data_t = w.transposed()
    if w.block_dim == 1:
        return data_t.t(), w.scale_inv_t, 1
    return data_t.t(), w.scale_inv_t.t(), 2


def block_mm(a: torch.Tensor, sa: torch.Tensor, a_dim: int, b: torch.Tensor, sb: torch.Tensor, b_dim: int,
             out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, what: str = "",
             out: Optional[torch.Tensor] = None, accumulate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(A · its block scales) @ (B · its block scales) (+ bias) (+ accumulate), accumulated in fp32.

    a [M, K] FP8 row-major, sa [M, K/128] (1x128) or [M/128, K/128] (blocks); b [K, N] FP8 column-major,
    sb [K/128, N] (1x128) or [K/128, N/128] (blocks); K/128 etc. rounded up. Two 128x128-block operands
    are refused (no kernel multiplies them). On the CPU: both operands dequantized, multiplied in fp32."""
    _check(a, b, out_dtype, what)
    if a_dim == 2 and b_dim == 2:
        raise ValueError(f"block-scaled {what} GEMM of two 128x128-block operands is not supported; quantize one of "
                         f"them in 1x128 tiles (Float8BlockScaling's *_block_scaling_dim)")
    m, k = a.shape
    n = b.shape[1]
    if a.is_cpu:
        result = _expand(a, sa, a_dim, False) @ _expand(b, sb, b_dim, True)
        if bias is not None:
            result = result + bias.to(torch.float32)
        if accumulate is not None:
            result = result + accumulate.to(torch.float32)
        result = result.to(out_dtype)
        return result if out is None else out.copy_(result)
    if (m | k | n) & 15 or (2 in (a_dim, b_dim) and -(-k // BLOCK) % 4):
        return _padded_block_mm(a, sa, a_dim, b, sb, b_dim, out_dtype, bias, what, out, accumulate)
    if a_dim == 1 and not (sa.stride(0) == 1 and (sa.stride(1) == m or sa.shape[1] == 1)):
        sa = sa.t().contiguous().t()  # (a row slice's scales: [M, K/128] with strides (1, M) is what cuBLASLt reads)
    elif a_dim == 2 and not sa.is_contiguous():
        sa = sa.contiguous()
    if b_dim == 2 and sb.stride(0) != 1:
        sb = sb.t().contiguous().t()  # (block scales [K/128, N/128] with the K tiles innermost, as cuBLASLt reads them)
    elif b_dim == 1 and not sb.is_contiguous():
        sb = sb.contiguous()
    result = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=False)
    if bias is not None:
        result = result.add_(bias.to(out_dtype))
    if accumulate is not None:
        result = result.add_(accumulate)
    return result if out is None else out.copy_(result)


def _expand(data: torch.Tensor, scales: torch.Tensor, dim: int, is_b: bool) -> torch.Tensor:
    """fp32 values of an operand as block_mm takes it (A [M, K] with [M, K/128] or [M/128, K/128] scales; B
    [K, N] with [K/128, N] or [K/128, N/128])."""
    f = data.to(torch.float32)
    r, c = f.shape
    s = scales.to(torch.float32)
    if is_b:  # tiles run along K = the rows of B
        s = s.repeat_interleave(BLOCK, dim=0)[:r]
        return f * (s if dim == 1 else s.repeat_interleave(BLOCK, dim=1)[:, :c])
    s = s.repeat_interleave(BLOCK, dim=1)[:, :c]
    return f * (s if dim == 1 else s.repeat_interleave(BLOCK, dim=0)[:r])


def _padded_block_mm(a, sa, a_dim, b, sb, b_dim, out_dtype, bias, what, out, accumulate):
    """block_mm with M, K, N rounded up to multiples of 16 by zero bytes; padded rows, columns and tiles get
    scale 1 and add nothing. With a 128x128-block operand K also goes up to a multiple of 4 tiles (512): cuBLASLt
    reads a block operand's scales with a leading dimension of whole groups of 4 K-tiles (TE pads its scale
    tensors so; measured on an H200: 35% error at K = 256 unpadded)."""
    (m, k), n = a.shape, b.shape[1]
    rows, inner, cols = (-(-v // 16) * 16 for v in (m, k, n))
    kt = -(-k // BLOCK)
    if 2 in (a_dim, b_dim) and kt % 4:
        kt = -(-kt // 4) * 4
        inner = kt * BLOCK
        sa = torch.nn.functional.pad(sa, (0, kt - sa.shape[1]), value=1.0)  # [M or M/128, K tiles]
        sb = torch.nn.functional.pad(sb, (0, 0, 0, kt - sb.shape[0]), value=1.0)  # [K tiles, N or N/128]
    a_pad = _zero_padded(a, rows, inner)
    b_pad = _zero_padded(b.t(), cols, inner).t()
    if a_dim == 1 and rows != m:
        sa = torch.nn.functional.pad(sa, (0, 0, 0, rows - m), value=1.0)
    if a_dim == 2 and -(-rows // BLOCK) != sa.shape[0]:
        sa = torch.nn.functional.pad(sa, (0, 0, 0, -(-rows // BLOCK) - sa.shape[0]), value=1.0)
    if b_dim == 1 and cols != n:
        sb = torch.nn.functional.pad(sb, (0, cols - n), value=1.0)
    if b_dim == 2 and -(-cols // BLOCK) != sb.shape[1]:
        sb = torch.nn.functional.pad(sb, (0, -(-cols // BLOCK) - sb.shape[1]), value=1.0)
    bias_pad = None if bias is None else torch.nn.functional.pad(bias, (0, cols - n))
    acc_pad = None if accumulate is None else torch.nn.functional.pad(accumulate, (0, cols - n, 0, rows - m))
    result = block_mm(a_pad, sa, a_dim, b_pad, sb, b_dim, out_dtype, bias_pad, what, None, acc_pad)[:m, :n]
    return result.contiguous() if out is None else out.copy_(result)
