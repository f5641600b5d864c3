"""Mixture-of-Experts GEMMs and layers: te_parallel's GroupedLinear and MoE layer beside torch and TE, same run.

    python benchmarks/bench_moe.py [--cases qwen3 mixtral] [--part gemms layer host] [--energy SECONDS]
                                   [--json out.json]

--part gemms: the expert fc1 GEMMs fwd+bwd (routed rows x hidden -> 2 x expert FFN), rows
  torch loop bf16        a Python loop of F.linear over the experts (what a plain PyTorch MoE does)
  torch grouped bf16     torch._grouped_mm, one call per GEMM kind (autograd through it)
  te bf16                te_parallel.GroupedLinear outside fp8_autocast
  te fp8 delayed / current / block   te_parallel.GroupedLinear in fp8_autocast(recipe), weights recast every step
  te fp8 <recipe>, m_splits on GPU   the same with m_splits an int tensor on the device (no host copy)
  te fp8 delayed E4M3    DelayedScaling(fp8_format=E4M3): E4M3 gradients, every GEMM on torch._scaled_grouped_mm
                         (HYBRID's E5M2 dgrad and wgrad run on the Triton grouped kernel)
  TE bf16 / TE fp8 delayed / current / block   NVIDIA Transformer Engine's GroupedLinear, when it is installed
--part layer: a whole MoE layer (router, permute, fc1, SwiGLU, fc2, unpermute), te_parallel.MoELayer in bf16 and
  each FP8 recipe, against the same layer written in torch bf16 on torch._grouped_mm; with peak memory.
--part host: the host's time to issue one MoE-layer step with 128 experts and with 8 (same tokens and sizes),
  queued behind a GPU sleep so the host never waits: its growth with the number of experts.

Cases (Qwen3-30B-A3B-like and Mixtral-8x7B-like expert fc1):
  qwen3    128 experts, top-8, hidden 2048 -> 2 x 768, 16,384 tokens (131,072 routed rows)
  mixtral  8 experts, top-2, hidden 4096 -> 2 x 14,336, 8,192 tokens (16,384 routed rows)
Each expert's rows are a multiple of 128 (as Fp8Padding makes them under block scaling), drawn once from a fixed
seed so that they are uneven, as routing makes them; every row sees the same splits. "ms" is per step with steps
issued back to back, the median of rounds that each time every row (common.time_interleaved); --energy adds
joules per step at the power limit (common.energy_interleaved). Speedups are against "torch grouped bf16".
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import (Parser, energy_interleaved, report, report_energy, te_recipe, time_interleaved,  # noqa: E402
                    transformer_engine)
from te_parallel import recipe  # noqa: E402

CASES = {"qwen3": dict(experts=128, topk=8, hidden=2048, ffn=768, tokens=16384),
         "mixtral": dict(experts=8, topk=2, hidden=4096, ffn=14336, tokens=8192)}
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling, "block": recipe.Float8BlockScaling}
ALIGN = 128


def routed_splits(experts: int, rows: int, seed: int = 0) -> list:
    """Uneven per-expert row counts, each a multiple of ALIGN, summing to `rows` (rows % ALIGN == 0)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=g) + 0.25
    units = torch.multinomial(weights, rows // ALIGN, replacement=True, generator=g)
    return (torch.bincount(units, minlength=experts) * ALIGN).tolist()


def _grouped_offsets(splits: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(splits, 0, dtype=torch.int32)


class TorchGrouped(torch.nn.Module):
    """The experts' GEMM in torch bf16 on torch._grouped_mm: y[rows of e] = x[rows of e] · W_eᵀ."""

    def __init__(self, experts: int, k: int, n: int, device, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, n, k, device=device, dtype=dtype) * k ** -0.5)

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.weight.transpose(1, 2), offs=offs)


