"""The bases: TE's dtype codes, `Quantizer`, and `QuantizedTensor`, a wrapper tensor that computes on its value."""
from __future__ import annotations

import abc
import copy
import math
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten


class Quantizer(abc.ABC):
    """Makes quantized tensors of one format from high-precision ones (TE 2.x's base class).

    rowwise_usage / columnwise_usage: the directions a quantization writes (package doc). `internal` and
    `optimize_for_gemm` are TE's requests for lighter storage objects; te_parallel always returns the
    tensor (they are kept, and change nothing)."""

    def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        self.internal = False
        self.optimize_for_gemm = False

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rowwise_usage={self.rowwise_usage}, columnwise_usage={self.columnwise_usage}, "
                f"internal={self.internal})")

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Which directions the next quantizations write; None keeps the current choice."""
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def get_usages(self) -> Dict[str, bool]:
        return {"rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage}

    def copy(self) -> "Quantizer":
        """A shallow copy: the same scale / amax tensors (delayed scaling), its own usage flags."""
        return copy.copy(self)

    def quantize(self, tensor: torch.Tensor, *, out: Optional["QuantizedTensor"] = None,
                 dtype: Optional[torch.dtype] = None) -> "QuantizedTensor":
        """The quantized tensor of `tensor` (or written into `out`). Under autograd the gradient passes
        straight through: the gradient of the quantized value is the gradient of the input."""
        if out is not None:
            return self.update_quantized(tensor, out)
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        self._check_input(tensor)
        if torch.is_grad_enabled() and tensor.requires_grad:
            return _Quantize.apply(tensor, self)
        return self._quantize(tensor.detach())

    def __call__(self, tensor: torch.Tensor) -> "QuantizedTensor":
        return self.quantize(tensor)

    def update_quantized(self, src: torch.Tensor, dst: "QuantizedTensor", *,
                         noop_flag: Optional[torch.Tensor] = None) -> "QuantizedTensor":
        """Quantize `src` into `dst` in place: dst's buffers are overwritten where their shapes allow, so
        whatever holds dst (a parameter, an alias made by detach) sees the new value. noop_flag: a
        one-element tensor; nonzero skips the update (it is read on the host)."""
        if not isinstance(dst, self._tensor_type()):
            raise TypeError(f"{type(self).__name__}.update_quantized: dst must be a {self._tensor_type().__name__}, "
                            f"got {type(dst).__name__}")
        if noop_flag is not None and bool(noop_flag.reshape(-1)[0]):
            return dst
        if isinstance(src, QuantizedTensor):
            src = src.dequantize()
        if src.numel() != dst.numel():
            raise ValueError(f"{type(self).__name__}.update_quantized: src has shape {tuple(src.shape)}, dst "
                             f"{tuple(dst.shape)}; they must have the same number of elements")
        src = src.detach().to(device=dst.device).reshape(dst.shape)
        self._check_input(src)
        dst._assign(self._quantize(src))
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False, pin_memory: bool = False) -> "QuantizedTensor":
        """A quantized tensor of nominal `shape` and `dtype` with unwritten bytes (the usages of this quantizer).
        device: default the current CUDA device, or the CPU without CUDA."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        out = self._empty(torch.Size(shape), dtype, torch.device(device))
        if pin_memory:
            out = out._rebuild(torch.Tensor.pin_memory)
        return out.requires_grad_(requires_grad) if requires_grad else out

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Update what the quantizer keeps as if `tensor` were quantized, without quantizing (delayed scaling
        records the amax; the others keep nothing)."""

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """TE's question: can `inp` be quantized before an all-gather (the gathered tensor's scales are the
        pieces' scales)? Always for one scale per tensor."""
        return True

    def _check_input(self, tensor: torch.Tensor) -> None:
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: rowwise and columnwise usage are both False, so nothing would "
                             f"be written; call set_usage(rowwise=True) or set_usage(columnwise=True)")
        if not tensor.is_floating_point():
            raise TypeError(f"{type(self).__name__}: quantizes floating-point tensors, got {tensor.dtype}")

    @abc.abstractmethod
    def _quantize(self, tensor: torch.Tensor) -> "QuantizedTensor":
        """The quantized tensor of a detached floating-point tensor (usages checked)."""

    @abc.abstractmethod
    def _empty(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> "QuantizedTensor":
        """A quantized tensor with allocated, unwritten buffers."""

    @classmethod
    @abc.abstractmethod
    def _tensor_type(cls) -> type:
        """The QuantizedTensor class this quantizer makes."""


class _Quantize(torch.autograd.Function):
    """Quantize with a straight-through gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantizer: Quantizer) -> "QuantizedTensor":
        return quantizer._quantize(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Dequantize(torch.autograd.Function):
    """The value of a quantized tensor; its gradient is the incoming gradient."""

    @staticmethod
    def forward(ctx, t: "QuantizedTensor", dtype: torch.dtype) -> torch.Tensor:
        return t._dequantize(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _QuantizedTensorMeta(type(torch.Tensor), abc.ABCMeta):
    """torch's tensor metaclass with ABC registration: a tensor type defined elsewhere can be registered as a
    virtual subclass (how TE's clients see te_parallel's FP8 weight parameter as a Float8Tensor)."""


class QuantizedTensor(torch.Tensor, metaclass=_QuantizedTensorMeta):
    """A tensor of quantized data that presents its high-precision (nominal) dtype and shape.

    Ops handled here: detach and clone (same format), view / reshape that keep the last dim (same bytes),
    `.to` / `.cpu` / `.cuda` to another device (buffers moved), copy_ into it (quantizes the source), in-place
    ops (computed on the value, then quantized back with the tensor's quantizer). Every other torch op runs
    on the dequantized value and returns a plain tensor; `.to(dtype)`, `.float()`, `.bfloat16()` and
    `.half()` dequantize. Subclasses name their buffers in `_BUFFERS` (attribute -> constructor keyword)."""

    _BUFFERS: Dict[str, str] = {}
    _STATE: Tuple[str, ...] = ()

    def __new__(cls, shape: Iterable[int], dtype: torch.dtype, *, requires_grad: bool = False, device=None,
                stride=None, fake_dtype: Optional[torch.dtype] = None):
        """TE's base constructor: a tensor of that shape and dtype holding no data (formats define their own).
        device: default the current CUDA device, or the CPU without CUDA."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return QuantizedTensor._wrapper(cls, shape, dtype, device, requires_grad, fake_dtype)

    @staticmethod
    def _wrapper(cls, shape: Iterable[int], dtype: torch.dtype, device, requires_grad: bool,
                 fake_dtype: Optional[torch.dtype]) -> "QuantizedTensor":
        if fake_dtype is not None and fake_dtype != dtype:
            raise ValueError(f"{cls.__name__}: fake_dtype {fake_dtype} differs from dtype {dtype}")
        if not dtype.is_floating_point:
            raise TypeError(f"{cls.__name__}: the nominal dtype must be a floating-point dtype, got {dtype}")
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    __torch_function__ = torch._C._disabled_torch_function_impl

    # --- what a format provides -----------------------------------------------------------------------
    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} holds no quantized data to compute on (a format such as "
                                  f"Float8Tensor defines its values)")

    def get_metadata(self) -> Dict[str, Any]:
        """The constructor's keywords (other than shape, dtype, requires_grad, device) for the same data."""
        raise NotImplementedError(f"{type(self).__name__} does not define get_metadata")

    def _view(self, shape: Sequence[int]) -> Optional["QuantizedTensor"]:
        """The same bytes under another shape of the same numel, or None where the format cannot."""
        return None

    def _default_quantizer(self) -> Quantizer:
        raise ValueError(f"{type(self).__name__} has no quantizer to write new values with")

    # --- common -------------------------------------------------------------------------------------------
    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The value as a plain tensor of `dtype` (default: the nominal dtype), differentiable."""
        dtype = self.dtype if dtype is None else dtype
        if torch.is_grad_enabled() and self.requires_grad:
            return _Dequantize.apply(self, dtype)
        return self._dequantize(dtype)

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None) -> "QuantizedTensor":
        """Write the quantization of `tensor` into this tensor (its quantizer, or one of its own scale)."""
        self._get_quantizer().update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    def _get_quantizer(self) -> Quantizer:
        return self._quantizer if self._quantizer is not None else self._default_quantizer()

    def update_quantizer(self, quantizer: Quantizer) -> None:
        self._quantizer = quantizer

    @classmethod
    def make_like(cls, tensor: "QuantizedTensor", *, shape: Optional[Iterable[int]] = None,
                  dtype: Optional[torch.dtype] = None, requires_grad: bool = False) -> "QuantizedTensor":
        """A tensor on the same buffers (TE's name; a view where `shape` differs)."""
        return cls(tensor.shape if shape is None else shape, tensor.dtype if dtype is None else dtype,
                   requires_grad=requires_grad, device=tensor.device, **tensor.get_metadata())

    def _rebuild(self, fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 requires_grad: bool = False) -> "QuantizedTensor":
        """The same format and shape with each buffer mapped by fn (None: the same buffers)."""
        meta = self.get_metadata()
        if fn is not None:
            for key in self._BUFFERS.values():
                if meta[key] is not None:
                    meta[key] = fn(meta[key])
        device = next((meta[k].device for k in self._BUFFERS.values() if meta[k] is not None), self.device)
        return type(self)(self.shape, self.dtype, requires_grad=requires_grad, device=device, **meta)

    def _assign(self, other: "QuantizedTensor") -> None:
        """Take other's values: into this tensor's buffers where shapes and dtypes match, else by reference."""
        for attr in self._BUFFERS:
            old, new = getattr(self, attr), getattr(other, attr)
            if old is not None and new is not None and old.shape == new.shape and old.dtype == new.dtype \
                    and old.device == new.device:
                old.copy_(new)
            else:
                setattr(self, attr, new)
        for attr in self._STATE:
            setattr(self, attr, getattr(other, attr))

    def float(self) -> torch.Tensor:
        return self.dequantize(torch.float32)

    def bfloat16(self) -> torch.Tensor:
        return self.dequantize(torch.bfloat16)

    def half(self) -> torch.Tensor:
        return self.dequantize(torch.float16)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"value={self._dequantize(self.dtype)})")

    def __reduce_ex__(self, protocol):
        # rebuilt from its constructor's keywords: the buffers are pickled as tensors
        return rebuild, (type(self), tuple(self.shape), self.dtype, self.get_metadata())

    @property
    def data(self) -> "QuantizedTensor":
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """x.data = y: a quantized y of this class is taken as it is; a plain y is quantized with this
        tensor's quantizer (its usages) and takes its shape and dtype."""
        if not isinstance(value, QuantizedTensor):
            quantizer = self._get_quantizer().copy()
            quantizer.set_usage(**self.get_usages())
            value = quantizer.quantize(value.detach())
        if type(value) is not type(self):
            raise TypeError(f"{type(self).__name__}.data: cannot take a {type(value).__name__}")
        torch._C.TensorBase.data.__set__(self, value)
        for attr in (*self._BUFFERS, *self._STATE, "_quantizer"):
            setattr(self, attr, getattr(value, attr))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(args, kwargs)
            if out is not NotImplemented:
                return out
        if func._schema.is_mutable:
            return _in_place(func, args, kwargs)
        return func(*dequantized(args), **dequantized(kwargs))


def rebuild(cls, shape, dtype, meta):
    return cls(shape, dtype, **meta)


def dequantized(tree):
    """tree with every QuantizedTensor replaced by its value (nominal dtype)."""
    return tree_map(lambda a: a._dequantize(a.dtype) if isinstance(a, QuantizedTensor) else a, tree)


# --- the ops handled without dequantizing -------------------------------------------------------------------
def _detach(args, kwargs):
    return args[0]._rebuild()


def _clone(args, kwargs):
    return args[0]._rebuild(torch.clone)


def _to_copy(args, kwargs):
    t = args[0]
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if dtype is not None and dtype != t.dtype:
        return t._dequantize(dtype).to(device=t.device if device is None else device)
    non_blocking = bool(kwargs.get("non_blocking", False))
    target = t.device if device is None else device
    return t._rebuild(lambda b: b.to(device=target, non_blocking=non_blocking, copy=True))


def _view(args, kwargs):
    t, size = args[0], list(args[1])
    if -1 in size:
        known = math.prod(d for d in size if d != -1)
        size[size.index(-1)] = t.numel() // known if known else 0
    if math.prod(size) != t.numel():
        return NotImplemented  # torch's own error, from the value
    out = t._view(size)
    return NotImplemented if out is None else out


def _copy(args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, QuantizedTensor):
        if isinstance(src, QuantizedTensor):
            src = src._dequantize(src.dtype)
        dst.quantize_(src.expand(dst.shape))
        return dst
    value = src._dequantize(dst.dtype if dst.is_floating_point() else torch.float32)
    return dst.copy_(value, *args[2:], **kwargs)


def _in_place(func, args, kwargs):
    """An op that writes into its arguments: computed on the values, the written quantized tensors requantized."""
    values, kw_values = dequantized(args), dequantized(kwargs)
    out = func(*values, **kw_values)
    schema = func._schema.arguments
    written = [(a, v) for a, v, s in zip(args, values, schema) if isinstance(a, QuantizedTensor)
               and s.alias_info is not None and s.alias_info.is_write]
    written += [(kwargs[s.name], kw_values[s.name]) for s in schema[len(args):]
                if s.name in kwargs and isinstance(kwargs[s.name], QuantizedTensor)
                and s.alias_info is not None and s.alias_info.is_write]
    for arg, value in written:
        arg.quantize_(value)
        if out is value:
            out = arg
    return out


_HANDLERS = {
    aten.detach.default: _detach,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.copy_.default: _copy,
}


def matrix_dims(shape: Sequence[int]) -> Tuple[int, int]:
    """(M, K): the matrix a tensor of `shape` is quantized as ([1, 1] for a scalar, [1, n] for a vector)."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def columnwise_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    """The stored shape of the columnwise bytes: [K, *shape[:-1]] (TE's)."""
    return tuple(shape) if len(shape) == 0 else (shape[-1], *shape[:-1])


def as_bytes(t: Optional[torch.Tensor], owner: str, name: str) -> Optional[torch.Tensor]:
    """FP8 bytes as uint8 (TE's storage dtype); FP8-typed tensors are viewed."""
    if t is None or t.dtype is torch.uint8:
        return t
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    raise TypeError(f"{owner}: {name} must hold FP8 bytes (uint8 or an FP8 dtype), got {t.dtype}")


__all__ = ["Quantizer", "QuantizedTensor", "matrix_dims", "columnwise_shape", "as_bytes", "dequantized", "rebuild"]
