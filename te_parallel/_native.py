"""The compiled kernels (te_parallel._C): lazy loading, and the checked Python wrappers around them.

Layering (STYLE.md rule 9): csrc/ kernels know no torch; te_parallel._C passes raw device pointers
and the stream as integers; this module turns torch tensors into those, after checking everything
the kernel relies on (device, dtype, contiguity, shapes), so a wrong call fails here with a clear
one-line message instead of corrupting memory. Each op here has a pure-PyTorch reference (for the
scale update: te_parallel.fp8.scaling.update_delayed_scaling_torch) that it matches bit for bit.

The package works without the extension (built without nvcc): callers ask `available()` and use
their PyTorch fallback; `load()` warns once per process that the kernels are absent.
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from types import ModuleType
from typing import NoReturn, Sequence, Tuple

import torch

__all__ = ["NativeKernelsAbsentWarning", "load", "available", "fused_delayed_scaling_update", "cast_transpose_amax",
           "transpose_fp8", "fp8_gemm", "gemm_tune", "gemm_choose", "gemm_usable", "gemm_workspace"]

_ALGOS = {"max": 0, "most_recent": 1}

_module: ModuleType | None = None
_load_attempted = False


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def launch_on(device: torch.device) -> Tuple[contextlib.AbstractContextManager, int]:
    """(device guard, current cudaStream_t as int) for a kernel launch on `device`.

    Kernels launch on the thread's current device, so a tensor on another device needs a switch;
    when it is already current (the usual case) the guard is a no-op. Both look-ups go straight to
    torch's C bindings: the public wrappers cost microseconds per call, and a small FP8 GEMM's host
    path makes several launches (bench_host.py).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = _GET_DEVICE() if _GET_DEVICE is not None else torch.cuda.current_device()
    guard = contextlib.nullcontext() if index == current else torch.cuda.device(index)
    stream = _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream
    return guard, stream


class NativeKernelsAbsentWarning(UserWarning):
    """te_parallel._C could not be imported; te_parallel runs on its PyTorch fallbacks."""


def load() -> ModuleType | None:
    """te_parallel._C, imported on first use and cached; None (with one warning) if absent."""
    global _module, _load_attempted
    if not _load_attempted:
        _load_attempted = True
        try:
            _module = importlib.import_module("te_parallel._C")
        except ImportError as err:
            warnings.warn(_absent_message(err), NativeKernelsAbsentWarning, stacklevel=2)
    return _module


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


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    layout = "contiguous" if t.is_contiguous() else "non-contiguous"
    return f"{tuple(t.shape)} {t.dtype} {layout} on {t.device}"


def _state_tuple(state: Sequence[object], device_index: int) -> Tuple[int, ...] | None:
    """(hist_ptr, scale_ptr, scale_inv_ptr, L, n) if `state` is what the kernel needs, else None.

    This runs for every state at every step, so it is one cheap chain of tensor queries (about 3 us
    per state; isinstance and torch.device objects cost more); _raise_state_error says what is wrong.
    get_device() is -1 on CPU, so comparing it with a CUDA index also checks is_cuda.
    """
    try:
        hist, scale, scale_inv = state
        f32 = torch.float32
        ok = (hist.dim() == 2 and scale.dim() == 1 and scale_inv.dim() == 1
              and hist.dtype is f32 and scale.dtype is f32 and scale_inv.dtype is f32
              and hist.get_device() == device_index and scale.get_device() == device_index
              and scale_inv.get_device() == device_index
              and hist.is_contiguous() and scale.is_contiguous() and scale_inv.is_contiguous())
        if ok:
            L, n = hist.shape
            if L >= 1 and n >= 1 and scale.shape[0] == n and scale_inv.shape[0] == n:
                return (hist.data_ptr(), scale.data_ptr(), scale_inv.data_ptr(), L, n)
    except (TypeError, ValueError, AttributeError):  # not a 3-sequence of tensors
        pass
    return None


