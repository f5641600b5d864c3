"""One scale per tensor: `Float8Tensor` and its quantizers (delayed scaling, current scaling).

value = fp8(data) * scale_inv, data = fp8(clamp(x * scale, ±fp8_max)) (ops.cast.quantize). The columnwise
bytes are the transpose of the rowwise ones: one scale serves both directions.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from te_parallel.fp8.blockwise import scales_from_amax
from te_parallel.fp8.quantizers.base import QuantizedTensor, Quantizer, as_bytes, columnwise_shape, matrix_dims
from te_parallel.fp8.quantizers.dtypes import DType, fp8_dtype_of, torch_dtype
from te_parallel.fp8.tensor import Float8Tensor as Float8Operand
from te_parallel.ops import cast
from te_parallel.recipe import fp8_max

__all__ = ["Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer"]


class Float8Tensor(QuantizedTensor):
    """FP8 bytes with one scale (TE's Float8Tensor and its attributes).

    _data: the rowwise bytes (uint8, the tensor's shape) or None; _transpose: the columnwise bytes
    [K, *shape[:-1]] or None (_transpose_invalid says it holds nothing usable); _scale_inv: fp32 [1], the
    value of one FP8 unit; _fp8_dtype: a DType; _quantizer: what writes new values (a copy of the one given).
    """

    _BUFFERS = {"_data": "data", "_scale_inv": "fp8_scale_inv", "_transpose": "data_transpose"}
    _STATE = ("_fp8_dtype", "_transpose_invalid")

    def __new__(cls, shape, dtype, *, data: Optional[torch.Tensor], fp8_scale_inv: torch.Tensor,
                fp8_dtype=DType.kFloat8E4M3, data_transpose: Optional[torch.Tensor] = None,
                quantizer: Optional[Quantizer] = None, requires_grad: bool = False, device=None,
                fake_dtype: Optional[torch.dtype] = None, stride=None):
        code = fp8_dtype_of(fp8_dtype, cls.__name__)
        first = data if data is not None else data_transpose
        if first is None:
            raise ValueError(f"{cls.__name__}: data and data_transpose are both None; give the FP8 bytes in at "
                             f"least one of them")
        if not isinstance(fp8_scale_inv, torch.Tensor) or fp8_scale_inv.numel() != 1:
            raise ValueError(f"{cls.__name__}: fp8_scale_inv must be a one-element fp32 tensor, got {fp8_scale_inv!r}")
        self = QuantizedTensor._wrapper(cls, shape, dtype, first.device if device is None else device, requires_grad,
                                        fake_dtype)
        self._data = as_bytes(data, cls.__name__, "data")
        self._transpose = as_bytes(data_transpose, cls.__name__, "data_transpose")
        self._transpose_invalid = data_transpose is None
        self._scale_inv = fp8_scale_inv
        self._fp8_dtype = code
        self._quantizer = None if quantizer is None else quantizer.copy()
        return self

    @classmethod
    def _from_operand(cls, op: Float8Operand, shape: torch.Size, dtype: torch.dtype, quantizer: Quantizer,
                      rowwise: bool, columnwise: bool) -> "Float8Tensor":
        data = op.data.reshape(shape) if rowwise else None
        data_t = op.data_t.reshape(columnwise_shape(shape)) if columnwise else None
        return cls(shape, dtype, data=data, fp8_scale_inv=op.scale_inv.reshape(1), fp8_dtype=quantizer.dtype,
                   data_transpose=data_t, quantizer=quantizer)

    def get_metadata(self) -> Dict[str, Any]:
        return {"data": self._data, "fp8_scale_inv": self._scale_inv, "fp8_dtype": self._fp8_dtype,
                "data_transpose": None if self._transpose_invalid else self._transpose, "quantizer": self._quantizer}

    def _columnwise(self) -> Optional[torch.Tensor]:
        return None if self._transpose_invalid else self._transpose

    def get_usages(self) -> Dict[str, bool]:
        return {"rowwise": self._data is not None, "columnwise": self._columnwise() is not None}

    def get_data_tensors(self, rowwise_data: bool = True, columnwise_data: bool = True):
        if rowwise_data and columnwise_data:
            return self._data, self._transpose
        return self._data if rowwise_data else self._transpose

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Make the columnwise bytes (the transpose) or drop a direction; the last direction is never dropped."""
        if columnwise_usage and self._columnwise() is None:
            self._transpose = self.to_operand().transposed().view(torch.uint8).reshape(columnwise_shape(self.shape))
            self._transpose_invalid = False
        if rowwise_usage and self._data is None:
            m, k = matrix_dims(self.shape)
            self._data = self._transpose.reshape(k, m).t().contiguous().reshape(self.shape)
        if rowwise_usage is False and self._columnwise() is not None:
            self._data = None
        if columnwise_usage is False and self._data is not None:
            self._transpose, self._transpose_invalid = None, True

    def to_operand(self) -> Float8Operand:
        """te_parallel's GEMM operand of these bytes: data [M, K] (FP8 dtype), scale_inv (0-d), data_t [K, M]."""
        fp8 = torch_dtype(self._fp8_dtype)
        m, k = matrix_dims(self.shape)
        data_t = None if self._columnwise() is None else self._transpose.view(fp8).reshape(k, m)
        data = data_t.t() if self._data is None else self._data.view(fp8).reshape(m, k)
        return Float8Operand(data=data, scale_inv=self._scale_inv.reshape(()).to(torch.float32), data_t=data_t)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        fp8 = torch_dtype(self._fp8_dtype)
        scale_inv = self._scale_inv.to(device=self.device, dtype=torch.float32).reshape(())
        if self._data is not None:
            return (self._data.view(fp8).to(torch.float32) * scale_inv).reshape(self.shape).to(dtype)
        values = self._transpose.view(fp8).to(torch.float32) * scale_inv  # [K, *leading]
        values = values.movedim(0, -1) if values.dim() > 1 else values
        return values.reshape(self.shape).to(dtype)

    def _view(self, shape: Sequence[int]) -> Optional["Float8Tensor"]:
        data = None if self._data is None else self._data.view(shape)
        data_t = None
        if self._columnwise() is not None and len(shape) and self.dim() and shape[-1] == self.shape[-1]:
            data_t = self._transpose.view(columnwise_shape(shape))
        if data is None and data_t is None:
            return None
        return Float8Tensor(shape, self.dtype, data=data, fp8_scale_inv=self._scale_inv, fp8_dtype=self._fp8_dtype,
                            data_transpose=data_t, quantizer=self._quantizer)

    def _default_quantizer(self) -> Quantizer:
        """Writes with this tensor's own scale (a tensor made without a quantizer)."""
        scale = torch.reciprocal(self._scale_inv.to(device=self.device, dtype=torch.float32).reshape(1))
        return Float8Quantizer(scale, torch.zeros(1, device=self.device), self._fp8_dtype,
                               rowwise=self._data is not None, columnwise=self._columnwise() is not None)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"Float8Tensor(fp8_dtype={self._fp8_dtype.name}, scale_inv={self._scale_inv.reshape(-1)[0].item()}, "
                f"dtype={self.dtype}, data={self._dequantize(self.dtype)})")


def _empty_float8(quantizer: Quantizer, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                  scale_inv: torch.Tensor) -> Float8Tensor:
    data = torch.empty(shape, dtype=torch.uint8, device=device) if quantizer.rowwise_usage else None
    data_t = (torch.empty(columnwise_shape(shape), dtype=torch.uint8, device=device)
              if quantizer.columnwise_usage else None)
    return Float8Tensor(shape, dtype, data=data, fp8_scale_inv=scale_inv, fp8_dtype=quantizer.dtype,
                        data_transpose=data_t, quantizer=quantizer, device=device)


def _quantize_with(quantizer: Quantizer, x: torch.Tensor, scale: torch.Tensor,
                   amax_out: Optional[torch.Tensor]) -> Float8Tensor:
    """x quantized with `scale` in the quantizer's usages (ops.cast.quantize on x as a matrix)."""
    m, k = matrix_dims(x.shape)
    op = cast.quantize(x.reshape(m, k), scale, torch_dtype(quantizer.dtype), amax_out=amax_out,
                       transpose=quantizer.columnwise_usage, rowwise=quantizer.rowwise_usage)
    return Float8Tensor._from_operand(op, x.shape, x.dtype, quantizer, quantizer.rowwise_usage,
                                      quantizer.columnwise_usage)


def _one_element(t, owner: str, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype is not torch.float32:
        raise ValueError(f"{owner}: {name} must be a one-element fp32 tensor, got {t!r}")
    return t


class Float8Quantizer(Quantizer):
    """Delayed scaling (TE's Float8Quantizer): quantizes with `scale` as given and records each quantized
    tensor's amax into `amax` as max(amax, amax(x)), on the device. Both are the caller's state (an amax
    history slot is zeroed when its pass starts; the scale is updated from the history after a pass)."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype, *, rowwise: bool = True,
                 columnwise: bool = True) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.scale = _one_element(scale, "Float8Quantizer", "scale")
        self.amax = _one_element(amax, "Float8Quantizer", "amax")
        self.dtype = fp8_dtype_of(fp8_dtype, "Float8Quantizer")

    @classmethod
    def _tensor_type(cls) -> type:
        return Float8Tensor

    def _quantize(self, x: torch.Tensor) -> Float8Tensor:
        if x.numel() == 0:
            return self._empty(x.shape, x.dtype, x.device)
        return _quantize_with(self, x, self.scale, self.amax)

    def _empty(self, shape, dtype, device) -> Float8Tensor:
        scale_inv = torch.reciprocal(self.scale.detach().to(device=device, dtype=torch.float32).reshape(1))
        return _empty_float8(self, shape, dtype, device, scale_inv)

    def calibrate(self, tensor: torch.Tensor) -> None:
        """amax = amax(tensor) (overwritten, as TE's calibration does), no quantization."""
        self.amax.copy_(cast.amax_of(tensor).reshape(self.amax.shape))


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling (TE's Float8CurrentScalingQuantizer): the scale of each tensor from its own amax, by
    TE's formula (package doc): amax_epsilon floors the amax, force_pow_2_scales rounds the scale down to a
    power of two. with_amax_reduction: the amax is all-reduced (MAX) over `amax_reduction_group` first, so
    that every rank quantizes its piece with the same scale. `device` is accepted for TE's signature."""

    def __init__(self, fp8_dtype, device=None, *, rowwise: bool = True, columnwise: bool = True,
                 with_amax_reduction: bool = False, amax_reduction_group=None, force_pow_2_scales: bool = False,
                 amax_epsilon: float = 0.0) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        if not (isinstance(amax_epsilon, (int, float)) and math.isfinite(amax_epsilon) and amax_epsilon >= 0):
            raise ValueError(f"Float8CurrentScalingQuantizer: amax_epsilon must be a finite number >= 0, got "
                             f"{amax_epsilon!r}")
        self.dtype = fp8_dtype_of(fp8_dtype, "Float8CurrentScalingQuantizer")
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["amax_reduction_group"] = None  # a process group does not pickle
        return state

    @classmethod
    def _tensor_type(cls) -> type:
        return Float8Tensor

    def scale_of(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 [1] scale this quantizer gives x (after the amax reduction, when asked for)."""
        amax = cast.amax_of(x).reshape(1)
        if self.with_amax_reduction:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.amax_reduction_group)
        largest = min(torch.finfo(x.dtype).max, torch.finfo(torch.float32).max)
        scale, _ = scales_from_amax(amax, fp8_max(torch_dtype(self.dtype)), self.force_pow_2_scales,
                                    self.amax_epsilon, largest)
        return scale

    def _quantize(self, x: torch.Tensor) -> Float8Tensor:
        if x.numel() == 0:
            return self._empty(x.shape, x.dtype, x.device)
        out = _quantize_with(self, x, self.scale_of(x), None)
        # the tensor's own quantizer never reduces: an in-place write on one rank must not start a collective
        out._quantizer.with_amax_reduction, out._quantizer.amax_reduction_group = False, None
        return out

    def _empty(self, shape, dtype, device) -> Float8Tensor:
        return _empty_float8(self, shape, dtype, device, torch.ones(1, dtype=torch.float32, device=device))
