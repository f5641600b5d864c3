"""TE's `transformer_engine.pytorch.distributed`: the RNG tracker, activation recompute, and the flags
Megatron's recompute asks about.

`activation_recompute_forward` brackets a forward that will be recomputed (recompute_phase=False)
and its recompute (recompute_phase=True), as TE's does: the recompute's FP8 GEMMs use the scales and
quantized weights of the original forward, in call order (te_parallel's recompute stash), so it
reproduces the original bit for bit.
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Dict

import torch

import te_parallel
from te_parallel.fp8 import autocast as _regions
from te_parallel.fp8 import recompute as _recompute
from te_parallel.parallel.collectives import gather_from_sp

__all__ = ["CudaRNGStatesTracker", "checkpoint", "get_all_rng_states", "activation_recompute_forward",
           "is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase", "gather_along_first_dim"]

checkpoint = te_parallel.checkpoint  # TE's signature: checkpoint(function, *args, distribute_saved_activations=False, ...)
_ALL_RNG_STATES: Dict[str, torch.Tensor] = {}


class CudaRNGStatesTracker(te_parallel.CudaRNGStatesTracker):
    """te_parallel's tracker (it also runs on the CPU); its states are listed in get_all_rng_states()."""

    def add(self, name: str, seed: int) -> None:
        super().add(name, seed)
        _ALL_RNG_STATES[name] = self._states[name]

    def set_states(self, states) -> None:
        super().set_states(states)
        _ALL_RNG_STATES.update(self._states)


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """The named RNG states of the trackers (TE keeps them in one global dict too)."""
    return dict(_ALL_RNG_STATES)


def gather_along_first_dim(inp: torch.Tensor, process_group, async_op: bool = False):
    """All-gather along dim 0 over `process_group` (TE's helper); returns (output, None)."""
    if async_op:
        raise NotImplementedError("gather_along_first_dim: async_op=True is not implemented in te_parallel")
    return gather_from_sp(inp, process_group), None


class _RecomputeState(threading.local):
    def __init__(self) -> None:
        self.enabled = False
        self.phase = False
        self.pending: deque = deque()  # stashes of forwards awaiting their recompute, oldest first


_STATE = _RecomputeState()


def is_fp8_activation_recompute_enabled() -> bool:
    return _STATE.enabled


def in_fp8_activation_recompute_phase() -> bool:
    return _STATE.phase


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False):
    """A forward to be recomputed later (recompute_phase=False) or that recompute (True)."""
    if not activation_recompute:
        yield
        return
    prev = (_STATE.enabled, _STATE.phase)
    _STATE.enabled, _STATE.phase = True, recompute_phase
    try:
        if recompute_phase:
            stash = _STATE.pending.popleft() if _STATE.pending else None
            with (stash.replay_context() if stash is not None else contextlib.nullcontext()):
                yield
        else:
            stash = _recompute._Stash(_regions.current_frame(), None)
            with stash.recording():
                yield
            _STATE.pending.append(stash)
    finally:
        _STATE.enabled, _STATE.phase = prev
