"""Block scaling: `Float8BlockwiseQTensor` and `Float8BlockQuantizer` (1x128 tiles or 128x128 blocks).

The quantization is fp8.blockwise's (Triton kernels on CUDA, its torch reference elsewhere). The scales
are kept in TE's layouts, which are fp8.blockwise's plus zero padding of the last dim to a multiple of 4
(the GEMM's alignment in TE):

| block | rowwise scale_inv | columnwise scale_inv |
|---|---|---|
| 1x128 (dim 1) | [ceil(K/128), M (pad 4)] | [ceil(M/128), K (pad 4)] |
| 128x128 (dim 2) | [ceil(M/128), ceil(K/128) (pad 4)] | [ceil(K/128), ceil(M/128) (pad 4)] |

for a tensor quantized as the matrix [M, K]; the columnwise bytes are stored [K, *shape[:-1]].
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import torch

from te_parallel.fp8.blockwise import BLOCK, BlockwiseTensor, ceil_div, quantize_blockwise
from te_parallel.fp8.quantizers.base import QuantizedTensor, Quantizer, as_bytes, columnwise_shape, matrix_dims
from te_parallel.fp8.quantizers.dtypes import fp8_dtype_of, torch_dtype

__all__ = ["Float8BlockwiseQTensor", "Float8BlockQuantizer", "scale_shape"]


def scale_shape(m: int, k: int, block_dim: int, columnwise: bool, padded: bool = True) -> Tuple[int, int]:
    """The scale_inv shape of the matrix [M, K] (module doc); padded=False: fp8.blockwise's own."""
    if block_dim == 2:
        mt, kt = ceil_div(m, BLOCK), ceil_div(k, BLOCK)
        rows, cols = (kt, mt) if columnwise else (mt, kt)
    else:
        rows, cols = (ceil_div(m, BLOCK), k) if columnwise else (ceil_div(k, BLOCK), m)
    return rows, (4 * ceil_div(cols, 4) if padded else cols)


