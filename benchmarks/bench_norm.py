"""LayerNorm / RMSNorm: native kernels vs PyTorch's, against copy bandwidth, all in the same run.

    python benchmarks/bench_norm.py [--json out.json]

bf16 x, gamma and beta. Bytes counted (what the op must move, per element of x):
  fwd, bf16 out:           read x + write y                     2 + 2 = 4
  fwd, FP8 out + transpose: read x + write FP8 + write FP8ᵀ      2 + 1 + 1 = 4
                           (the native path moves 6: its transpose re-reads the FP8 output)
  bwd:                     read dy + read x + write dx           2 + 2 + 2 = 6
mu/rsigma and the [hidden] parameters are ignored. Copy: x.clone() (read + write 2 bytes each).
Torch baselines: F.layer_norm / F.rms_norm forward, their autograd backward (torch.autograd.grad
of x, gamma, beta), and for FP8 the norm followed by the cast + transpose as separate ops; "torch norm +
te cast" is torch's norm followed by te_parallel's cast-transpose kernel (what a module runs without the
fused norm). Shapes: [tokens, 4096] for 4096, 8192 and 16384 tokens (the Llama layer's 4096).

ms: CUDA events around one call from an idle GPU (the host's launch time included); kernel_ms: the
call's kernels alone (torch.profiler, summed over the call), the GPU time inside a training step.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, time_cuda  # noqa: E402
from te_parallel.native import norm as norm_kernels  # noqa: E402
from te_parallel.ops.cast import quantize  # noqa: E402

EPS = 1e-5


def torch_fp8(y, scale, amax):
    torch.maximum(amax, y.abs().amax().float().view(1), out=amax)
    data = (y.float() * scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data, data.t().contiguous()


def cases(norm: str, x, w, b, dy, scale, amax):
    """(name, fn, bytes per element) for one norm; native and torch side by side."""
    h = x.shape[1]
    spec = norm_kernels.FP8NormOutput(scale, torch.float8_e4m3fn, amax, transpose=True)
    if norm == "LayerNorm":
        def nat_fwd(**kw):
            return norm_kernels.layer_norm_fwd(x, w, b, EPS, **kw)

        _, mu, rs = nat_fwd()
        nat_bwd = lambda: norm_kernels.layer_norm_bwd(dy, x, mu, rs, w)  # noqa: E731
        torch_fwd = lambda: F.layer_norm(x, (h,), w, b, EPS)  # noqa: E731
    else:
        def nat_fwd(**kw):
            return norm_kernels.rms_norm_fwd(x, w, EPS, **kw)

        _, rs = nat_fwd()
        nat_bwd = lambda: norm_kernels.rms_norm_bwd(dy, x, rs, w)  # noqa: E731
        torch_fwd = lambda: F.rms_norm(x, (h,), w, EPS)  # noqa: E731
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    bg = b.detach().requires_grad_(True)
    yg = F.layer_norm(xg, (h,), wg, bg, EPS) if norm == "LayerNorm" else F.rms_norm(xg, (h,), wg, EPS)
    inputs = (xg, wg, bg) if norm == "LayerNorm" else (xg, wg)
    torch_bwd = lambda: torch.autograd.grad(yg, inputs, dy, retain_graph=True)  # noqa: E731
    return [
        ("fwd bf16", "native", nat_fwd, 4),
        ("fwd bf16", "torch", torch_fwd, 4),
        ("fwd fp8+T", "native", lambda: nat_fwd(fp8=spec), 4),
        ("fwd fp8+T", "torch (norm, cast, T)", lambda: torch_fp8(torch_fwd(), scale, amax), 4),
        ("fwd fp8+T", "torch norm + te cast", lambda: quantize(torch_fwd(), scale[0], torch.float8_e4m3fn, amax_out=amax,
                                                               transpose=True), 4),
        ("bwd", "native", nat_bwd, 6),
        ("bwd", "torch autograd", torch_bwd, 6),
    ]


def kernel_ms(fn, calls: int = 20) -> float:
    """GPU time of fn's kernels per call (torch.profiler's device time, summed)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time_total
    return sum(per.values()) / calls / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for m, n in [(4096, 4096), (8192, 4096), (16384, 4096)]:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 + 1
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
        scale, amax = torch.tensor([2.0], device="cuda"), torch.zeros(1, device="cuda")
        copy_k = kernel_ms(lambda: x.clone())
        copy_bw = 4 * m * n / copy_k / 1e6
        rows.append({"shape": f"{m}x{n}", "norm": "-", "op": "copy (x.clone)", "impl": "torch",
                     "ms": time_cuda(lambda: x.clone()), "kernel_ms": copy_k, "GB_s": copy_bw, "vs_copy_bw": 1.0,
                     "native_speedup": None})
        for norm in ("LayerNorm", "RMSNorm"):
            first = {}
            for op, impl, fn, per_elem in cases(norm, x, w, b, dy, scale, amax):
                k = kernel_ms(fn)
                bw = per_elem * m * n / k / 1e6
                first.setdefault(op, k)  # the native row comes first
                rows.append({"shape": f"{m}x{n}", "norm": norm, "op": op, "impl": impl, "ms": time_cuda(fn),
                             "kernel_ms": k, "GB_s": bw, "vs_copy_bw": bw / copy_bw,
                             "native_speedup": None if impl == "native" else k / first[op]})
    report("LayerNorm / RMSNorm, bf16 x (median ms from an idle GPU; kernel ms per call; GB/s of the bytes the op "
           "must move at the kernel time; native_speedup: this row's kernel time over the native row's)", rows,
           ["shape", "norm", "op", "impl", "ms", "kernel_ms", "GB_s", "vs_copy_bw", "native_speedup"], args.json)


if __name__ == "__main__":
    main()
