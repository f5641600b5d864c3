"""A small FP8 training run: te.LayerNormMLP blocks learn a fixed random teacher network.

    python examples/fp8_demo.py [--steps 150] [--recipe delayed|current|off] [--device cpu|cuda]

Runs on the CPU by default when no GPU is present (real FP8 numerics, not speed). Prints the
loss every 25 steps and, at the end, the loss of the same run without FP8 for comparison.
"""
from __future__ import annotations

import argparse

import torch

import te_parallel as te
from te_parallel import recipe

HIDDEN, FFN, TOKENS = 128, 512, 256


class Student(torch.nn.Module):
    def __init__(self, device) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            te.LayerNormMLP(HIDDEN, FFN, activation="swiglu", normalization="RMSNorm", device=device) for _ in range(2)
        )
        self.head = te.Linear(HIDDEN, HIDDEN, device=device)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def train(fp8_recipe, steps: int, device: str, log: bool) -> float:
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN)).to(device)
    model = Student(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        x = torch.randn(TOKENS, HIDDEN, device=device)
        with torch.no_grad():
            target = teacher(x)
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log and (step % 25 == 0 or step == 1):
            scale = model.head.fp8_state.fwd_scale[0].item()
            print(f"step {step:4d}  loss {loss.item():.4f}  head input scale {scale:.1f}")
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--recipe", choices=["delayed", "current", "off"], default="delayed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    recipes = {"delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16),
               "current": recipe.Float8CurrentScaling(), "off": None}
    print(f"training on {args.device} with FP8 recipe: {args.recipe}")
    final = train(recipes[args.recipe], args.steps, args.device, log=True)
    baseline = train(None, args.steps, args.device, log=False)
    print(f"final loss {final:.4f} (FP8 {args.recipe}) vs {baseline:.4f} (no FP8)")


if __name__ == "__main__":
    main()
