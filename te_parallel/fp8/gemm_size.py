"""Recipe.min_fp8_gemm: the GEMM size below which an opted-in recipe runs a GEMM in bf16/fp16.

0 (the default, TE's semantics): every GEMM under fp8_autocast runs in FP8. A positive M·K·N is taken as
given: smaller GEMMs run in bf16. "auto" decides by the GEMM's intensity M·K·N / (M·K + K·N + M·N), the
GEMM work per element that the FP8 step casts (input, weight, output gradient): FP8 saves GEMM time in
proportion to M·K·N and pays casts in proportion to the elements, so the intensity, not the size,
separates the two (on an H100, 2048x2048x2048 gains 12% in FP8 while 512x8192x8192, 4x the work, loses
10%). BREAK_EVEN holds, per GPU architecture and quantizer family, the intensity that lost least GPU time
over a grid of te.Linear fwd+bwd steps (benchmarks/bench_linear.py --sweep; CUDA-graphed, so host time does
not count: a layer's host runs ahead of its GPU). What was measured is a family's casts
(te_parallel.fp8.gemm_quantizers), so the table is keyed by the class of the recipe's GEMM input quantizer
itself (a subclass casts otherwise: it was not measured). An architecture or a family that was not
measured gets no threshold, so "auto" never sends a GEMM to bf16 on a guess. Each choice is logged once
(logger "te_parallel", INFO), and each GEMM that runs in bf16 because of it too, with its size.
"""
from __future__ import annotations

import logging
from typing import Dict, Tuple

import torch

from te_parallel.fp8.gemm_quantizers import gemm_quantizers

# (major, minor) -> quantizer family (class name) -> break-even intensity, with the GPU and date of the
# sweep. At the 96 measured sizes the sm_90 values pick FP8 where it was slower once (0.99x) and bf16 where
# FP8 was faster once (1.03x) for delayed scaling; for current scaling 5x (worst 0.95x) and 2x (worst 1.03x).
BREAK_EVEN: Dict[Tuple[int, int], Dict[str, float]] = {
    (9, 0): {"DelayedScalingQuantizer": 630.0, "CurrentScalingQuantizer": 745.0}}
MEASURED_ON: Dict[Tuple[int, int], str] = {
    (9, 0): "measured on an H100 80GB HBM3, torch 2.11, 2026-11-24 (benchmarks/bench_linear.py --sweep)"}

_LOG = logging.getLogger("te_parallel")
_RESOLVED: Dict[Tuple[int, type], float] = {}  # (device index, recipe type) -> its threshold
_REPORTED: set = set()


def intensity(m: int, k: int, n: int) -> float:
    """M·K·N / (M·K + K·N + M·N): the GEMM work per element an FP8 fwd+bwd step of this GEMM casts."""
    return m * k * n / (m * k + k * n + m * n)


def auto_threshold(recipe, device: torch.device) -> float:
    """The break-even intensity of min_fp8_gemm="auto" for this recipe on `device` (0: none measured),
    resolved (and logged) once per device and recipe type, from its GEMM quantizer family."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, type(recipe))
    if key not in _RESOLVED:
        family = type(gemm_quantizers(recipe).input).__name__
        cap = torch.cuda.get_device_capability(index)
        resolved = BREAK_EVEN.get(cap, {}).get(family, 0.0)
        where = MEASURED_ON.get(cap, "not measured on this architecture: every GEMM in FP8")
        if cap in MEASURED_ON and family not in BREAK_EVEN.get(cap, {}):
            where = f"{family} not measured: every GEMM in FP8"
        _LOG.info("te_parallel: min_fp8_gemm='auto' on %s (sm_%d%d), %s under %s: GEMMs of intensity "
                  "M*K*N/(M*K+K*N+M*N) < %.0f run in bf16 (%s)", torch.cuda.get_device_name(index), cap[0], cap[1],
                  family, type(recipe).__name__, resolved, where)
        _RESOLVED[key] = resolved
    return _RESOLVED[key]


def below_threshold(recipe, m: int, k: int, n: int) -> bool:
    """True when the recipe's min_fp8_gemm sends this M x K x N GEMM (on the current CUDA device) to
    high precision; logs such a GEMM once per shape."""
    value = recipe.min_fp8_gemm
    if value == "auto":
        limit = auto_threshold(recipe, torch.device("cuda"))
        below, what = intensity(m, k, n) < limit, f"intensity {intensity(m, k, n):.0f} < {limit:.0f}"
    else:
        below, what = m * k * n < value, f"M*K*N {m * k * n:.3g} < {value:.3g}"
    if below and (m, k, n) not in _REPORTED:
        _REPORTED.add((m, k, n))
        _LOG.info("te_parallel: GEMM %dx%dx%d runs in bf16 (min_fp8_gemm=%r: %s)", m, k, n, value, what)
    return below