def _step(module, x, dy, region, call):
    params = list(module.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        drop = getattr(module, "drop_fp8_weight_cache", None)
        if drop is not None:
            drop()
        with region():
            y = call()
        y.backward(dy)
    return step


def runnable(steps: dict) -> dict:
    """The steps that run: each is called once; one that raises is reported in one line and left out (a row that
    cannot run on this GPU or library version must not take the other rows down with it)."""
    kept = {}
    for name, step in steps.items():
        try:
            step()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 (reported, and the row is left out)
            print(f"bench_moe: row {name!r} left out: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        kept[name] = step
    return kept


def bench_gemms(name: str, energy):
    c, dev, dt = CASES[name], "cuda", torch.bfloat16
    rows_total, k, n = c["tokens"] * c["topk"], c["hidden"], 2 * c["ffn"]
    splits = routed_splits(c["experts"], rows_total)
    splits_dev = torch.tensor(splits, device=dev, dtype=torch.int64)
    offs = _grouped_offsets(splits_dev)
    x = torch.randn(rows_total, k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(rows_total, n, device=dev, dtype=dt)

    def region(rec=None, lib=te):
        return lambda: lib.fp8_autocast(enabled=rec is not None, fp8_recipe=rec)

    loop = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt) for _ in range(c["experts"]))
    grouped = TorchGrouped(c["experts"], k, n, dev, dt)
    steps = {
        "torch loop bf16": _step(loop, x, dy, region(), lambda: torch.cat(
            [lin(part) for lin, part in zip(loop, torch.split(x, splits))])),
        "torch grouped bf16": _step(grouped, x, dy, region(), lambda: grouped(x, offs)),
    }
    mine = te.GroupedLinear(c["experts"], k, n, bias=False, params_dtype=dt, device=dev)
    steps["te bf16"] = _step(mine, x, dy, region(), lambda: mine(x, splits))
    for kind, cls in RECIPES.items():
        steps[f"te fp8 {kind}"] = _step(mine, x, dy, region(cls()), lambda: mine(x, splits))
        steps[f"te fp8 {kind}, m_splits on GPU"] = _step(mine, x, dy, region(cls()), lambda: mine(x, splits_dev))
    e4m3 = recipe.DelayedScaling(fp8_format=recipe.Format.E4M3)
    steps["te fp8 delayed E4M3"] = _step(mine, x, dy, region(e4m3), lambda: mine(x, splits))
    peer = transformer_engine()
    if peer is not None:
        theirs = peer.GroupedLinear(c["experts"], k, n, bias=False, params_dtype=dt, device=dev)
        steps["TE bf16"] = _step(theirs, x, dy, region(None, peer), lambda: theirs(x, splits))
        for kind in RECIPES:
            steps[f"TE fp8 {kind}"] = _step(theirs, x, dy, region(te_recipe(kind), peer), lambda: theirs(x, splits))
    steps = runnable(steps)
    ms = time_interleaved(steps, iters=10, rounds=5)
    flops = 3 * 2 * rows_total * k * n
    base = ms.get("torch grouped bf16", float("nan"))
    out = [{"case": name, "row": r, "ms": t, "tflops": flops / t / 1e9, "speedup_vs_grouped_bf16": base / t}
           for r, t in ms.items()]
    te_fp8 = {kind: ms.get(f"TE fp8 {kind}") for kind in RECIPES}
    for row in out:
        kind = row["row"].removeprefix("te fp8 ").split(",")[0]
        if row["row"].startswith("te fp8") and te_fp8.get(kind):
            row["vs_TE_same_recipe"] = te_fp8[kind] / row["ms"]
    if energy is not None:
        got = energy_interleaved(steps, ms, seconds=energy)
        for row in out:
            row.update(got[row["row"]])
    return out


class TorchMoE(torch.nn.Module):
    """An MoE layer in torch bf16 on torch._grouped_mm: softmax top-k router, permute by sorting (token,
    expert) pairs by expert, fc1, SwiGLU, fc2, weighted unpermute (index_add)."""

    def __init__(self, experts, topk, hidden, ffn, device, dtype):
        super().__init__()
        self.experts, self.topk = experts, topk
        self.router = torch.nn.Linear(hidden, experts, bias=False, device=device, dtype=dtype)
        self.fc1 = torch.nn.Parameter(torch.randn(experts, 2 * ffn, hidden, device=device, dtype=dtype)
                                      * hidden ** -0.5)
        self.fc2 = torch.nn.Parameter(torch.randn(experts, hidden, ffn, device=device, dtype=dtype) * ffn ** -0.5)

    def forward(self, x):  # x [tokens, hidden]
        probs, idx = torch.topk(torch.softmax(self.router(x).float(), -1), self.topk, dim=-1)  # [tokens, topk]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.topk
        counts = torch.bincount(flat, minlength=self.experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x[token], self.fc1.transpose(1, 2), offs=offs)  # [routed, 2 ffn]
        a, b = h.chunk(2, dim=-1)
        h = torch._grouped_mm(F.silu(a) * b, self.fc2.transpose(1, 2), offs=offs)  # [routed, hidden]
        w = probs.reshape(-1)[order].to(h.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, token, h * w)


def bench_layer(name: str, energy):
    c, dev, dt = CASES[name], "cuda", torch.bfloat16
    x = torch.randn(c["tokens"], c["hidden"], device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    base = TorchMoE(c["experts"], c["topk"], c["hidden"], c["ffn"], dev, dt)
    mine = te.MoELayer(c["hidden"], c["ffn"], c["experts"], c["topk"], params_dtype=dt, device=dev)
    steps = {"torch grouped bf16 layer": _step(base, x, dy, lambda: te.fp8_autocast(enabled=False), lambda: base(x)),
             "te bf16 layer": _step(mine, x, dy, lambda: te.fp8_autocast(enabled=False), lambda: mine(x))}
    for kind, cls in RECIPES.items():
        steps[f"te fp8 {kind} layer"] = _step(mine, x, dy, lambda cls=cls: te.fp8_autocast(enabled=True,
                                                                                          fp8_recipe=cls()),
                                               lambda: mine(x))
    steps = runnable(steps)
    ms = time_interleaved(steps, iters=10, rounds=5)
    peaks = {}
    for row, step in steps.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peaks[row] = (torch.cuda.max_memory_allocated() - start) / 2 ** 30
    b = ms.get("torch grouped bf16 layer", float("nan"))
    out = [{"case": name, "row": r, "ms": t, "speedup_vs_torch_layer": b / t, "peak_GiB_over_inputs": peaks[r],
            "memory_vs_torch_layer": peaks[r] / peaks.get("torch grouped bf16 layer", float("nan"))}
           for r, t in ms.items()]
    if energy is not None:
        got = energy_interleaved(steps, ms, seconds=energy)
        for row in out:
            row.update(got[row["row"]])
    return out


def bench_host(rounds: int = 9):
    """Host ms to issue one MoE-layer fwd+bwd with 128 and with 8 experts (qwen3's sizes otherwise), queued
    behind a GPU sleep; under each recipe."""
    c, dev, dt = CASES["qwen3"], "cuda", torch.bfloat16
    x = torch.randn(4096, c["hidden"], device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    rows = []
    for kind in (None, *RECIPES):
        got = {}
        for experts in (128, 8):
            layer = te.MoELayer(c["hidden"], c["ffn"], experts, c["topk"], params_dtype=dt, device=dev)
            rec = RECIPES[kind]() if kind else None
            step = _step(layer, x, dy, lambda rec=rec: te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec),
                         lambda layer=layer: layer(x))
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            samples = []
            for _ in range(rounds):
                torch.cuda._sleep(int(3e8))
                t0 = time.perf_counter()
                for _ in range(3):
                    step()
                samples.append((time.perf_counter() - t0) / 3 * 1e3)
                torch.cuda.synchronize()
            got[experts] = sorted(samples)[len(samples) // 2]
        rows.append({"recipe": kind or "bf16", "host_ms_128_experts": got[128], "host_ms_8_experts": got[8],
                     "ratio_128_over_8": got[128] / got[8]})
    return rows


def parse_args(argv=None):
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--part", nargs="+", default=["gemms", "layer", "host"], choices=["gemms", "layer", "host"])
    ap.add_argument("--energy", type=float, default=None, metavar="SECONDS",
                    help="joules per step over SECONDS of back-to-back steps per row (NVML)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.energy is not None and args.energy <= 0:
        ap.error(f"--energy {args.energy}: need a positive number of seconds")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe needs a CUDA GPU")
    results = {}
    if "gemms" in args.part:
        rows = [r for name in args.cases for r in bench_gemms(name, args.energy)]
        report("MoE expert fc1 GEMMs fwd+bwd (ms per step back to back)", rows,
               ["case", "row", "ms", "tflops", "speedup_vs_grouped_bf16", "vs_TE_same_recipe"], None)
        if args.energy is not None:
            report_energy(rows, args.energy, ["case", "row"])
        results["gemms"] = rows
    if "layer" in args.part:
        rows = [r for name in args.cases for r in bench_layer(name, args.energy)]
        report("MoE layer fwd+bwd (router, permute, fc1, SwiGLU, fc2, unpermute)", rows,
               ["case", "row", "ms", "speedup_vs_torch_layer", "peak_GiB_over_inputs", "memory_vs_torch_layer"], None)
        if args.energy is not None:
            report_energy(rows, args.energy, ["case", "row"])
        results["layer"] = rows
    if "host" in args.part:
        rows = bench_host()
        report("MoE layer host issue time, 128 against 8 experts (qwen3 sizes, 4096 tokens)", rows,
               ["recipe", "host_ms_128_experts", "host_ms_8_experts", "ratio_128_over_8"], None)
        results["host"] = rows
    if args.json:
        report("bench_moe", [r for part in results.values() for r in part], ["case", "row", "ms"], args.json)


if __name__ == "__main__":
    main()
