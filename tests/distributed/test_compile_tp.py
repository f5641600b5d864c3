"""torch.compile of a tensor-parallel column + row Linear pair (TP=2, sequence parallelism off and on) under
FP8 delayed and current scaling: the compiled pair computes what the eager pair computes (outputs, input and parameter
gradients, FP8 scales and amax histories after three optimizer steps), in one graph with no graph break and
no recompilation after the first step. Launched from pytest (gloo on CPU, NCCL on GPUs)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import te_parallel as te
from te_parallel import recipe as R
from tests.distributed.harness import Checks, spawn

STEPS = 3


class _Pair(nn.Module):
    """Megatron's MLP shape without the activation: column-parallel fc1, row-parallel fc2."""

    def __init__(self, group, sp: bool, device) -> None:
        super().__init__()
        kw = dict(tp_group=group, sequence_parallel=sp, device=device)
        self.fc1 = te.Linear(64, 128, parallel_mode="column", **kw)
        self.fc2 = te.Linear(128, 64, parallel_mode="row", **kw)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def _steps(pair, fn, recipe, sp: bool, rank: int, world: int, device):
    """Outputs, gradients and FP8 state of STEPS training steps (the same inputs on every call)."""
    from torch._dynamo.utils import counters

    opt = torch.optim.SGD(pair.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    results, compiles = [], []
    for _ in range(STEPS):
        x_full = torch.randn(16, 2, 64, generator=gen)
        dy_full = torch.randn(16, 2, 64, generator=gen)
        x, dy = (x_full.chunk(world, 0)[rank], dy_full.chunk(world, 0)[rank]) if sp else (x_full, dy_full)
        x = x.to(device).requires_grad_()
        with te.fp8_autocast(fp8_recipe=recipe):
            y = fn(x)
        y.backward(dy.to(device))
        results += [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in pair.parameters()]
        opt.step()
        opt.zero_grad()
        compiles.append((counters["frames"]["total"], counters["stats"]["unique_graphs"]))
    results += [v.clone() for k, v in pair.state_dict().items() if "fp8_state" in k]
    return results, compiles


RECIPES = {"delayed": R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling()}


def _case(sp: bool, recipe, rank: int, world: int, group, device) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(7)
    eager, twin = _Pair(group, sp, device), _Pair(group, sp, device)
    twin.load_state_dict(eager.state_dict())
    want, _ = _steps(eager, eager, recipe, sp, rank, world, device)
    torch._dynamo.reset()
    counters.clear()
    got, compiles = _steps(twin, torch.compile(twin, backend="aot_eager"), recipe, sp, rank, world, device)
    breaks = dict(counters["graph_break"])
    assert not breaks, f"graph breaks: {list(breaks)}"
    assert compiles[0] == (1, 1) and len(set(compiles)) == 1, f"(frames, graphs) compiled after each step: {compiles}"
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got)):
        diff = (a.double() - b.double()).abs().max().item()
        assert torch.equal(a, b), f"result {i} of {len(want)} differs: max |diff| {diff:.3g}"


def _suite(rank, world, device):
    group = dist.new_group(list(range(world)))
    checks = Checks(rank)
    for sp in (False, True):
        for name, recipe in RECIPES.items():
            checks.run(f"compiled column+row pair sp={sp} {name}", _case, sp, recipe, rank, world, group, device)
    checks.raise_if_failed()


@pytest.mark.parametrize("world", [2])
def test_compiled_tp_pair_matches_eager(world):
    spawn(_suite, world)