def _raise_state_error(i: int, state: object, device: torch.device | None) -> NoReturn:
    """Raises the one-line ValueError that says what is wrong with states[i]."""
    where = f"fused_delayed_scaling_update: states[{i}]"
    items = tuple(state) if isinstance(state, (tuple, list)) else None
    if items is None or len(items) != 3:
        got = f"has {len(items)} items" if items is not None else f"is a {type(state).__name__}"
        raise ValueError(f"{where} {got}; need (amax_history, scale, scale_inv) tensors")
    for name, t in zip(("amax_history", "scale", "scale_inv"), items):
        ok = (isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == torch.float32
              and t.is_contiguous() and (device is None or t.device == device))
        if not ok:
            need = f"contiguous torch.float32 on {device}" if device else "contiguous float32 on CUDA"
            raise ValueError(f"{where}.{name} is {_describe(t)}; need {need}")
    hist, scale, scale_inv = items
    if hist.dim() != 2 or hist.shape[0] < 1 or hist.shape[1] < 1:
        raise ValueError(f"{where}.amax_history has shape {tuple(hist.shape)}; need [L, n], L, n >= 1")
    raise ValueError(f"{where} has scale {tuple(scale.shape)}, scale_inv {tuple(scale_inv.shape)}; "
                     f"need ({hist.shape[1]},) each to match amax_history {tuple(hist.shape)}")


