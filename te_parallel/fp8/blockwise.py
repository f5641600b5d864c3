"""Block-scaled FP8 operands: one fp32 scale per 1x128 tile or per 128x128 block (Float8BlockScaling).

A tile's scale comes from its own amax (TE's compute_scale_from_amax, bit for bit):

    amax  = max(amax, epsilon)
    scale = fp8_max / amax            (one IEEE division); +inf -> the input dtype's largest finite value
    scale = 2 ** floor(log2(scale))   with power-of-two scales (the fp32 mantissa bits cleared)
    scale = 1                         where amax is 0, inf or NaN
    data  = fp8(clamp(x * scale, -fp8_max, fp8_max))   (NaN stays NaN; +-inf saturates to +-fp8_max)
    scale_inv = 1 / scale             (what the GEMM multiplies by)

Layouts (what the GEMMs read without a copy: torch._scaled_mm's cuBLASLt block-scaled modes):

* 1x128 tiles of x [M, K] (block_dim 1). Rowwise: `data` [M, K], `scale_inv` [ceil(K/128), M] (tile
  column-major: scale_inv[j, i] is row i's tile j). Columnwise (what a GEMM over M reads, wgrad):
  the tiles run along M, i.e. the rowwise quantization of xᵀ, `data_t` [K, M] and `scale_inv_t`
  [ceil(M/128), K]. The two directions are quantized separately from the high-precision values (the
  FP8 transpose of one would carry the other direction's scales), in one read where a kernel does both.
* 128x128 blocks of w [N, K] (block_dim 2). `data` [N, K], `scale_inv` [ceil(N/128), ceil(K/128)];
  the transpose is exact (the blocks are square): `data_t` = dataᵀ, `scale_inv_t` = scale_invᵀ.

Ragged last tiles are allowed: a tile past the edge takes the amax of the elements that exist.
The quantization here in torch is the reference and the CPU path; on CUDA the Triton kernels
(te_parallel.ops.block_cast) produce the same bytes and scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

BLOCK = 128
_ROUND_POW2_MASK = -8388608  # 0xFF800000 as an int32: sign and exponent bits of an fp32


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BlockwiseTensor:
    """A block-scaled FP8 operand [rows, cols] (see the module doc for the layouts).

    block_dim: 1 (1x128 tiles) or 2 (128x128 blocks). Either direction may be absent: a GEMM that reads
    only rows (fprop's x) needs `data`, wgrad only `data_t`. `shape` is the logical [rows, cols]."""

    data: Optional[torch.Tensor]
    scale_inv: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scale_inv_t: Optional[torch.Tensor]
    block_dim: int
    fp8_dtype: torch.dtype
    shape: torch.Size

    granularity = "block"

    def transposed(self) -> torch.Tensor:
        """The [cols, rows] data (columnwise). For 128x128 blocks made from the rowwise bytes on first use;
        for 1x128 tiles it must have been quantized with the columnwise direction."""
        if self.data_t is None:
            if self.block_dim != 2 or self.data is None:
                raise RuntimeError("this 1x128-tiled FP8 tensor was quantized without its columnwise direction "
                                   "(quantize with columnwise=True for a GEMM over its rows)")
            # (copies, never views: a traced backward may not keep an alias of a forward's tensor)
            self.data_t = _transposed_copy(self.data)
            self.scale_inv_t = _transposed_copy(self.scale_inv)
        return self.data_t

    def with_transpose(self) -> "BlockwiseTensor":
        """The same tensor with its columnwise direction present (made now for 128x128 blocks)."""
        if self.data_t is not None:
            return self
        other = BlockwiseTensor(self.data, self.scale_inv, None, None, self.block_dim, self.fp8_dtype, self.shape)
        other.transposed()
        return other

    def rowwise_only(self) -> "BlockwiseTensor":
        """The rowwise direction alone (what fprop reads, and what its all-gather moves)."""
        if self.data_t is None:
            return self
        return BlockwiseTensor(self.data, self.scale_inv, None, None, self.block_dim, self.fp8_dtype, self.shape)

    def only_columnwise(self) -> "BlockwiseTensor":
        """Keep the columnwise direction only (what wgrad reads); the rowwise bytes are freed."""
        self.transposed()
        return BlockwiseTensor(None, None, self.data_t, self.scale_inv_t, self.block_dim, self.fp8_dtype, self.shape)

    def drop_rowwise(self) -> None:
        """Free the rowwise bytes in place (after dgrad, before wgrad), keeping the columnwise ones."""
        self.transposed()
        self.data = self.scale_inv = None

    def row_slice(self, r0: int, r1: int) -> "BlockwiseTensor":
        """Rows [r0, r1) of the rowwise direction (1x128 tiles: a row's scales are its own)."""
        if self.block_dim != 1:
            raise ValueError("row_slice: only 1x128-tiled tensors slice by rows")
        return BlockwiseTensor(self.data[r0:r1], self.scale_inv[:, r0:r1], None, None, 1, self.fp8_dtype,
                               torch.Size((r1 - r0, self.shape[1])))

    def rowwise_scales(self) -> torch.Tensor:
        """The rowwise scale_inv as [rows' tiles, cols' tiles] ([M, ceil(K/128)] for 1x128 tiles)."""
        return self.scale_inv.t() if self.block_dim == 1 else self.scale_inv

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values [rows, cols] (from the rowwise direction, else the columnwise one)."""
        if self.data is not None:
            return dequantize_blockwise(self.data, self.rowwise_scales(), self.block_dim).to(dtype)
        scales = self.scale_inv_t.t() if self.block_dim == 1 else self.scale_inv_t
        return dequantize_blockwise(self.data_t, scales, self.block_dim).t().to(dtype)


def _transposed_copy(t: torch.Tensor) -> torch.Tensor:
    return t.t().clone(memory_format=torch.contiguous_format)


def scales_from_amax(amax: torch.Tensor, fp8_max: float, pow2: bool, eps: float, value_for_inf: float):
    """(scale, scale_inv) of each tile from its amax (fp32), as the module doc says; the kernels match it."""
    amax = amax.to(torch.float32)
    if eps > 0:
        amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    bad = torch.isinf(amax) | torch.isnan(amax) | (amax == 0)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if pow2:
        scale = (scale.view(torch.int32) & _ROUND_POW2_MASK).view(torch.float32)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    return scale, torch.reciprocal(scale)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = x.shape
    if r == rows and c == cols:
        return x
    return torch.nn.functional.pad(x, (0, cols - c, 0, rows - r))


def _tile_rows(x: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool, eps: float):
    """1x128 tiles along each row of x [M, K]: (data [M, K], scale_inv [ceil(K/128), M])."""
    m, k = x.shape
    kt = ceil_div(k, BLOCK)
    xf = _pad_to(x.to(torch.float32), m, kt * BLOCK).view(m, kt, BLOCK)
    fp8_max = float(torch.finfo(fp8_dtype).max)
    amax = xf.abs().amax(dim=-1) if m else xf.new_zeros(m, kt)
    scale, scale_inv = scales_from_amax(amax, fp8_max, pow2, eps, float(torch.finfo(x.dtype).max))
    q = (xf * scale.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(fp8_dtype).view(m, kt * BLOCK)[:, :k]
    return q.contiguous(), _transposed_copy(scale_inv)


def _blocks(x: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool, eps: float):
    """128x128 blocks of x [M, K]: (data [M, K], scale_inv [ceil(M/128), ceil(K/128)])."""
    m, k = x.shape
    mt, kt = ceil_div(m, BLOCK), ceil_div(k, BLOCK)
    xf = _pad_to(x.to(torch.float32), mt * BLOCK, kt * BLOCK).view(mt, BLOCK, kt, BLOCK)
    fp8_max = float(torch.finfo(fp8_dtype).max)
    amax = xf.abs().amax(dim=(1, 3)) if m and k else xf.new_zeros(mt, kt)
    scale, scale_inv = scales_from_amax(amax, fp8_max, pow2, eps, float(torch.finfo(x.dtype).max))
    q = (xf * scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(fp8_dtype).view(mt * BLOCK, kt * BLOCK)[:m, :k]
    return q.contiguous(), scale_inv.contiguous()


def quantize_blockwise_reference(x: torch.Tensor, fp8_dtype: torch.dtype, block_dim: int, *, rowwise: bool = True,
                                 columnwise: bool = False, pow2: bool = True, eps: float = 0.0) -> BlockwiseTensor:
    """Quantize a 2-D x in torch ops (the CPU path and the reference of the kernels)."""
    if block_dim == 2:
        data, scale_inv = _blocks(x, fp8_dtype, pow2, eps)
        data_t = _transposed_copy(data) if columnwise else None
        scale_inv_t = _transposed_copy(scale_inv) if columnwise else None
        if not rowwise:
            data = scale_inv = None
        return BlockwiseTensor(data, scale_inv, data_t, scale_inv_t, 2, fp8_dtype, x.shape)
    data = scale_inv = data_t = scale_inv_t = None
    if rowwise:
        data, scale_inv = _tile_rows(x, fp8_dtype, pow2, eps)
    if columnwise:
        data_t, scale_inv_t = _tile_rows(x.t(), fp8_dtype, pow2, eps)
    return BlockwiseTensor(data, scale_inv, data_t, scale_inv_t, 1, fp8_dtype, x.shape)


def dequantize_blockwise(data: torch.Tensor, scales: torch.Tensor, block_dim: int) -> torch.Tensor:
    """fp32 values of data [R, C] with scales [R, ceil(C/128)] (block_dim 1) or [ceil(R/128), ceil(C/128)]."""
    r, c = data.shape
    f = data.to(torch.float32)
    s = scales.to(torch.float32)
    if block_dim == 1:
        s = s.repeat_interleave(BLOCK, dim=1)[:, :c]
    else:
        s = s.repeat_interleave(BLOCK, dim=0)[:r].repeat_interleave(BLOCK, dim=1)[:, :c]
    return f * s


def quantize_blockwise(x: torch.Tensor, fp8_dtype: torch.dtype, block_dim: int, *, rowwise: bool = True,
                       columnwise: bool = False, pow2: bool = True, eps: float = 0.0) -> BlockwiseTensor:
    """Quantize a 2-D x [M, K] in 1x128 tiles (block_dim 1) or 128x128 blocks (2): the Triton kernels on CUDA
    (both directions in one read of x), the torch reference elsewhere; the same bytes and scales."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blockwise: x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if block_dim not in (1, 2):
        raise ValueError(f"quantize_blockwise: block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}")
    if not (rowwise or columnwise):
        raise ValueError("quantize_blockwise: ask for rowwise, columnwise or both")
    if x.is_cuda:
        from te_parallel.ops import block_cast

        if block_cast.usable(x):
            return block_cast.quantize(x, fp8_dtype, block_dim, rowwise=rowwise, columnwise=columnwise, pow2=pow2,
                                       eps=eps)
    return quantize_blockwise_reference(x, fp8_dtype, block_dim, rowwise=rowwise, columnwise=columnwise, pow2=pow2,
                                        eps=eps)
