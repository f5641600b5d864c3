"""make_graphed_callables for FP8 modules: CUDA graphs whose replays also cast weights and update scales.

Each callable is wrapped so that its forward runs inside its own fp8_autocast region; capture then
records, besides the GEMMs and casts, the weight casts (the quantized-weight cache is bypassed while
capturing, so every replay re-casts the current weights), the amax recording and the region's exit
update of the forward scales; the backward graph records the end-of-backward scale update (it runs
in the autograd engine's final callback, inside the captured `torch.autograd.grad`). Replays
therefore keep delayed scaling alive with no Python on the path.

Limits: call the graphed callables outside any fp8_autocast (they carry their own region);
clear gradients with `zero_grad(set_to_none=True)` (p.grad may be the graph's static output buffer);
DelayedScaling(interval=1) only (a replay cannot count steps on the host); the shapes, dtypes and
devices of the sample arguments are fixed, as with any CUDA graph.

Modules with comm-GEMM overlap (ub_comm) are graphed like any other: their exchanges replay on the
device (te_parallel.parallel.ub_transport says why that is safe). Every rank of their TP group must
graph the same callables with the same shapes and replay them in the same order, as it would issue
the eager steps, since the ranks pair their exchanges by order.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from te_parallel.fp8.autocast import fp8_autocast
from te_parallel.module.base import FP8Module
from te_parallel.recipe import DelayedScaling, Recipe


class _FP8Region(nn.Module):
    """module(*args) inside fp8_autocast(...)."""

    def __init__(self, module: nn.Module, enabled: bool, calibrating: bool, recipe: Optional[Recipe], group) -> None:
        super().__init__()
        self.module = module
        self.region = dict(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe, fp8_group=group)

    def forward(self, *args):
        with fp8_autocast(**self.region):
            return self.module(*args)


@contextlib.contextmanager
def _recast_weights(modules: Sequence[nn.Module]):
    fp8_modules = [m for root in modules for m in root.modules() if isinstance(m, FP8Module)]
    for m in fp8_modules:
        m.drop_fp8_weight_cache()
        m._always_recast = True
    try:
        yield
    finally:
        for m in fp8_modules:
            m._always_recast = False


def make_graphed_callables(
    modules: Union[nn.Module, Tuple[nn.Module, ...]],
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    fp8_enabled: bool = False,
    fp8_calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group=None,
    pool=None,
):
    """TE's make_graphed_callables for modules: returns graphed callables (one per module).

    sample_args: a tuple of tensors per module (or one tuple for a single module), as in
    torch.cuda.make_graphed_callables.
    """
    single = isinstance(modules, nn.Module)
    mods = (modules,) if single else tuple(modules)
    args = (sample_args,) if single else tuple(sample_args)
    recipe = fp8_recipe if fp8_recipe is not None else DelayedScaling()
    if (fp8_enabled or fp8_calibrating) and isinstance(recipe, DelayedScaling) and recipe.interval != 1:
        raise ValueError(f"make_graphed_callables: DelayedScaling(interval={recipe.interval}) cannot be graphed; use interval=1")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables needs CUDA (CUDA graphs); torch.cuda.is_available() is False")
    wrapped = tuple(_FP8Region(m, fp8_enabled, fp8_calibrating, recipe, fp8_group) for m in mods)
    with _recast_weights(mods):
        graphed = torch.cuda.make_graphed_callables(wrapped, args, num_warmup_iters=num_warmup_iters,
                                                    allow_unused_input=allow_unused_input, pool=pool)
    return graphed[0] if single else graphed