def _pad(scales: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if scales is None or scales.shape[1] % 4 == 0:
        return scales
    return torch.nn.functional.pad(scales, (0, 4 - scales.shape[1] % 4))


def _unpad(scales: torch.Tensor, cols: int) -> torch.Tensor:
    return scales if scales.shape[1] == cols else scales[:, :cols].contiguous()


class Float8BlockwiseQTensor(QuantizedTensor):
    """FP8 bytes with one scale per 1x128 tile or 128x128 block (TE's Float8BlockwiseQTensor and attributes).

    _rowwise_data (uint8, the tensor's shape) / _rowwise_scale_inv, _columnwise_data ([K, *shape[:-1]]) /
    _columnwise_scale_inv: either direction may be None; scales in the module doc's layouts. _is_2D_scaled:
    128x128 blocks (else 1x128 tiles). _fp8_dtype: a DType. _quantizer: a copy of the one given."""

    _BUFFERS = {"_rowwise_data": "rowwise_data", "_rowwise_scale_inv": "rowwise_scale_inv",
                "_columnwise_data": "columnwise_data", "_columnwise_scale_inv": "columnwise_scale_inv"}
    _STATE = ("_fp8_dtype", "_is_2D_scaled")

    def __new__(cls, shape, dtype, *, rowwise_data: Optional[torch.Tensor], rowwise_scale_inv: Optional[torch.Tensor],
                columnwise_data: Optional[torch.Tensor], columnwise_scale_inv: Optional[torch.Tensor], fp8_dtype,
                quantizer: Optional[Quantizer], is_2D_scaled: bool, requires_grad: bool = False, device=None,
                fake_dtype: Optional[torch.dtype] = None, stride=None):
        code = fp8_dtype_of(fp8_dtype, cls.__name__)
        if (rowwise_data is None) != (rowwise_scale_inv is None) or \
                (columnwise_data is None) != (columnwise_scale_inv is None):
            raise ValueError(f"{cls.__name__}: each direction needs both its data and its scale_inv (or neither)")
        first = rowwise_data if rowwise_data is not None else columnwise_data
        if first is None:
            raise ValueError(f"{cls.__name__}: rowwise_data and columnwise_data are both None; give at least one")
        self = QuantizedTensor._wrapper(cls, shape, dtype, first.device if device is None else device, requires_grad,
                                        fake_dtype)
        self._rowwise_data = as_bytes(rowwise_data, cls.__name__, "rowwise_data")
        self._rowwise_scale_inv = rowwise_scale_inv
        self._columnwise_data = as_bytes(columnwise_data, cls.__name__, "columnwise_data")
        self._columnwise_scale_inv = columnwise_scale_inv
        self._fp8_dtype = code
        self._is_2D_scaled = bool(is_2D_scaled)
        self._quantizer = None if quantizer is None else quantizer.copy()
        return self

    @classmethod
    def _from_operand(cls, op: BlockwiseTensor, shape: torch.Size, dtype: torch.dtype,
                      quantizer: "Float8BlockQuantizer") -> "Float8BlockwiseQTensor":
        return cls(shape, dtype, rowwise_data=None if op.data is None else op.data.reshape(shape),
                   rowwise_scale_inv=_pad(op.scale_inv),
                   columnwise_data=None if op.data_t is None else op.data_t.reshape(columnwise_shape(shape)),
                   columnwise_scale_inv=_pad(op.scale_inv_t), fp8_dtype=quantizer.dtype, quantizer=quantizer,
                   is_2D_scaled=op.block_dim == 2)

    @property
    def block_dim(self) -> int:
        return 2 if self._is_2D_scaled else 1

    def get_metadata(self) -> Dict[str, Any]:
        return {"rowwise_data": self._rowwise_data, "rowwise_scale_inv": self._rowwise_scale_inv,
                "columnwise_data": self._columnwise_data, "columnwise_scale_inv": self._columnwise_scale_inv,
                "fp8_dtype": self._fp8_dtype, "quantizer": self._quantizer, "is_2D_scaled": self._is_2D_scaled}

    def get_usages(self) -> Dict[str, bool]:
        return {"rowwise": self._rowwise_data is not None, "columnwise": self._columnwise_data is not None}

    def get_data_tensors(self, rowwise_data: bool = True, columnwise_data: bool = True):
        if rowwise_data and columnwise_data:
            return self._rowwise_data, self._columnwise_data
        return self._rowwise_data if rowwise_data else self._columnwise_data

    def to_operand(self) -> BlockwiseTensor:
        """te_parallel's GEMM operand of these bytes and scales (fp8.blockwise's layouts: the padding dropped)."""
        fp8 = torch_dtype(self._fp8_dtype)
        m, k = matrix_dims(self.shape)
        data = scale_inv = data_t = scale_inv_t = None
        if self._rowwise_data is not None:
            data = self._rowwise_data.view(fp8).reshape(m, k)
            scale_inv = _unpad(self._rowwise_scale_inv, scale_shape(m, k, self.block_dim, False, padded=False)[1])
        if self._columnwise_data is not None:
            data_t = self._columnwise_data.view(fp8).reshape(k, m)
            scale_inv_t = _unpad(self._columnwise_scale_inv, scale_shape(m, k, self.block_dim, True, padded=False)[1])
        return BlockwiseTensor(data, scale_inv, data_t, scale_inv_t, self.block_dim, fp8, torch.Size((m, k)))

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Drop a direction, or make one from the other: only 128x128 blocks can (their transpose is exact);
        1x128 tiles run along one dim and must be quantized again from the high-precision values."""
        missing = [name for name, want, have in (("rowwise", rowwise_usage, self._rowwise_data),
                                                 ("columnwise", columnwise_usage, self._columnwise_data))
                   if want and have is None]
        if missing and not self._is_2D_scaled:
            raise RuntimeError(f"Float8BlockwiseQTensor: the {missing[0]} direction of 1x128 tiles cannot be made from "
                               f"the other; quantize again with set_usage({missing[0]}=True)")
        if missing:
            m, k = matrix_dims(self.shape)
            if missing[0] == "columnwise":
                self._columnwise_data = self._rowwise_data.reshape(m, k).t().contiguous().reshape(
                    columnwise_shape(self.shape))
                self._columnwise_scale_inv = _pad(_unpad(self._rowwise_scale_inv, ceil_div(k, BLOCK)).t().contiguous())
            else:
                self._rowwise_data = self._columnwise_data.reshape(k, m).t().contiguous().reshape(self.shape)
                self._rowwise_scale_inv = _pad(_unpad(self._columnwise_scale_inv, ceil_div(m, BLOCK)).t().contiguous())
        if rowwise_usage is False and self._columnwise_data is not None:
            self._rowwise_data = self._rowwise_scale_inv = None
        if columnwise_usage is False and self._rowwise_data is not None:
            self._columnwise_data = self._columnwise_scale_inv = None

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.to_operand().dequantize(torch.float32).reshape(self.shape).to(dtype)

    def _view(self, shape: Sequence[int]) -> Optional["Float8BlockwiseQTensor"]:
        # the scales cover the matrix [prod(shape[:-1]), shape[-1]]: any shape with the same last dim keeps it
        if not len(shape) or not self.dim() or shape[-1] != self.shape[-1]:
            return None
        meta = self.get_metadata()
        if self._rowwise_data is not None:
            meta["rowwise_data"] = self._rowwise_data.view(shape)
        if self._columnwise_data is not None:
            meta["columnwise_data"] = self._columnwise_data.view(columnwise_shape(shape))
        return Float8BlockwiseQTensor(shape, self.dtype, **meta)

    def _default_quantizer(self) -> Quantizer:
        return Float8BlockQuantizer(self._fp8_dtype, rowwise=self._rowwise_data is not None,
                                    columnwise=self._columnwise_data is not None, block_scaling_dim=self.block_dim)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"Float8BlockwiseQTensor(fp8_dtype={self._fp8_dtype.name}, is_2D_scaled={self._is_2D_scaled}, "
                f"dtype={self.dtype}, data={self._dequantize(self.dtype)})")


class Float8BlockQuantizer(Quantizer):
    """Block scaling (TE's Float8BlockQuantizer): one scale per 1x128 tile (block_scaling_dim=1) or 128x128
    block (2), each from its own amax: amax_epsilon floors it, force_pow_2_scales rounds the scale down to a
    power of two. The columnwise direction of 1x128 tiles is quantized from the high-precision values in
    the same call (tiles along M); of 128x128 blocks it is the exact transpose."""

    def __init__(self, fp8_dtype, *, rowwise: bool, columnwise: bool, amax_epsilon: float = 0.0,
                 force_pow_2_scales: bool = True, block_scaling_dim: int = 2) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"Float8BlockQuantizer: block_scaling_dim must be 1 (1x128 tiles) or 2 (128x128 "
                             f"blocks), got {block_scaling_dim!r}")
        if not (isinstance(amax_epsilon, (int, float)) and math.isfinite(amax_epsilon) and amax_epsilon >= 0):
            raise ValueError(f"Float8BlockQuantizer: amax_epsilon must be a finite number >= 0, got {amax_epsilon!r}")
        self.dtype = fp8_dtype_of(fp8_dtype, "Float8BlockQuantizer")
        self.block_len = BLOCK
        self.amax_epsilon = float(amax_epsilon)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.block_scaling_dim = block_scaling_dim

    @classmethod
    def _tensor_type(cls) -> type:
        return Float8BlockwiseQTensor

    def _check_input(self, tensor: torch.Tensor) -> None:
        super()._check_input(tensor)
        if tensor.dim() < 2:
            raise ValueError(f"Float8BlockQuantizer: block scaling quantizes a matrix; got a {tensor.dim()}-D tensor "
                             f"of shape {tuple(tensor.shape)} (give it at least 2 dims)")

    def _quantize(self, x: torch.Tensor) -> Float8BlockwiseQTensor:
        m, k = matrix_dims(x.shape)
        op = quantize_blockwise(x.reshape(m, k), torch_dtype(self.dtype), self.block_scaling_dim,
                                rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                                pow2=self.force_pow_2_scales, eps=self.amax_epsilon)
        return Float8BlockwiseQTensor._from_operand(op, x.shape, x.dtype, self)

    def _empty(self, shape, dtype, device) -> Float8BlockwiseQTensor:
        m, k = matrix_dims(shape)
        kw = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None)
        if self.rowwise_usage:
            kw["rowwise_data"] = torch.empty(shape, dtype=torch.uint8, device=device)
            kw["rowwise_scale_inv"] = torch.empty(self.get_scale_shape(shape, False), device=device)
        if self.columnwise_usage:
            kw["columnwise_data"] = torch.empty(columnwise_shape(shape), dtype=torch.uint8, device=device)
            kw["columnwise_scale_inv"] = torch.empty(self.get_scale_shape(shape, True), device=device)
        return Float8BlockwiseQTensor(shape, dtype, fp8_dtype=self.dtype, quantizer=self,
                                      is_2D_scaled=self.block_scaling_dim == 2, device=device, **kw)

    def get_scale_shape(self, shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
        """TE's: the scale_inv shape of a tensor of `shape` in one direction (module doc)."""
        m, k = matrix_dims(tuple(shape))
        return scale_shape(m, k, self.block_scaling_dim, columnwise)

    def get_columnwise_shape(self, shape: Iterable[int]) -> Tuple[int, ...]:
        return columnwise_shape(tuple(shape))

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whole tiles only (both matrix dims multiples of 128): then the pieces' scales are the whole's."""
        m, k = matrix_dims(inp.shape)
        return inp.dim() >= 2 and m % BLOCK == 0 and k % BLOCK == 0
