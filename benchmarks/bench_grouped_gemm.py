"""Grouped GEMMs of Mixture-of-Experts layers: the block-scaled FP8 Triton kernel (te_parallel.ops.grouped_block_gemm)
against torch's bf16 grouped GEMM and cuBLASLt's block-scaled GEMM called once per expert.

    python benchmarks/bench_grouped_gemm.py [--models qwen3-30b-a3b,mixtral-8x7b] [--align 1] [--json out.json]

Shapes (the experts' fc1, gate and up projections together):

* qwen3-30b-a3b: 128 experts, 131072 routed rows (16384 tokens x top-8), K 2048 (hidden), N 1536 (2 x 768);
* mixtral-8x7b: 8 experts, 16384 routed rows (8192 tokens x top-2), K 4096, N 28672 (2 x 14336).

The rows are spread unevenly over the experts (loads proportional to exp(0.6 z), z normal; max_rows is the
busiest expert's, 4-6x the mean here; --align rounds each expert's rows to a multiple). Rows, per model:

* fprop y[rows_g] = x[rows_g] · W[g]ᵀ: torch._grouped_mm in bf16; the Triton kernel (kind "m", x in 1x128
  tiles, W in 128x128 blocks); block_mm (cuBLASLt's block-scaled GEMM) once per expert, the offsets read
  on the host beforehand (G launches: what a layer without a grouped kernel runs);
* dgrad dx[rows_g] = dy[rows_g] · W[g] under per-tensor FP8 with HYBRID's E5M2 dy: torch._grouped_mm in bf16;
  the Triton kernel with constant scales (ops.grouped_gemm's TRITON route, kind "m"); torch._scaled_grouped_mm
  on an E4M3 dy (the Format.E4M3 route, for comparison);
* wgrad dW[g] = dy[rows_g]ᵀ · x[rows_g]: torch._grouped_mm in bf16; the Triton kernel (kind "k", dy and x
  in 1x128 tiles along the rows); the same kernel with per-tensor scales (E5M2 dy, device-sized groups);
* copies per step (GB/s over the bytes read and written; TFLOPS left empty): the experts' FP8 Wᵀ for dgrad by
  torch's strided copy and by ops.fp8_transpose; the per-expert weight cast by its torch form and by
  ops.grouped_cast.

ms: median of back-to-back calls (common.time_interleaved: every row of a model timed in each round, clocks
settled before each sample); TFLOPS = 2·M·N·K / time; vs_bf16 = the bf16 row's time / this row's.
rel_err_vs_bf16: ||out - bf16 out|| / ||bf16 out|| (the FP8 quantization's error, a few percent; a sanity
check, the tests hold the exact ones). The kernels are autotuned during the warm-up.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Parser, report, time_interleaved  # noqa: E402


@dataclass(frozen=True)
class MoEShape:
    experts: int
    rows: int
    k: int
    n: int


MODELS = {
    "qwen3-30b-a3b": MoEShape(experts=128, rows=131072, k=2048, n=1536),
    "mixtral-8x7b": MoEShape(experts=8, rows=16384, k=4096, n=28672),
}


def parse_args(argv=None):
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--align", type=int, default=1, help="round each expert's rows to a multiple of this (default 1)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        ap.error(f"--models {args.models}: unknown {unknown or 'empty'}; choose from {', '.join(MODELS)}")
    if args.align < 1:
        ap.error(f"--align {args.align}: must be a positive number of rows")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be at least 1")
    args.models = names
    return args


def expert_rows(shape: MoEShape, align: int, seed: int = 0) -> List[int]:
    """Uneven rows per expert adding up to about shape.rows, each a multiple of `align`."""
    gen = torch.Generator().manual_seed(seed)
    load = torch.exp(0.6 * torch.randn(shape.experts, generator=gen))
    sizes = (load / load.sum() * shape.rows / align).round().long() * align
    busiest = int(sizes.argmax())  # takes the rounding's remainder
    sizes[busiest] = max(0, int(sizes[busiest]) + (shape.rows - int(sizes.sum())) // align * align)
    return sizes.tolist()


def cases(shape: MoEShape, sizes: List[int]) -> Dict[str, Dict[str, Callable[[], torch.Tensor]]]:
    """{"fprop" | "wgrad": {row name: call}} on fresh CUDA operands."""
    from te_parallel.fp8.blockwise import quantize_blockwise
    from te_parallel.ops.gemm import block_mm
    from te_parallel.ops.grouped_block_gemm import grouped_block_mm_cuda

    g, k, n, e4 = shape.experts, shape.k, shape.n, torch.float8_e4m3fn
    m = sum(sizes)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5  # [G, N, K]

    xq = quantize_blockwise(x, e4, 1, rowwise=True, columnwise=True)
    dyq = quantize_blockwise(dy, e4, 1, rowwise=False, columnwise=True)
    wq = quantize_blockwise(w.reshape(g * n, k), e4, 2)  # N is whole 128-row blocks in both models
    b = wq.data.view(g, n, k).transpose(1, 2)  # [G, K, N], each W[g]ᵀ column-major
    sb = wq.scale_inv.view(g, n // 128, -1).transpose(1, 2)  # [G, K/128, N/128]
    sa = xq.scale_inv.t()  # [M, K/128]
    ends = torch.tensor(sizes).cumsum(0).tolist()
    bounds = list(zip([0] + ends[:-1], ends))

    def per_expert_block_mm():
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        for e, (r0, r1) in enumerate(bounds):
            if r1 > r0:
                block_mm(xq.data[r0:r1], sa[r0:r1], 1, b[e], sb[e], 2, torch.bfloat16, out=out[r0:r1])
        return out

    wt = w.transpose(1, 2)  # [G, K, N]
    x_cols = xq.data_t.t()  # [M, K] column-major
    # per-tensor FP8 operands: one scale per operand (per expert for W); dgrad's B = W[g] column-major (Wᵀ bytes)
    from te_parallel.ops.fp8_transpose import transposed_copy
    from te_parallel.ops.grouped_gemm import constant_block_scales

    one = torch.ones((), device="cuda")
    w8 = (w * 64).to(e4)  # [G, N, K]
    w8_cols = transposed_copy(w8).transpose(1, 2)  # [G, N, K], each W[g] column-major
    dy5, dy4 = dy.to(torch.float8_e5m2), dy.to(e4)
    dy5_t, x8_cols = dy5.t().contiguous(), x.to(e4).t().contiguous().t()
    per_w = torch.full((g,), 1 / 64, device="cuda")  # W's scale_inv: the values are w
    dgrad_ops = constant_block_scales(dy5, one, w8_cols, per_w, "m")
    wgrad_ops = constant_block_scales(dy5_t, one, x8_cols, one, "k")
    scaled_dgrad = (one.expand(m).contiguous(), per_w.view(g, 1).expand(g, k).contiguous())
    return {
        "fprop": {
            "torch._grouped_mm bf16": lambda: torch._grouped_mm(x, wt, offs=offs),
            "Triton block-scaled FP8 (kind m)": lambda: grouped_block_mm_cuda(xq.data, sa, 1, b, sb, 2, offs,
                                                                               torch.bfloat16, "m"),
            f"block_mm per expert ({g} cuBLASLt calls)": per_expert_block_mm,
        },
        "dgrad": {
            "torch._grouped_mm bf16": lambda: torch._grouped_mm(dy, w, offs=offs),
            "Triton per-tensor FP8 E5M2 x E4M3 (kind m)": lambda: grouped_block_mm_cuda(*dgrad_ops, offs,
                                                                                       torch.bfloat16, "m"),
            "torch._scaled_grouped_mm E4M3": lambda: torch._scaled_grouped_mm(
                dy4, w8_cols, *scaled_dgrad, offs=offs, out_dtype=torch.bfloat16),
        },
        "wgrad": {
            "torch._grouped_mm bf16": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
            "Triton block-scaled FP8 (kind k)": lambda: grouped_block_mm_cuda(
                dyq.data_t, dyq.scale_inv_t.t(), 1, x_cols, xq.scale_inv_t, 1, offs, torch.bfloat16, "k"),
            "Triton per-tensor FP8 E5M2 x E4M3 (kind k)": lambda: grouped_block_mm_cuda(*wgrad_ops, offs,
                                                                                       torch.bfloat16, "k"),
        },
    }


def copies(shape: MoEShape) -> Dict[str, Callable[[], torch.Tensor]]:
    """{row name: call} of the per-step copies of the experts' weights, and the bytes each moves."""
    from te_parallel.ops.fp8_transpose import transposed_copy
    from te_parallel.ops.grouped_cast import quantize_experts
    from te_parallel.ops.grouped_fp8 import quantize_grouped_reference

    g, k, n = shape.experts, shape.k, shape.n
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    w8 = w.to(torch.float8_e4m3fn)
    scale = torch.rand(g, device="cuda") + 1
    elems = g * n * k
    return {
        "Wᵀ FP8: torch strided copy": (lambda: w8.transpose(1, 2).contiguous(), 2 * elems),
        "Wᵀ FP8: fp8_transpose kernel": (lambda: transposed_copy(w8), 2 * elems),
        "W cast per expert: torch form": (lambda: quantize_grouped_reference(w, scale, torch.float8_e4m3fn), 3 * elems),
        "W cast per expert: grouped_cast kernel": (lambda: quantize_experts(w, scale, torch.float8_e4m3fn), 3 * elems),
    }


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def measure(name: str, shape: MoEShape, align: int, rounds: int) -> List[dict]:
    sizes = expert_rows(shape, align)
    m = sum(sizes)
    flops = 2 * m * shape.n * shape.k
    rows = []
    for gemm, calls in cases(shape, sizes).items():
        ref = next(iter(calls.values()))()
        errs = {row: _rel_err(call(), ref) for row, call in calls.items()}  # (also autotunes the kernels)
        times = time_interleaved({row: (lambda c=call: c()) for row, call in calls.items()}, warmup=3, iters=10,
                                 rounds=rounds)
        bf16_ms = next(iter(times.values()))
        for row, ms in times.items():
            rows.append({"model": name, "gemm": gemm, "row": row, "experts": shape.experts, "M": m, "K": shape.k,
                         "N": shape.n, "max_rows": max(sizes), "ms": ms, "TFLOPS": flops / ms / 1e9,
                         "vs_bf16": bf16_ms / ms, "rel_err_vs_bf16": errs[row]})
        torch.cuda.empty_cache()
    calls = copies(shape)
    times = time_interleaved({row: (lambda c=call: c()) for row, (call, _) in calls.items()}, warmup=3, iters=10,
                             rounds=rounds)
    for row, ms in times.items():
        rows.append({"model": name, "gemm": "copy", "row": row, "experts": shape.experts, "K": shape.k, "N": shape.n,
                     "ms": ms, "GB/s": calls[row][1] / ms / 1e6})
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_grouped_gemm.py: error: needs a CUDA GPU (torch.cuda.is_available() is False)")
    from te_parallel.ops import grouped_block_gemm

    probe = torch.empty(1, 1, device="cuda").to(torch.float8_e4m3fn)
    if not grouped_block_gemm.usable(probe):
        sys.exit("bench_grouped_gemm.py: error: the Triton grouped kernel needs triton and an sm_90+ GPU (this one is "
                 f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}); pip install triton")
    rows = []
    for name in args.models:
        rows += measure(name, MODELS[name], args.align, args.rounds)
    report(f"Grouped MoE GEMMs on {torch.cuda.get_device_name()} (bf16 outputs; median ms of back-to-back calls, "
           f"interleaved rounds; expert rows aligned to {args.align})", rows,
           ["model", "gemm", "row", "experts", "M", "K", "N", "max_rows", "ms", "TFLOPS", "GB/s", "vs_bf16",
            "rel_err_vs_bf16"],
           args.json)


if __name__ == "__main__":
    main()
