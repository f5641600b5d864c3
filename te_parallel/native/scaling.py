"""Scaling kernels (C API te_parallel/te_parallel.h): the fused delayed-scaling update
(csrc/kernels/scale_update.cu), which matches te_parallel.fp8.scaling.update_delayed_scaling_torch bit for
bit for every state of a pass in one launch, and current scaling's amax -> scale
(csrc/kernels/current_scale.cu), which matches te_parallel.ops.cast.amax_of and
te_parallel.fp8.scaling.current_scale bit for bit in two launches instead of about a dozen torch ops.
"""
from __future__ import annotations

from typing import NoReturn, Sequence, Tuple

import torch

from te_parallel.native import AMAX_ALGOS, DTYPES, HIGH_PRECISION_DTYPES, describe, launch_on, require

__all__ = ["usable", "fused_delayed_scaling_update", "current_usable", "current_scale_of", "scale_from_amax"]


def usable(states: Sequence[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> bool:
    """True if the kernel updates these states: they are on CUDA (the first amax history says so) and the
    extension is loaded. A state the kernel cannot take is then an error, not a fallback. Not while
    torch.compile traces (it cannot trace into the extension)."""
    return bool(states) and states[0][0].is_cuda and bool(AMAX_ALGOS) and not torch.compiler.is_compiling()


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
            raise ValueError(f"{where}.{name} is {describe(t)}; need {need}")
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
    algo: a name of the extension's AMAX_ALGOS table ('max', 'most_recent').
    """
    module = require("fused_delayed_scaling_update", "scaling")
    code = AMAX_ALGOS.get(algo)
    if code is None:
        raise ValueError(f"fused_delayed_scaling_update: algo={algo!r}; need one of {tuple(AMAX_ALGOS)}")
    if not states:
        return
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
        module.delayed_scaling_update(c_states, float(fp8_max), float(scale_divisor), code, bool(update_scale),
                                      stream)


def current_usable(t: torch.Tensor) -> bool:
    """True if the current-scaling kernels take t: a non-empty contiguous CUDA tensor of a high-precision
    dtype (an x) or fp32 (an amax), with the extension loaded (DTYPES is empty without it); not while
    torch.compile traces (it cannot trace into the extension)."""
    return (t.is_cuda and t.numel() > 0 and t.is_contiguous() and t.dtype in HIGH_PRECISION_DTYPES and bool(DTYPES)
            and not torch.compiler.is_compiling())


def current_scale_of(x: torch.Tensor, fp8_max: float, amax_only: bool = False) -> torch.Tensor:
    """[scale, scale_inv, amax] (fp32, on x's device) of current scaling for x: amax = max |x| (NaN
    propagates), scale = fp8_max / amax where that is finite and positive, else 1. amax_only: only the
    amax is written (slots 0 and 1 are garbage), e.g. to all-reduce it before scale_from_amax."""
    module = require("current_scale_of", "scaling")
    if not current_usable(x):
        raise ValueError(f"current_scale_of: x is {describe(x)}; need a non-empty contiguous fp32/fp16/bf16 CUDA "
                         "tensor")
    n = x.numel()
    out = torch.empty(3 + module.current_scale_partials(n), dtype=torch.float32, device=x.device)
    base = out.data_ptr()
    guard, stream = launch_on(x.device)
    with guard:
        module.current_scale(x.data_ptr(), DTYPES[x.dtype], n, 0, float(fp8_max), base + 12, base + 8,
                             0 if amax_only else base, 0 if amax_only else base + 4, stream)
    return out[:3]


def scale_from_amax(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """[scale, scale_inv] (fp32) of current scaling for a given amax (a 1-element fp32 CUDA tensor, e.g.
    one all-reduced across ranks): te_parallel.fp8.scaling.current_scale in one launch."""
    module = require("scale_from_amax", "scaling")
    if not (amax.is_cuda and amax.numel() == 1 and amax.dtype is torch.float32 and amax.is_contiguous()):
        raise ValueError(f"scale_from_amax: amax is {describe(amax)}; need a 1-element contiguous float32 CUDA "
                         "tensor")
    out = torch.empty(2, dtype=torch.float32, device=amax.device)
    base = out.data_ptr()
    guard, stream = launch_on(amax.device)
    with guard:
        module.current_scale(0, 0, 0, amax.data_ptr(), float(fp8_max), 0, 0, base, base + 4, stream)
    return out
