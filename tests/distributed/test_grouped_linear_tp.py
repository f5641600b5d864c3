"""GroupedLinear under tensor parallelism, TP=2 (gloo on the CPU, NCCL on GPUs): column- and row-parallel against
the one-process layer built from the same full weights (output, input gradient, every expert's weight and bias
gradient), in high precision, under current scaling (amaxes all-reduced: TP=2 quantizes as one process) and under
block scaling (each rank's features are whole 1x128 tiles and 128x128 blocks). Then TE's contract
(tp_collectives=False): the layer leaves the row-parallel output and the column-parallel input gradient as
partial sums for the caller to reduce.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

import te_parallel as te
from te_parallel import recipe as R
from tests.distributed.harness import Checks, agree, spawn, worlds
from tests.reference import rel_err

RECIPES = {"off": None, "current": R.Float8CurrentScaling(), "block": R.Float8BlockScaling()}
G, K, N = 3, 256, 256  # per rank at TP=2: 128 features, whole tiles and blocks
COUNTS = [128, 0, 256]


def _tol(recipe_name: str, device: torch.device) -> float:
    if recipe_name == "off":
        return 1e-5
    return 1.2e-2 if device.type == "cuda" else 1e-5


def _shard(t: torch.Tensor, mode: str, rank: int, world: int, bias: bool = False) -> torch.Tensor:
    """This rank's piece of a full weight [N, K] (or bias [N]) of one expert."""
    if mode == "column":
        return t.chunk(world, 0)[rank]
    return t if bias else t.chunk(world, 1)[rank]


def _layers(mode, rank, world, group, device, collectives=True):
    torch.manual_seed(11)
    bias = collectives
    init = dict(init_method=lambda w: torch.nn.init.normal_(w, 0.0, 0.05), device=device)  # (the same on every rank)
    full = te.GroupedLinear(G, K, N, bias=bias, **init)
    with torch.no_grad():
        for g in range(G):
            getattr(full, f"weight{g}").mul_(2.0 ** g)
            if bias:
                getattr(full, f"bias{g}").normal_()
    tp = te.GroupedLinear(G, K, N, bias=bias, parallel_mode=mode, tp_group=group, tp_collectives=collectives, **init)
    with torch.no_grad():
        for name, p in tp.named_parameters():
            p.copy_(_shard(getattr(full, name), mode, rank, world, bias=name.startswith("bias")))
    return full, tp


def _run(layer, x, dy, m_splits, recipe):
    x = x.detach().clone().requires_grad_(True)
    with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = layer(x, m_splits)
    y.backward(dy)
    return y.detach(), x.grad


def _case(mode, recipe_name, splits_as, rank, world, group, device):
    recipe = RECIPES[recipe_name]
    full, tp = _layers(mode, rank, world, group, device)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(sum(COUNTS), K, generator=gen) * 2.0 ** torch.randint(-3, 4, (sum(COUNTS), 1), generator=gen))
    dy = torch.randn(sum(COUNTS), N, generator=gen)
    x, dy = x.to(device), dy.to(device)
    m_splits = COUNTS if splits_as == "list" else torch.tensor(COUNTS, device=device)
    y_ref, dx_ref = _run(full, x, dy, m_splits, recipe)
    col = mode == "column"
    y, dx = _run(tp, x if col else x.chunk(world, 1)[rank], dy.chunk(world, 1)[rank] if col else dy, m_splits, recipe)
    tol = _tol(recipe_name, device)

    def local():
        want_y = y_ref.chunk(world, 1)[rank] if col else y_ref
        want_dx = dx_ref if col else dx_ref.chunk(world, 1)[rank]
        assert rel_err(y.cpu(), want_y.cpu()) < tol, f"output: {rel_err(y.cpu(), want_y.cpu()):.2e}"
        assert rel_err(dx.cpu(), want_dx.cpu()) < tol, f"input grad: {rel_err(dx.cpu(), want_dx.cpu()):.2e}"
        for name, p in tp.named_parameters():
            want = _shard(getattr(full, name).grad, mode, rank, world, bias=name.startswith("bias"))
            if not want.any():  # (the empty expert)
                assert not p.grad.any(), f"{name}: nonzero gradient of an expert without tokens"
                continue
            assert rel_err(p.grad.cpu(), want.cpu()) < tol, f"grad of {name}: {rel_err(p.grad.cpu(), want.cpu()):.2e}"

    agree(group, device, local)


def _te_contract(mode, rank, world, group, device):
    """tp_collectives=False: the row-parallel y and the column-parallel dx are partial sums over the ranks."""
    full, tp = _layers(mode, rank, world, group, device, collectives=False)
    gen = torch.Generator().manual_seed(4)
    x, dy = torch.randn(sum(COUNTS), K, generator=gen).to(device), torch.randn(sum(COUNTS), N, generator=gen).to(device)
    y_ref, dx_ref = _run(full, x, dy, COUNTS, None)
    col = mode == "column"
    y, dx = _run(tp, x if col else x.chunk(world, 1)[rank], dy.chunk(world, 1)[rank] if col else dy, COUNTS, None)
    partial = dx if col else y
    total = partial.clone()
    dist.all_reduce(total, group=group)

    def local():
        assert rel_err(partial.cpu(), (dx_ref if col else y_ref).cpu()) > 1e-2, "the partial sum was already reduced"
        assert rel_err(total.cpu(), (dx_ref if col else y_ref).cpu()) < 1e-5

    agree(group, device, local)


def _suite(rank, world, device):
    group = dist.new_group(list(range(world)))
    checks = Checks(rank)
    for mode, recipe_name, splits_as in itertools.product(("column", "row"), RECIPES, ("list", "tensor")):
        checks.run(f"{mode} fp8={recipe_name} m_splits as a {splits_as}", _case, mode, recipe_name, splits_as, rank,
                   world, group, device)
    for mode in ("column", "row"):
        checks.run(f"{mode} tp_collectives=False leaves partial sums", _te_contract, mode, rank, world, group, device)
    checks.raise_if_failed()


@pytest.mark.parametrize("world", worlds(2))
def test_grouped_linear_tp(world):
    spawn(_suite, world)
