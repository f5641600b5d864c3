"""te.checkpoint: activation recompute that replays the original forward bit for bit.

Recompute runs during backward, after the outermost fp8_autocast has exited and updated the
delayed scales, outside any autocast region, and after dropout RNG streams moved on. To replay the
original forward exactly, the original pass records, per FP8 GEMM in call order, the forward
scales it used and its quantized weight; the recompute re-enters the same autocast region (without
its exit update), quantizes with those scales, records no amax a second time, and restores the
RNG tracker's states (torch.utils.checkpoint restores the default CPU/CUDA generators itself).
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint

from te_parallel.fp8 import autocast as _autocast
from te_parallel.fp8 import compiled as _compiled


class _Stash:
    def __init__(self, frame: Optional[_autocast.FP8Frame], tracker) -> None:
        self.frame, self.tracker = frame, tracker
        self.tracker_states = None if tracker is None else {k: v.clone() for k, v in tracker.get_states().items()}
        self.entries: deque = deque()
        self.replaying = False

    def record(self, scale: Optional[torch.Tensor], weight) -> None:
        """One FP8 GEMM of the original pass, in call order: its forward scales (delayed scaling; a
        copy of the state's, taken before the exit update changes them) and its quantized weight."""
        self.entries.append((None if scale is None else scale.clone(), weight))

    def replay(self):
        """(forward scales, quantized weight) of the next FP8 GEMM of the recompute, in call order."""
        return self.entries.popleft()

    @contextlib.contextmanager
    def recording(self):
        prev = _autocast.checkpoint_stash()
        _autocast.set_checkpoint_stash(self)
        try:
            yield
        finally:
            _autocast.set_checkpoint_stash(prev)

    @contextlib.contextmanager
    def replay_context(self):
        prev = _autocast.checkpoint_stash()
        self.replaying = True
        _autocast.set_checkpoint_stash(self)
        if self.frame is not None:
            _autocast.push_frame(self.frame)
        saved_tracker = None
        if self.tracker is not None:
            saved_tracker = self.tracker.get_states()
            self.tracker.set_states({k: v.clone() for k, v in self.tracker_states.items()})
        try:
            yield
        finally:
            if self.tracker is not None:
                self.tracker.set_states(saved_tracker)
            if self.frame is not None:
                _autocast.pop_frame()
            _autocast.set_checkpoint_stash(prev)
            self.replaying = False


def checkpoint(function: Callable, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group=None, use_reentrant: bool = True,
               **kwargs) -> Any:
    """Run function(*args, **kwargs) without keeping its activations; recompute them in backward.

    TE's signature. The recompute is bit-identical to the original forward (FP8 scales, quantized
    weights, dropout masks of the default generators and of the tracker). te_parallel always uses
    PyTorch's non-reentrant checkpoint (it supports keyword arguments and inputs without grad);
    `use_reentrant` is accepted for compatibility. distribute_saved_activations is not supported.
    """
    if distribute_saved_activations:
        raise NotImplementedError("te.checkpoint: distribute_saved_activations=True is not implemented; pass False")
    if torch.compiler.is_compiling():
        if get_rng_state_tracker is not None:
            raise NotImplementedError("te.checkpoint under torch.compile: get_rng_state_tracker is not supported (a "
                                      "graph cannot swap the tracker's RNG states); pass None, or run this region "
                                      "eagerly (torch.compiler.disable)")
        # In a graph the recompute is the compiler's (torch's checkpoint region, whose context may only be
        # a selective-checkpoint policy: dynamo cannot trace the stash's record/replay contexts). Keeping
        # the FP8 scales of the pass makes the recompute cast with the original pass's scales; the rest
        # is recomputed from the same inputs.
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=_compiled_policy,
                                                 **kwargs)
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    stash = _Stash(_autocast.current_frame(), tracker)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (stash.recording(), stash.replay_context()), **kwargs)


def _compiled_policy():
    """torch's selective checkpoint policy of te.checkpoint in a graph: recompute everything but the FP8
    scales of the pass and the registration for the exit update (te_parallel.fp8.compiled's ops: run again
    in backward they would copy scales the exit update has changed, and register the state for a forward
    update from inside backward)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _compiled.KEEP_IN_RECOMPUTE else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
