"""Where the GPT layer's FP8 step reaches its peak memory: allocated and peak at each backward node.

    python benchmarks/memory_by_node.py [--recipe delayed|current|bf16]

The GPT TransformerLayer (h 4096, ffn 16384, 32 heads, s 2048 × b 4, bf16 params), FP8 DelayedScaling
(or the recipe given), with the MLP as one Function (ops/mlp.py: FP8 activation casts, backward in row chunks) and as
separate Functions. Each step starts with cleared gradients
and no FP8 weight copies; the memory before it is the zero. Printed for the third step: memory
after the forward (and the forward's peak), then per autograd node in execution order the memory
allocated after it and the peak since the previous node (MiB).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import training_step  # noqa: E402
from te_parallel import recipe  # noqa: E402
from te_parallel.module import layernorm_mlp  # noqa: E402

RECIPES = {"delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
           "current": recipe.Float8CurrentScaling(), "bf16": None}


def run(fuse, name="delayed"):
    saved = layernorm_mlp.can_fuse
    if not fuse:
        layernorm_mlp.can_fuse = lambda *a: False
    torch.manual_seed(0)
    layer = te.TransformerLayer(4096, 16384, 32, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(2048, 4, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    rec = RECIPES[name]
    step = training_step(layer, x, dy, rec)
    for it in range(3):
        step.clear_grads()
        step.drop_fp8_weights()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
            y = layer(x)
        torch.cuda.synchronize()
        fwd_alloc, fwd_peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
        log = []
        seen = set()
        stack = [y.grad_fn]
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            def hook(gi, go, name=type(n).__name__):
                log.append((name, (torch.cuda.memory_allocated() - base) / 2**20, (torch.cuda.max_memory_allocated() - base) / 2**20))
                torch.cuda.reset_peak_memory_stats()
            n.register_hook(hook)
            stack.extend(f for f, _ in n.next_functions)
        y.backward(dy)
        torch.cuda.synchronize()
        if it == 2:
            print(f"{name} fuse={fuse}: after forward {fwd_alloc/2**20:.0f} MiB (forward peak {fwd_peak/2**20:.0f}); backward nodes (allocated after, peak during since previous):")
            for name, a, pk in log:
                if name != "AccumulateGrad":
                    print(f"   {name:<40} {a:8.0f} {pk:8.0f}")
        del y
    layernorm_mlp.can_fuse = saved

if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="delayed", choices=list(RECIPES))
    args = ap.parse_args()
    run(True, args.recipe)
    run(False, args.recipe)
