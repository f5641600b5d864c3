"""Training step of a Llama-style stack with FP8 weights (quantized_model_init) against bf16 weights, one GPU.

    python benchmarks/bench_fp8_params.py [--hidden 4096 --ffn 14336 --heads 32 --kv-groups 8 --layers 2
                                           --seq 4096 --batch 1] [--json out.json]

Every row trains te.TransformerLayer blocks (RMSNorm, SwiGLU, GQA, no bias, causal) with fp32 master
weights (te.MasterWeights) and torch.optim.AdamW on them; the model's parameters are bf16, or FP8 for
the GEMM weights (quantized_model_init, nominal dtype bf16) with the norms in bf16. A step is
forward + backward + masters.step(opt): gradients to the masters, AdamW, the weights written back
(FP8 weights quantized, one amax and one cast per weight). Rows: bf16 weights in bf16 compute (the
baseline of `speedup`), bf16 weights in FP8 compute (each weight cast to FP8 in every forward), FP8
weights (no weight cast), under delayed and current scaling.

`step_ms` (the whole step) and `fwd_bwd_ms` (forward + backward from cleared gradients, no optimizer)
are per step with steps issued back to back, the median over rounds in which every row runs
(common.time_interleaved). Memory is measured per row alone (the others freed): `weights_GiB` is the
model's parameter storage, `held_GiB` what stays allocated between steps (weights, masters, AdamW's
state, FP8 scaling state), `peak_GiB` torch.cuda.max_memory_allocated() during one step.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import report, time_interleaved  # noqa: E402
from te_parallel import recipe  # noqa: E402
from te_parallel.fp8.params import Float8Weight  # noqa: E402

GiB = 2**30
RECIPES = {"delayed": recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max"),
           "current": recipe.Float8CurrentScaling()}
# (row name, weights built under this recipe or None for bf16, compute recipe or None for bf16)
ROWS = [("bf16 weights, bf16 compute", None, None),
        ("bf16 weights, FP8 delayed", None, "delayed"),
        ("FP8 weights, FP8 delayed", "delayed", "delayed"),
        ("bf16 weights, FP8 current", None, "current"),
        ("FP8 weights, FP8 current", "current", "current")]


class Run:
    """One row's model, masters, optimizer and inputs, with its two step functions."""

    def __init__(self, a, weights, compute) -> None:
        region = (te.quantized_model_init(recipe=RECIPES[weights]) if weights is not None
                  else contextlib.nullcontext())
        torch.manual_seed(0)
        with region:
            self.model = torch.nn.Sequential(*[
                te.TransformerLayer(a.hidden, a.ffn, a.heads, num_gqa_groups=a.kv_groups, bias=False,
                                    activation="swiglu", normalization="RMSNorm", hidden_dropout=0.0,
                                    attention_dropout=0.0, params_dtype=torch.bfloat16, device="cuda")
                for _ in range(a.layers)])
        self.masters = te.MasterWeights(self.model.parameters())
        self.opt = torch.optim.AdamW(self.masters.parameters(), lr=1e-5)
        self.recipe = RECIPES[compute] if compute is not None else None
        self.x = torch.randn(a.seq, a.batch, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        self.dy = torch.randn_like(self.x)

    def _fwd_bwd(self) -> None:
        self.x.grad = None
        for p in self.model.parameters():
            p.grad = None
        with te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe):
            y = self.model(self.x)
        y.backward(self.dy)

    def step(self) -> None:
        self._fwd_bwd()
        self.masters.step(self.opt)

    def fwd_bwd(self) -> None:
        self._fwd_bwd()

    def weights_bytes(self) -> int:
        total = 0
        for p in self.model.parameters():
            total += p._data.numel() if isinstance(p, Float8Weight) else p.numel() * p.element_size()
        return total


def memory_row(a, weights, compute) -> dict:
    """This row alone on the GPU: parameter bytes, what stays allocated between steps, the step's peak."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    run = Run(a, weights, compute)
    for _ in range(3):  # AdamW's state, FP8 histories and the allocator's pools exist after these
        run.step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    run.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    row = {"weights_GiB": run.weights_bytes() / GiB, "held_GiB": held / GiB, "peak_GiB": peak / GiB}
    del run
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in dict(hidden=4096, ffn=14336, heads=32, kv_groups=8, layers=2, seq=4096, batch=1).items():
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=v)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    memory = {name: memory_row(a, w, c) for name, w, c in ROWS}
    gc.collect()
    torch.cuda.empty_cache()
    runs = {name: Run(a, w, c) for name, w, c in ROWS}
    steps = {f"{name} | step": runs[name].step for name in runs}
    steps.update({f"{name} | fwd_bwd": runs[name].fwd_bwd for name in runs})
    times = time_interleaved(steps, warmup=3, iters=5, rounds=5)
    base = times[f"{ROWS[0][0]} | step"]
    rows = [{"case": name, "step_ms": times[f"{name} | step"], "speedup": base / times[f"{name} | step"],
             "fwd_bwd_ms": times[f"{name} | fwd_bwd"], **memory[name]} for name, _, _ in ROWS]
    shape = (f"h{a.hidden} ffn{a.ffn} heads{a.heads}/{a.kv_groups} x{a.layers} layers s{a.seq} b{a.batch}, "
             f"fp32 masters + AdamW")
    report(f"Llama-style stack training step, FP8 vs bf16 weights ({shape}; ms per step back to back)", rows,
           ["case", "step_ms", "speedup", "fwd_bwd_ms", "weights_GiB", "held_GiB", "peak_GiB"], a.json)


if __name__ == "__main__":
    main()
