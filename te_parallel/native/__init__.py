"""The compiled kernels (te_parallel._C): the only door to them.

Layering (docs/architecture.md): the csrc/ kernels know no torch, and te_parallel._C passes raw device
pointers and the stream as integers. This package is the only importer of te_parallel._C: one module
per kernel family (cast, scaling, gemm, norm, activation, rope, dropout, comm_overlap) turns torch tensors into those
integers after checking everything the kernel relies on (device, dtype, contiguity, shapes), so a wrong
call fails with a one-line message (what was given, what is needed) instead of corrupting memory.

One rule per family: each family module has one cheap predicate, `usable(...)`, and its callers take
the native path exactly when it says so. Without the extension (a build without nvcc) every predicate
is False and te_parallel runs on its PyTorch fallbacks; `load()` warns once per process.

Codes: the values of the C enums reach Python only through the tables the extension exports (DTYPES,
ACTIVATIONS, NORM_TYPES, AMAX_ALGOS, and gatedness through activation_is_gated); `load()` copies them
into the tables below, which stay empty without the extension.
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from types import ModuleType
from typing import Dict, Set, Tuple

import torch

__all__ = ["NativeKernelsAbsentWarning", "load", "available", "require", "launch_on", "describe", "DTYPES",
           "ACTIVATIONS", "GATED_ACTIVATIONS", "NORM_TYPES", "AMAX_ALGOS", "HIGH_PRECISION_DTYPES", "FP8_DTYPES"]

# Filled in place by load() from the extension's tables (empty without it).
DTYPES: Dict[torch.dtype, int] = {}   # tep_dtype code of each torch dtype the kernels take
ACTIVATIONS: Dict[str, int] = {}      # tep_activation code by TE's activation name
GATED_ACTIVATIONS: Set[str] = set()   # the names tep_activation_is_gated calls gated
NORM_TYPES: Dict[str, int] = {}       # tep_norm_type code: "layer_norm", "rms_norm"
AMAX_ALGOS: Dict[str, int] = {}       # tep_amax_algo code: "max", "most_recent"

# torch's names for the two groups of element types the kernels distinguish (no codes here)
HIGH_PRECISION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_module: ModuleType | None = None
_load_attempted = False


class NativeKernelsAbsentWarning(UserWarning):
    """te_parallel._C could not be imported; te_parallel runs on its PyTorch fallbacks."""


def load() -> ModuleType | None:
    """te_parallel._C, imported on first use and cached; None (with one warning) if absent."""
    global _module, _load_attempted
    if not _load_attempted:
        _load_attempted = True
        try:
            module = importlib.import_module("te_parallel._C")
            _fill_tables(module)
        except ImportError as err:
            warnings.warn(_absent_message(err), NativeKernelsAbsentWarning, stacklevel=2)
        else:
            _module = module
            from te_parallel.native import torch_ops  # the ops' fake and CPU kernels, before any trace

            torch_ops.usable()
    return _module


def _fill_tables(module: ModuleType) -> None:
    """Copies the extension's code tables into DTYPES, ACTIVATIONS, ...; ImportError if one is missing
    (an extension built before the tables existed: its codes cannot be trusted, so it is not used)."""
    missing = [name for name in ("DTYPES", "ACTIVATIONS", "NORM_TYPES", "AMAX_ALGOS", "activation_is_gated")
               if not hasattr(module, name)]
    if missing:
        raise ImportError(f"te_parallel._C has no {', '.join(missing)} (built by an older version)")
    DTYPES.update({getattr(torch, name): int(code) for name, code in module.DTYPES.items() if hasattr(torch, name)})
    ACTIVATIONS.update({str(name): int(code) for name, code in module.ACTIVATIONS.items()})
    GATED_ACTIVATIONS.update(name for name, code in ACTIVATIONS.items() if module.activation_is_gated(code) == 1)
    NORM_TYPES.update({str(name): int(code) for name, code in module.NORM_TYPES.items()})
    AMAX_ALGOS.update({str(name): int(code) for name, code in module.AMAX_ALGOS.items()})


def _absent_message(err: ImportError) -> str:
    if isinstance(err, ModuleNotFoundError) and err.name == "te_parallel._C":
        return ("te_parallel: native kernels are absent (package built without nvcc); PyTorch "
                "fallbacks are used. Reinstall with nvcc on PATH to build them.")
    # Built but not loadable (e.g. a build for another Python): say why rather than "absent".
    return (f"te_parallel: native kernels failed to load ({type(err).__name__}: {err}); PyTorch "
            f"fallbacks are used. Rebuild with `pip install --no-build-isolation -e .`.")


def available() -> bool:
    """True if te_parallel._C imports (warns once if it does not)."""
    return load() is not None


def require(fn: str, family: str) -> ModuleType:
    """The extension for a wrapper that is about to call it; RuntimeError naming the predicate to ask
    first if it is absent."""
    module = load()
    if module is None:
        raise RuntimeError(f"{fn}: te_parallel._C is absent; check te_parallel.native.{family}.usable() and "
                           f"use the PyTorch path")
    return module


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def launch_on(device: torch.device) -> Tuple[contextlib.AbstractContextManager, int]:
    """(device guard, current cudaStream_t as int) for a kernel launch on `device`.

    Kernels launch on the thread's current device, so a tensor on another device needs a switch;
    when it is already current (the usual case) the guard is a no-op. Both look-ups go straight to
    torch's C bindings: the public wrappers cost microseconds per call, and a small FP8 GEMM's host
    path makes several launches (benchmarks/bench_host.py).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = _GET_DEVICE() if _GET_DEVICE is not None else torch.cuda.current_device()
    guard = contextlib.nullcontext() if index == current else torch.cuda.device(index)
    stream = _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream
    return guard, stream


def describe(t: object) -> str:
    """What a wrapper was given, for its error message: shape, dtype, layout and device of a tensor."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    layout = "contiguous" if t.is_contiguous() else "non-contiguous"
    return f"{tuple(t.shape)} {t.dtype} {layout} on {t.device}"
