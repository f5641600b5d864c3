"""Tokens per second and model FLOPs utilisation (MFU) of the trainer.

MFU = model FLOPs of a step / (step time x peak FLOP/s of all the GPUs). The model FLOPs per token
are PaLM's (Chowdhery et al. 2022, appendix B): 6·N for the matmuls of the forward and backward,
N the parameters that multiply activations (all but the embedding table, a lookup), plus 12·L·h·s
for attention's two [s, s] products per layer (counted in full although causal attention skips
half: the usual convention, so that figures compare across codebases). Only the model's math
counts, not what the run chooses to spend (recomputation, communication), which is what makes
MFU comparable across layouts.
"""
from __future__ import annotations

import statistics
from typing import List, Optional

import torch

# Dense peak FLOP/s per GPU from NVIDIA's H100 and H200 datasheets (their tensor-core figures are
# quoted "with sparsity": the dense peak is half). SXM parts: BF16 989.4 TFLOP/s, FP8 1978.9 TFLOP/s,
# FP32 (no tensor cores) 67 TFLOP/s; the H100 PCIe and the NVL parts run lower clocks and power.
# First match of the name wins, so the specific parts come before the plain "H100" / "H200" (SXM).
PEAK_FLOPS = (
    ("H100 PCIe", {"fp8": 1513e12, "bf16": 756.5e12, "fp32": 51e12}),
    ("H100 NVL", {"fp8": 1670.5e12, "bf16": 835.5e12, "fp32": 60e12}),
    ("H200 NVL", {"fp8": 1670.5e12, "bf16": 835.5e12, "fp32": 60e12}),
    ("H100", {"fp8": 1978.9e12, "bf16": 989.4e12, "fp32": 67e12}),
    ("H200", {"fp8": 1978.9e12, "bf16": 989.4e12, "fp32": 67e12}),
)


def flops_per_token(matmul_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Forward + backward model FLOPs per trained token: 6·N + 12·L·h·s."""
    return 6.0 * matmul_params + 12.0 * layers * hidden * seq_len


def gemm_precision(fp8: str, precision: str) -> str:
    """The precision whose peak an MFU is quoted against: FP8 when the GEMMs run in FP8 (attention's
    own products stay in bf16, so this is the stricter figure), else the autocast dtype."""
    return "fp8" if fp8 != "off" else precision


def peak_flops(device: torch.device, precision: str) -> Optional[float]:
    """Peak FLOP/s of one device at `precision` ("fp8", "bf16", "fp32"); None when unknown (the CPU,
    or a GPU not in PEAK_FLOPS)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for part, peaks in PEAK_FLOPS:
        if part in name:
            return peaks.get(precision)
    return None


def mfu(flops_per_step: float, seconds: float, peak_per_device: Optional[float], devices: int) -> Optional[float]:
    if peak_per_device is None or seconds <= 0:
        return None
    return flops_per_step / (seconds * peak_per_device * devices)


def steady(values: List[float]) -> Optional[float]:
    """The median after the first tenth of the steps (at least the first step: it builds caches and
    communicators), or None without values."""
    if not values:
        return None
    skip = max(1, len(values) // 10) if len(values) > 1 else 0
    return statistics.median(values[skip:])


def summary(log: List[dict], peak_per_device: Optional[float], devices: int, precision: str, device: torch.device) -> str:
    """'212,992 tokens/s, MFU 41.3% (of 8 x 989 TFLOP/s bf16)' over the steady steps of `log`."""
    tokens = steady([r["tokens_per_s"] for r in log])
    if tokens is None:
        return "no steps timed"
    if peak_per_device is None:
        where = "on the CPU" if device.type != "cuda" else f"(no peak FLOP/s known for {torch.cuda.get_device_name(device)})"
        return f"{tokens:,.0f} tokens/s, MFU n/a {where}"
    util = steady([r["mfu"] for r in log if r.get("mfu") is not None])
    return (f"{tokens:,.0f} tokens/s, MFU {100 * util:.1f}% (of {devices} x {peak_per_device / 1e12:.0f} TFLOP/s "
            f"{precision})")
