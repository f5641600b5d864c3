"""Bias + activation kernels (forward, and dact + dbias + FP8 cast-transpose backward) vs PyTorch ops and copy.

    python benchmarks/bench_activation.py [--json out.json] [--shapes 8192x16384 8192x4096]

Shapes are fc1's output x [tokens, cols] in bf16 (for swiglu the activation output has cols/2 columns).
Bytes counted are those the op must move (N = tokens * cols elements of x):
  bias+gelu fwd, bf16 out          read x 2N, write y 2N                               = 4N
  bias+gelu fwd, FP8 + transpose   read x 2N, write y and y^T 1 B each                 = 4N
  swiglu fwd, bf16 out             read x 2N, write y 2 * N/2                          = 3N
  swiglu fwd, FP8 + transpose      read x 2N, write 2 * N/2                            = 3N
  dgelu+dbias bwd, bf16 dx         read dy 2N and x 2N, write dx 2N                    = 6N
  dgelu+dbias bwd, FP8 + transpose read dy 2N and x 2N, write dx and dx^T 1 B each     = 6N
  dswiglu bwd, FP8 + transpose     read dy 2 * N/2 and x 2N, write 2N                  = 5N
(the dbias partial sums, cols * tokens/64 * 4 B, are left out). Copy = x.clone(): 4N bytes.
Each row is timed twice: "eager" (one call between CUDA events, host overhead included, as
bench_cast.py) and "graph" (replayed from a CUDA graph: what the kernels reach). vs_copy_bw compares
with the copy timed the same way in the same run; vs_torch is torch time / native time.
The torch rows are what te_parallel did before these kernels: the ops unfused, then a separate cast.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, time_cuda  # noqa: E402
from graph_timing import time_cuda_graph  # noqa: E402
from te_parallel.native import activation as na  # noqa: E402

E4M3 = torch.float8_e4m3fn


def torch_cast(y, scale, amax):
    """The unfused cast + transpose + amax (bench_cast.py's torch row)."""
    torch.maximum(amax, y.abs().amax().float().view(1), out=amax)
    data = (y.float() * scale).clamp_(-448.0, 448.0).to(E4M3)
    return data, data.t().contiguous()


def torch_dswiglu(dy, x):
    a, b = x.float().chunk(2, dim=-1)
    s = torch.sigmoid(a)
    return torch.cat([dy * b * s * (1 + a * (1 - s)), dy * a * s], dim=-1).to(x.dtype)


def cases(x, bias, dy, dy_half, scale, amax):
    """(name, bytes per element of x, native fn, torch fn)."""
    fp8 = dict(fp8_dtype=E4M3, scale=scale, amax_out=amax, transpose=True, high_precision=False)
    gelu = lambda v: F.gelu(v, approximate="tanh")  # noqa: E731
    return [
        ("bias+gelu fwd, bf16 out", 4, lambda: na.bias_activation_forward("gelu", x, bias),
         lambda: gelu(x + bias)),
        ("bias+gelu fwd, FP8 + transpose", 4, lambda: na.bias_activation_forward("gelu", x, bias, **fp8),
         lambda: torch_cast(gelu(x + bias), scale, amax)),
        ("swiglu fwd, bf16 out", 3, lambda: na.bias_activation_forward("swiglu", x),
         lambda: (lambda a, b: F.silu(a) * b)(*x.chunk(2, dim=-1))),
        ("swiglu fwd, FP8 + transpose", 3, lambda: na.bias_activation_forward("swiglu", x, **fp8),
         lambda: torch_cast((lambda a, b: F.silu(a) * b)(*x.chunk(2, dim=-1)), scale, amax)),
        ("dgelu+dbias bwd, bf16 dx", 6,
         lambda: na.dbias_dactivation_backward("gelu", dy, x, need_dbias=True),
         lambda: (lambda d: (d, d.sum(0)))(torch.ops.aten.gelu_backward(dy, x, approximate="tanh"))),
        ("dgelu+dbias bwd, FP8 + transpose", 6,
         lambda: na.dbias_dactivation_backward("gelu", dy, x, need_dbias=True, **fp8),
         lambda: (lambda d: (torch_cast(d, scale, amax), d.sum(0)))(
             torch.ops.aten.gelu_backward(dy, x, approximate="tanh"))),
        ("dswiglu bwd, FP8 + transpose", 5, lambda: na.dbias_dactivation_backward("swiglu", dy_half, x, **fp8),
         lambda: torch_cast(torch_dswiglu(dy_half, x), scale, amax)),
    ]


def bench_shape(m: int, n: int, timings):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dy_half = torch.randn(m, n // 2, device="cuda", dtype=torch.bfloat16)
    scale, amax = torch.tensor(2.0, device="cuda"), torch.zeros(1, device="cuda")
    rows = []
    for timing, timer in timings:
        copy_ms = timer(lambda: x.clone())
        copy_bw = 4 * m * n / copy_ms / 1e6
        rows.append({"shape": f"{m}x{n}", "case": "copy (x.clone)", "timing": timing, "ms": copy_ms,
                     "GB_s": copy_bw, "vs_copy_bw": 1.0, "vs_torch": "-"})
        for name, bpe, native_fn, torch_fn in cases(x, bias, dy, dy_half, scale, amax):
            native_ms, torch_ms = timer(native_fn), timer(torch_fn)
            for who, ms in (("native", native_ms), ("torch ops", torch_ms)):
                bw = bpe * m * n / ms / 1e6
                rows.append({"shape": f"{m}x{n}", "case": f"{name} [{who}]", "timing": timing, "ms": ms,
                             "GB_s": bw, "vs_copy_bw": bw / copy_bw, "vs_torch": torch_ms / ms})
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", nargs="+", default=["8192x16384", "8192x4096"], help="tokens x cols of fc1's output")
    ap.add_argument("--no-graph", action="store_true", help="eager timing only")
    args = ap.parse_args()
    if not na.usable("gelu", torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)):
        raise SystemExit("bench_activation: te_parallel._C has no activation kernels; build them first")
    timings = [("eager", time_cuda)] + ([] if args.no_graph else [("graph", time_cuda_graph)])
    rows = []
    for shape in args.shapes:
        m, n = (int(v) for v in shape.split("x"))
        rows += bench_shape(m, n, timings)
    report("Bias + activation kernels, bf16 (median ms; GB/s of the bytes the op must move)", rows,
           ["shape", "case", "timing", "ms", "GB_s", "vs_copy_bw", "vs_torch"], args.json)


if __name__ == "__main__":
    main()
