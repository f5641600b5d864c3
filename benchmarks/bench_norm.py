"""LayerNorm / RMSNorm: native kernels vs PyTorch's, against copy bandwidth, all in the same run.

    python benchmarks/bench_norm.py [--json out.json]

bf16 x, gamma and beta. Bytes counted (what the op must move, per element of x):
  fwd, bf16 out:           read x + write y                     2 + 2 = 4
  fwd, FP8 out + transpose: read x + write FP8 + write FP8ᵀ      2 + 1 + 1 = 4
                           (the native path moves 6: its transpose re-reads the FP8 output)
  bwd:                     read dy + read x + write dx           2 + 2 + 2 = 6
mu/rsigma and the [hidden] parameters are ignored. Copy: x.clone() (read + write 2 bytes each).
Torch baselines: F.layer_norm / F.rms_norm forward, their autograd backward (torch.autograd.grad
of x, gamma, beta), and for FP8 the norm followed by the cast + transpose as separate ops.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import report, time_cuda  # noqa: E402
from te_parallel.native import norm as norm_kernels  # noqa: E402

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
        ("bwd", "native", nat_bwd, 6),
        ("bwd", "torch autograd", torch_bwd, 6),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for m, n in [(8192, 4096), (16384, 4096)]:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 + 1
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
        scale, amax = torch.tensor([2.0], device="cuda"), torch.zeros(1, device="cuda")
        copy_ms = time_cuda(lambda: x.clone())
        copy_bw = 4 * m * n / copy_ms / 1e6
        rows.append({"shape": f"{m}x{n}", "norm": "-", "op": "copy (x.clone)", "impl": "torch", "ms": copy_ms,
                     "GB_s": copy_bw, "vs_copy_bw": 1.0, "speedup_vs_torch": None})
        for norm in ("LayerNorm", "RMSNorm"):
            timed = {}
            for op, impl, fn, per_elem in cases(norm, x, w, b, dy, scale, amax):
                ms = time_cuda(fn)
                bw = per_elem * m * n / ms / 1e6
                timed.setdefault(op, []).append(ms)
                rows.append({"shape": f"{m}x{n}", "norm": norm, "op": op, "impl": impl, "ms": ms, "GB_s": bw,
                             "vs_copy_bw": bw / copy_bw, "speedup_vs_torch": None})
            for r in rows:
                if r["norm"] == norm and r["shape"] == f"{m}x{n}" and r["impl"] == "native":
                    native_ms, torch_ms = timed[r["op"]]
                    r["speedup_vs_torch"] = torch_ms / native_ms
    report("LayerNorm / RMSNorm, bf16 x (median ms; GB/s of the bytes the op must move)", rows,
           ["shape", "norm", "op", "impl", "ms", "GB_s", "vs_copy_bw", "speedup_vs_torch"], args.json)


if __name__ == "__main__":
    main()
