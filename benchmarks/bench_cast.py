"""FP8 cast + transpose + amax: native one-pass kernel vs the PyTorch ops, against copy bandwidth.

    python benchmarks/bench_cast.py [--json out.json]

Bytes counted: read the input once, write the FP8 matrix and its transpose (2 bytes/element for a
bf16 input + 2 FP8 bytes = 4 bytes/element). Copy: x.clone() (read + write 2 bytes each).
Rows marked [graph] replay the calls from a CUDA graph (graph_timing.py): no host overhead, so they show
what the kernel reaches; their vs_copy_bw compares with the copy timed the same way.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, time_cuda  # noqa: E402
from graph_timing import time_cuda_graph  # noqa: E402
from te_parallel.native import cast as native_cast  # noqa: E402


def torch_cast(x, scale, amax):
    torch.maximum(amax, x.abs().amax().float().view(1), out=amax)
    data = (x.float() * scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data, data.t().contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for m, n in [(8192, 4096), (8192, 16384), (2048, 768)]:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        scale, amax = torch.tensor(2.0, device="cuda"), torch.zeros(1, device="cuda")
        nbytes = 4 * m * n
        copy_ms = time_cuda(lambda: x.clone())
        copy_bw = 4 * m * n / copy_ms / 1e6
        for name, fn in [("copy (x.clone)", lambda: x.clone()),
                         ("native cast+transpose+amax",
                          lambda: native_cast.cast_transpose_amax(x, scale, torch.float8_e4m3fn, amax, True)),
                         ("torch ops", lambda: torch_cast(x, scale, amax))]:
            ms = time_cuda(fn)
            bw = nbytes / ms / 1e6 if name != "copy (x.clone)" else copy_bw
            rows.append({"shape": f"{m}x{n}", "case": name, "ms": ms, "GB_s": bw, "vs_copy_bw": bw / copy_bw})
        graph_copy_ms = time_cuda_graph(lambda: x.clone())
        for name, fn in [("copy (x.clone) [graph]", lambda: x.clone()),
                         ("native cast+transpose+amax [graph]",
                          lambda: native_cast.cast_transpose_amax(x, scale, torch.float8_e4m3fn, amax, True))]:
            ms = graph_copy_ms if name.startswith("copy") else time_cuda_graph(fn)
            bw = nbytes / ms / 1e6
            rows.append({"shape": f"{m}x{n}", "case": name, "ms": ms, "GB_s": bw, "vs_copy_bw": graph_copy_ms / ms})
    report("FP8 cast of a bf16 matrix (median ms; GB/s of the bytes the op must move)", rows,
           ["shape", "case", "ms", "GB_s", "vs_copy_bw"], args.json)


if __name__ == "__main__":
    main()
