"""cuBLASLt's candidate algorithms for the FP8 GEMMs of a linear layer: is its heuristic's pick the fastest?

    python benchmarks/bench_gemm_algos.py [--shapes 8192x4096x16384 ...] [--rounds 7] [--json out.json]

For each shape (tokens M × in K → out N) the three GEMMs as te_parallel runs them (fprop: x E4M3 ·
Wᵀ + bias; dgrad: dy E5M2 · W; wgrad: dyᵀ E5M2 · x), through te_parallel's own cuBLASLt call
(`te_parallel.native.gemm.gemm_tune`): every candidate the heuristic returns (up to 8) is timed in `rounds` passes over
all of them in turn, `reps` calls back to back each (a GPU at its power cap changes clock within a
second, and runs a sustained GEMM slower than a lone one), median per candidate. Then the heuristic's
pick and the fastest are timed again, 20 calls back to back between two events, alternating for
`rounds` rounds (`gemm_choose` switches the plan), median of each; and the heuristic's pick
with exact against fast accumulation (cuBLASLt's FAST_ACCUM), the same way: "exact_over_fast_accum". Rows: ms of candidate 0 (the heuristic's pick), of
the best, its index, and the back-to-back ratio heuristic ÷ best.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, time_cuda_stream  # noqa: E402
from te_parallel.native import gemm as native_gemm  # noqa: E402

# The GPT layer's GEMMs (hidden 4096, ffn 16384, s2048 × b4 = 8192 tokens): fc1, fc2, qkv, proj.
GPT_LAYER_SHAPES = ["8192x4096x16384", "8192x16384x4096", "8192x4096x12288", "8192x4096x4096"]


def operands(m: int, k: int, n: int):
    """{gemm: (a [rows, inner], b [cols, inner], bias or None)} in FP8, as te_parallel's linear layer feeds
    the native call (D = A·Bᵀ)."""
    dev, e4, e5 = "cuda", torch.float8_e4m3fn, torch.float8_e5m2
    x = torch.randn(m, k, device=dev).to(e4)
    w = torch.randn(n, k, device=dev).to(e4)
    dy = torch.randn(m, n, device=dev).to(e5)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    return {"fprop": (x, w, bias), "dgrad": (dy, w.t().contiguous(), None),
            "wgrad": (dy.t().contiguous(), x.t().contiguous(), None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=GPT_LAYER_SHAPES)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5, help="calls back to back per candidate and round")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not (torch.cuda.is_available() and native_gemm.usable()):
        sys.exit("bench_gemm_algos needs a CUDA GPU and te_parallel's native GEMM (cuBLASLt)")
    one = torch.ones((), device="cuda")
    rows = []
    for shape in a.shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        for name, (lhs, rhs, bias) in operands(m, k, n).items():
            out = torch.empty(lhs.shape[0], rhs.shape[0], device="cuda", dtype=torch.bfloat16)
            call = lambda: native_gemm.fp8_gemm(lhs, one, rhs, one, out, bias=bias)  # noqa: E731
            times, best = native_gemm.gemm_tune(lhs, one, rhs, one, out, bias=bias, rounds=a.rounds, reps=a.reps)
            b2b = {0: [], best: []}
            for _ in range(a.rounds):  # the heuristic's pick and the fastest, back to back, interleaved
                for index in b2b:
                    native_gemm.gemm_choose(lhs, one, rhs, one, out, index, bias=bias)
                    b2b[index].append(time_cuda_stream(call, warmup=1, repeats=1))
            heuristic, tuned = statistics.median(b2b[0]), statistics.median(b2b[best])
            native_gemm.gemm_choose(lhs, one, rhs, one, out, 0, bias=bias)  # back to the heuristic's pick
            fast = lambda: native_gemm.fp8_gemm(lhs, one, rhs, one, out, bias=bias, fast_accum=True)  # noqa: E731
            accum = {False: [], True: []}
            for _ in range(a.rounds):  # exact against fast accumulation (each with its heuristic's pick)
                for flag, fn in ((False, call), (True, fast)):
                    accum[flag].append(time_cuda_stream(fn, warmup=1, repeats=1))
            exact_ms, fast_ms = statistics.median(accum[False]), statistics.median(accum[True])
            flops = 2 * lhs.shape[0] * lhs.shape[1] * rhs.shape[0]
            rows.append({"shape": shape, "gemm": name, "MxKxN": f"{lhs.shape[0]}x{lhs.shape[1]}x{rhs.shape[0]}",
                         "candidates": len(times), "cand0_ms": times[0], "best_ms": times[best], "best": best,
                         "heuristic_b2b_ms": heuristic, "tuned_b2b_ms": tuned, "heuristic_over_tuned": heuristic / tuned,
                         "tuned_tflops": flops / tuned / 1e9, "exact_over_fast_accum": exact_ms / fast_ms,
                         "all_ms": " ".join(f"{t:.3f}" for t in times)})
    report("cuBLASLt candidates of the FP8 GEMMs (ms; b2b: 20 calls back to back)", rows,
           ["shape", "gemm", "MxKxN", "candidates", "cand0_ms", "best_ms", "best", "heuristic_b2b_ms",
            "tuned_b2b_ms", "heuristic_over_tuned", "tuned_tflops", "exact_over_fast_accum", "all_ms"], a.json)


if __name__ == "__main__":
    main()
