"""Block-scaled FP8 quantization (Triton, te_parallel.ops.block_cast) against torch's per-tensor FP8 cast.

    python benchmarks/bench_block_cast.py [--shapes 4096x4096,4096x14336,...] [--json out.json]

Cases, for a bf16 x [M, K] (the default shapes are Llama-3-8B's GEMM operands):

* 1x128 both directions: one kernel reads x once and writes data [M, K], data_t [K, M] and the two
  scale_inv arrays: 2 + 1 + 1 bytes per element, plus 2 x 4 bytes per 128 elements.
* 1x128 rowwise: data and scale_inv only (2 + 1 bytes per element, plus 4 per 128).
* 128x128, and 128x128 with its transposed copy: 2 + 1 (+ 1) bytes per element, plus 4 (x2) per 128x128.
* torch per-tensor cast, x.to(torch.float8_e4m3fn): 2 + 1 bytes per element (no scale, no amax).

GB/s = those bytes / time. Each case is timed eagerly (common.time_cuda: host time of the call included)
and replayed from a CUDA graph (graph_timing.time_cuda_graph: the kernel alone); vs_torch_cast compares
GB/s with the torch cast timed the same way.
"""
from __future__ import annotations

import os
import sys
from typing import List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Parser, report, time_cuda  # noqa: E402
from graph_timing import time_cuda_graph  # noqa: E402

LLAMA3_8B = "4096x4096,4096x14336,14336x4096,8192x4096"


def _shapes(text: str) -> List[Tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes {text}: each shape is MxK with positive integers (e.g. 4096x14336)")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def parse_args(argv=None):
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=LLAMA3_8B, help=f"comma-separated MxK (default {LLAMA3_8B})")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    try:
        args.shapes = _shapes(args.shapes)
    except ValueError as e:
        ap.error(str(e))
    return args


def cases(x: torch.Tensor):
    """(name, fn, bytes moved) of each case for x [M, K]."""
    from te_parallel.ops import block_cast

    m, k = x.shape
    n, e = m * k, x.element_size()
    tiles_1x128 = m * -(-k // 128)
    blocks = -(-m // 128) * -(-k // 128)
    fp8 = torch.float8_e4m3fn
    return [
        ("torch per-tensor cast x.to(e4m3)", lambda: x.to(fp8), n * (e + 1)),
        ("1x128 rowwise + columnwise", lambda: block_cast.quantize(x, fp8, 1, rowwise=True, columnwise=True),
         n * (e + 2) + 4 * (tiles_1x128 + -(-m // 128) * k)),
        ("1x128 rowwise", lambda: block_cast.quantize(x, fp8, 1), n * (e + 1) + 4 * tiles_1x128),
        ("128x128", lambda: block_cast.quantize(x, fp8, 2), n * (e + 1) + 4 * blocks),
        ("128x128 + transposed copy", lambda: block_cast.quantize(x, fp8, 2, rowwise=True, columnwise=True),
         n * (e + 2) + 8 * blocks),
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_block_cast.py: error: needs a CUDA GPU (torch.cuda.is_available() is False)")
    from te_parallel.ops import block_cast

    probe = torch.empty(1, 1, device="cuda", dtype=torch.bfloat16)
    if not block_cast.usable(probe):
        sys.exit("bench_block_cast.py: error: the Triton block-cast kernels need triton and an sm_89+ GPU "
                 f"(this one is sm_{''.join(map(str, torch.cuda.get_device_capability()))}); pip install triton")
    rows = []
    for m, k in args.shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        timed = [(name, fn, nbytes, time_cuda(fn), time_cuda_graph(fn)) for name, fn, nbytes in cases(x)]
        torch_eager, torch_graph = timed[0][2] / timed[0][3], timed[0][2] / timed[0][4]
        for name, _, nbytes, ms, graph_ms in timed:
            rows.append({"shape": f"{m}x{k}", "case": name, "MB": nbytes / 1e6, "ms": ms, "GB_s": nbytes / ms / 1e6,
                         "vs_torch_cast": nbytes / ms / torch_eager, "graph_ms": graph_ms,
                         "graph_GB_s": nbytes / graph_ms / 1e6, "graph_vs_torch_cast": nbytes / graph_ms / torch_graph})
        del x
    report(f"Block-scaled FP8 quantization of a bf16 x [M, K] on {torch.cuda.get_device_name()} (median ms; GB/s "
           "of the bytes each case must move; graph_*: replayed from a CUDA graph)", rows,
           ["shape", "case", "MB", "ms", "GB_s", "vs_torch_cast", "graph_ms", "graph_GB_s", "graph_vs_torch_cast"],
           args.json)


if __name__ == "__main__":
    main()