def fused_delayed_scaling_update(
    states: Sequence[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    fp8_max: float,
    scale_divisor: float,
    algo: str,
    update_scale: bool,
) -> None:
    """Delayed-scaling update of every state in one kernel launch, in place, on the current stream.

    states: (amax_history [L, n], scale [n], scale_inv [n]) float32 CUDA tensors on one device; L and
    n may differ between states; no two states may share memory (the kernel updates them in
    parallel). Same result, bit for bit, as calling te_parallel.fp8.scaling.update_delayed_scaling_torch
    on each state: scale = (fp8_max / amax) / scale_divisor as two IEEE fp32 divisions.
    """
    if algo not in _ALGOS:
        raise ValueError(f"fused_delayed_scaling_update: algo={algo!r}; need 'max' or 'most_recent'")
    if not states:
        return
    module = load()
    if module is None:
        raise RuntimeError("fused_delayed_scaling_update: te_parallel._C is absent; check "
                           "te_parallel._native.available() and use the PyTorch fallback")
    first = states[0][0] if isinstance(states[0], (tuple, list)) and states[0] else None
    if not (isinstance(first, torch.Tensor) and first.is_cuda):
        _raise_state_error(0, states[0], None)
    device = first.device
    c_states = []
    for i, state in enumerate(states):
        c_state = _state_tuple(state, device.index)
        if c_state is None:
            _raise_state_error(i, state, device)
        c_states.append(c_state)
    # The kernel launches on the thread's current device; make it the tensors' device.
    guard, stream = launch_on(device)
    with guard:
        module.delayed_scaling_update(c_states, float(fp8_max), float(scale_divisor), _ALGOS[algo],
                                      bool(update_scale), stream)


_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
CAST_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                        amax_out: torch.Tensor | None, transpose: bool,
                        scale_inv_out: torch.Tensor | None = None,
                        dbias_out: torch.Tensor | None = None, *, rowwise: bool = True,
                        scale_out: torch.Tensor | None = None) -> Tuple[torch.Tensor | None, torch.Tensor | None]:
    """FP8 cast of a contiguous CUDA [rows, cols] matrix in one pass: (data or None, data_t or None).

    Bit-identical to te_parallel.ops.cast.quantize's PyTorch path (fp32 multiply by `scale`,
    saturating round-to-nearest-even); amax_out (a 1-element fp32 CUDA tensor) receives
    max(amax_out, max |x|) in the same pass; scale_inv_out (likewise) receives 1 / scale and
    scale_out the scale itself (a snapshot); dbias_out (a contiguous [cols] float tensor) receives the
    column sums of x (fp32, fixed order). rowwise=False: only the transposed copy is written.
    """
    module = load()
    if module is None:
        raise RuntimeError("cast_transpose_amax: te_parallel._C is absent; use the PyTorch path")
    ok = (x.is_cuda and x.dim() == 2 and x.is_contiguous() and x.dtype in CAST_INPUT_DTYPES and x.numel() > 0
          and scale is not None and _f32_cell(scale) and fp8_dtype in _DTYPES and _f32_cell(amax_out)
          and _f32_cell(scale_inv_out) and _f32_cell(scale_out) and (rowwise or transpose))
    if not ok:
        raise ValueError(f"cast_transpose_amax: got x {_describe(x)}, scale {_describe(scale)}, amax_out "
                         f"{_describe(amax_out)}, scale_inv_out {_describe(scale_inv_out)}, scale_out "
                         f"{_describe(scale_out)}, rowwise={rowwise}, transpose={transpose}; need a contiguous "
                         "non-empty 2-D fp32/fp16/bf16 CUDA x, fp32 CUDA scalars and at least one output")
    rows, cols = x.shape
    device = x.device
    if dbias_out is not None and not (dbias_out.device == device and dbias_out.dtype in CAST_INPUT_DTYPES
                                      and dbias_out.shape == (cols,) and dbias_out.is_contiguous()):
        raise ValueError(f"cast_transpose_amax: dbias_out is {_describe(dbias_out)}; need a contiguous "
                         f"[{cols}] fp32/fp16/bf16 tensor on {device}")
    if dbias_out is not None and (not rowwise or scale_out is not None):
        raise ValueError(f"cast_transpose_amax: dbias_out goes with the row-wise cast and no scale_out; got "
                         f"rowwise={rowwise}, scale_out {_describe(scale_out)}")
    data = torch.empty(rows, cols, dtype=fp8_dtype, device=device) if rowwise else None
    data_t = torch.empty(cols, rows, dtype=fp8_dtype, device=device) if transpose else None
    guard, stream = launch_on(device)
    if dbias_out is not None:
        ws_bytes = module.cast_transpose_dbias_workspace_size(rows, cols)
        workspace = torch.empty(ws_bytes // 4, dtype=torch.float32, device=device)
        with guard:
            module.cast_transpose_dbias(x.data_ptr(), _DTYPES[x.dtype], rows, cols, scale.data_ptr(), data.data_ptr(),
                                        0 if data_t is None else data_t.data_ptr(),
                                        0 if amax_out is None else amax_out.data_ptr(),
                                        0 if scale_inv_out is None else scale_inv_out.data_ptr(), _DTYPES[fp8_dtype],
                                        dbias_out.data_ptr(), _DTYPES[dbias_out.dtype], workspace.data_ptr(), ws_bytes,
                                        stream)
        return data, data_t
    with guard:
        module.cast_transpose_amax(x.data_ptr(), _DTYPES[x.dtype], rows, cols, scale.data_ptr(),
                                   0 if data is None else data.data_ptr(),
                                   0 if data_t is None else data_t.data_ptr(),
                                   0 if amax_out is None else amax_out.data_ptr(),
                                   0 if scale_inv_out is None else scale_inv_out.data_ptr(),
                                   0 if scale_out is None else scale_out.data_ptr(), _DTYPES[fp8_dtype], stream)
    return data, data_t


def _f32_cell(t: torch.Tensor | None) -> bool:
    """None, or a 1-element fp32 CUDA tensor (a scale, an amax cell, a scale_inv out)."""
    return t is None or (t.is_cuda and t.dtype is torch.float32 and t.numel() == 1)


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """The contiguous [cols, rows] transpose of a contiguous CUDA [rows, cols] FP8 matrix, one pass."""
    module = load()
    if module is None:
        raise RuntimeError("transpose_fp8: te_parallel._C is absent; use data.t().contiguous()")
    if not (data.is_cuda and data.dim() == 2 and data.is_contiguous() and data.dtype in FP8_DTYPES and data.numel() > 0):
        raise ValueError(f"transpose_fp8: got {_describe(data)}; need a contiguous non-empty 2-D FP8 CUDA tensor")
    rows, cols = data.shape
    out = torch.empty(cols, rows, dtype=data.dtype, device=data.device)
    guard, stream = launch_on(data.device)
    with guard:
        module.transpose_fp8(data.data_ptr(), rows, cols, out.data_ptr(), stream)
    return out


# cuBLASLt workspace of the native GEMM, one per (device, stream): two GEMMs in flight on different
# streams must not share one. 32 MiB is what cuBLASLt's Hopper kernels may ask for.
GEMM_WORKSPACE_BYTES = 32 * 1024 * 1024
_gemm_workspaces: dict = {}
_gemm_usable: dict = {}


def gemm_usable() -> bool:
    """True if the native GEMM (csrc/gemm) can run here: the extension is built, there is a GPU and
    cuBLASLt opens (asked once; `load().gemm_unavailable_reason()` says why not)."""
    usable = _gemm_usable.get("usable")
    if usable is None:
        module = load()
        usable = module is not None and hasattr(module, "gemm") and torch.cuda.is_available() \
            and bool(module.gemm_available())
        _gemm_usable["usable"] = usable
    return usable


def gemm_workspace(device: torch.device, stream: int) -> torch.Tensor:
    """The native GEMM's cuBLASLt workspace for GEMMs issued on `stream` (a cudaStream_t int)."""
    key = (device.index, stream)
    workspace = _gemm_workspaces.get(key)
    if workspace is None:
        workspace = _gemm_workspaces[key] = torch.empty(GEMM_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return workspace


def fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
             out: torch.Tensor, accumulate: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             fast_accum: bool = False) -> torch.Tensor:
    """out[m, n] = a_scale_inv·b_scale_inv · a[m, k]·b[n, k]ᵀ (+ bias[n]) (+ accumulate[m, n]), in one
    cuBLASLt call (csrc/gemm). a, b: contiguous FP8 CUDA; out, accumulate: contiguous, out's dtype;
    scales: fp32 CUDA scalars. The caller (te_parallel.ops.gemm) has checked the shapes' GEMM rules."""
    module, guard, args = _gemm_args("fp8_gemm", a, a_scale_inv, b, b_scale_inv, out, accumulate, bias, fast_accum)
    with guard:
        module.gemm(*args)
    return out


def gemm_tune(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
              out: torch.Tensor, accumulate: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              fast_accum: bool = False, rounds: int = 5, reps: int = 5) -> Tuple[list, int]:
    """Times cuBLASLt's candidate algorithms for fp8_gemm's arguments (`rounds` passes over them in turn,
    `reps` calls back to back per candidate and pass, median per candidate) and makes the fastest the
    one fp8_gemm runs for such calls from now on: returns ([ms per call of each candidate, -1 where one
    failed], the index chosen; 0 is the heuristic's pick). Writes `out` (with accumulate added) many
    times; waits for the GPU."""
    if not (isinstance(rounds, int) and 1 <= rounds <= 16 and isinstance(reps, int) and reps >= 1):
        raise ValueError(f"gemm_tune: rounds must be an int in [1, 16] and reps an int >= 1, got {rounds!r}, {reps!r}")
    if accumulate is not None and accumulate.data_ptr() == out.data_ptr():
        raise ValueError("gemm_tune: accumulate is out itself; every candidate would add into it again")
    module, guard, args = _gemm_args("gemm_tune", a, a_scale_inv, b, b_scale_inv, out, accumulate, bias, fast_accum)
    with guard:
        times, chosen = module.gemm_tune(*args, rounds, reps)
    return list(times), int(chosen)


def gemm_choose(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                out: torch.Tensor, index: int, accumulate: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, fast_accum: bool = False) -> None:
    """Makes candidate `index` the algorithm fp8_gemm runs for such arguments (0: the heuristic's pick)."""
    module, _, args = _gemm_args("gemm_choose", a, a_scale_inv, b, b_scale_inv, out, accumulate, bias, fast_accum)
    a_ptr, a_dt, b_ptr, b_dt, m, n, k, _, _, c_ptr, d_ptr, d_dt, bias_ptr, fast, _, ws_bytes, _ = args
    module.gemm_choose(a_ptr, a_dt, b_ptr, b_dt, m, n, k, c_ptr, d_ptr, d_dt, bias_ptr, fast, ws_bytes, int(index))


def _gemm_args(what: str, a, a_scale_inv, b, b_scale_inv, out, accumulate, bias, fast_accum) -> tuple:
    """(the extension, the device guard, the argument tuple of its gemm call) after checking every tensor
    the call will read."""
    module = load()
    m, k = a.shape
    n = b.shape[0]
    f32 = torch.float32
    ok = (a.is_cuda and a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES and a.is_contiguous() and b.is_contiguous()
          and b.dim() == 2 and b.shape[1] == k and out.shape == (m, n) and out.is_contiguous()
          and out.dtype in CAST_INPUT_DTYPES and a_scale_inv.dtype is f32 and b_scale_inv.dtype is f32
          and a_scale_inv.numel() == 1 and b_scale_inv.numel() == 1
          and (accumulate is None or (accumulate.shape == out.shape and accumulate.dtype == out.dtype
                                      and accumulate.is_contiguous()))
          and (bias is None or (bias.shape == (n,) and bias.dtype == out.dtype and bias.is_contiguous())))
    if not ok:
        raise ValueError(f"{what}: got a {_describe(a)}, b {_describe(b)}, out {_describe(out)}, accumulate "
                         f"{_describe(accumulate) if accumulate is not None else None}, bias "
                         f"{_describe(bias) if bias is not None else None}; need FP8 a [m, k], b [n, k], out and "
                         f"accumulate [m, n] of one dtype, bias [n] of that dtype, all contiguous on one GPU")
    guard, stream = launch_on(a.device)
    workspace = gemm_workspace(a.device, stream)
    return module, guard, (a.data_ptr(), _DTYPES[a.dtype], b.data_ptr(), _DTYPES[b.dtype], m, n, k,
                    a_scale_inv.data_ptr(), b_scale_inv.data_ptr(),
                    0 if accumulate is None else accumulate.data_ptr(), out.data_ptr(), _DTYPES[out.dtype],
                    0 if bias is None else bias.data_ptr(), fast_accum, workspace.data_ptr(),
                    GEMM_WORKSPACE_BYTES, stream)
