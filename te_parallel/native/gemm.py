"""te_parallel's own cuBLASLt call (csrc/gemm; C API te_parallel/gemm.h): the FP8 GEMM with a C matrix
added in the epilogue, its cached plans, and the tuning of a plan's algorithm.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from te_parallel.native import DTYPES, FP8_DTYPES, HIGH_PRECISION_DTYPES, describe, launch_on, load, require

__all__ = ["WORKSPACE_BYTES", "usable", "unavailable_reason", "cached_plans", "workspace", "fp8_gemm", "gemm_tune",
           "gemm_choose"]

# cuBLASLt workspace of the native GEMM, one per (device, stream): two GEMMs in flight on different
# streams must not share one. 32 MiB is what cuBLASLt's Hopper kernels may ask for.
WORKSPACE_BYTES = 32 * 1024 * 1024
_usable: dict = {}


def usable() -> bool:
    """True if the native GEMM can run here: the extension is built, there is a GPU and cuBLASLt opens
    (asked once; unavailable_reason() says why not); not while torch.compile traces (the same cuBLASLt
    call is then made by the torch op te_parallel::fp8_gemm, which it traces as one node)."""
    if torch.compiler.is_compiling():
        return False
    ok = _usable.get("usable")
    if ok is None:
        module = load()
        ok = _usable["usable"] = module is not None and torch.cuda.is_available() and bool(module.gemm_available())
    return ok


def unavailable_reason() -> str:
    """Why cuBLASLt did not open ('' if it did, or if the extension is absent)."""
    module = load()
    return "" if module is None else module.gemm_unavailable_reason()


def cached_plans() -> int:
    """Plans (one per shape, dtypes and epilogue) the native GEMM has built so far in this process."""
    module = load()
    return 0 if module is None else int(module.gemm_cached_plans())


def workspace(device: torch.device, stream: int) -> Tuple[int, Optional[torch.Tensor]]:
    """(address, temporary) of the native GEMM's cuBLASLt workspace (WORKSPACE_BYTES) for GEMMs issued on
    `stream` (a cudaStream_t int) of `device`. The C API's own, temporary None: cudaMalloc'd once per (device,
    stream) and kept, outside torch's allocator, so that no CUDA graph's memory pool holds it. Where the
    stream is being captured and has none yet (a capture may not cudaMalloc), a temporary tensor: the caller
    keeps it until the GEMM is issued."""
    index = torch.cuda.current_device() if device.index is None else device.index
    address = load().gemm_workspace(index, stream, WORKSPACE_BYTES)
    if address:
        return address, None
    scratch = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return scratch.data_ptr(), scratch


def fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
             out: torch.Tensor, accumulate: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             fast_accum: bool = False) -> torch.Tensor:
    """out[m, n] = a_scale_inv·b_scale_inv · a[m, k]·b[n, k]ᵀ (+ bias[n]) (+ accumulate[m, n]), in one
    cuBLASLt call. a, b: contiguous FP8 CUDA; out, accumulate: contiguous, out's dtype; scales: fp32
    CUDA scalars. The caller (te_parallel.ops.gemm) has checked the shapes' GEMM rules."""
    module, guard, args, _ws = _gemm_args("fp8_gemm", a, a_scale_inv, b, b_scale_inv, out, accumulate, bias,
                                          fast_accum)
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
    module, guard, args, _ws = _gemm_args("gemm_tune", a, a_scale_inv, b, b_scale_inv, out, accumulate, bias,
                                          fast_accum)
    with guard:
        times, chosen = module.gemm_tune(*args, rounds, reps)
    return list(times), int(chosen)


def gemm_choose(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                out: torch.Tensor, index: int, accumulate: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, fast_accum: bool = False) -> None:
    """Makes candidate `index` the algorithm fp8_gemm runs for such arguments (0: the heuristic's pick)."""
    module, _, args, _ws = _gemm_args("gemm_choose", a, a_scale_inv, b, b_scale_inv, out, accumulate, bias,
                                      fast_accum)
    a_ptr, a_dt, b_ptr, b_dt, m, n, k, _, _, c_ptr, d_ptr, d_dt, bias_ptr, fast, _, ws_bytes, _ = args
    module.gemm_choose(a_ptr, a_dt, b_ptr, b_dt, m, n, k, c_ptr, d_ptr, d_dt, bias_ptr, fast, ws_bytes, int(index))


def _gemm_args(what: str, a, a_scale_inv, b, b_scale_inv, out, accumulate, bias, fast_accum) -> tuple:
    """(the extension, the device guard, the argument tuple of its gemm call, and the temporary workspace
    whose address the tuple holds when the stream is being captured and has no workspace of its own, else
    None: the caller keeps it until the call is issued) after checking every tensor the call will read."""
    module = require(what, "gemm")
    m, k = a.shape
    n = b.shape[0]
    f32 = torch.float32
    ok = (a.is_cuda and a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES and a.is_contiguous() and b.is_contiguous()
          and b.dim() == 2 and b.shape[1] == k and out.shape == (m, n) and out.is_contiguous()
          and out.dtype in HIGH_PRECISION_DTYPES and a_scale_inv.dtype is f32 and b_scale_inv.dtype is f32
          and a_scale_inv.numel() == 1 and b_scale_inv.numel() == 1
          and (accumulate is None or (accumulate.shape == out.shape and accumulate.dtype == out.dtype
                                      and accumulate.is_contiguous()))
          and (bias is None or (bias.shape == (n,) and bias.dtype == out.dtype and bias.is_contiguous())))
    if not ok:
        raise ValueError(f"{what}: got a {describe(a)}, b {describe(b)}, out {describe(out)}, accumulate "
                         f"{describe(accumulate) if accumulate is not None else None}, bias "
                         f"{describe(bias) if bias is not None else None}; need FP8 a [m, k], b [n, k], out and "
                         f"accumulate [m, n] of one dtype, bias [n] of that dtype, all contiguous on one GPU")
    guard, stream = launch_on(a.device)
    ws, scratch = workspace(a.device, stream)
    return module, guard, (a.data_ptr(), DTYPES[a.dtype], b.data_ptr(), DTYPES[b.dtype], m, n, k,
                           a_scale_inv.data_ptr(), b_scale_inv.data_ptr(),
                           0 if accumulate is None else accumulate.data_ptr(), out.data_ptr(), DTYPES[out.dtype],
                           0 if bias is None else bias.data_ptr(), fast_accum, ws, WORKSPACE_BYTES,
                           stream), scratch
