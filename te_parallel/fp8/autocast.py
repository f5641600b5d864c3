"""`fp8_autocast`: the region in which FP8 modules compute their GEMMs in FP8.

Semantics (TE's):
* It wraps the forward pass only; the backward pass uses the recipe captured in the forward.
* Regions nest; the innermost decides `enabled`, `calibrating` and the recipe for the modules
  it runs. `calibrating=True` records amaxes (so delayed scales become meaningful) while the
  GEMMs stay in high precision.
* Delayed scaling updates forward scales once, for every module that ran, when the OUTERMOST
  region exits (one coalesced amax all-reduce over each fp8 group, then one fused update), and
  backward scales once when the backward pass ends (an autograd engine callback).

A module's forward registers its state's forward update with the frame it runs under
(`FP8Frame.register_forward`); a nested region's exit hands what was registered in it to the region
around it, and the outermost region's exit runs the update of everything registered in the pass. The
backward updates are kept apart, in one locked list: backward runs on autograd engine threads, after
the regions have exited.

The region stack is the one piece of dynamic state of the library (groups, recipes and FP8 states
are passed in, never looked up: docs/architecture.md); it is per-thread, like torch.autocast's.
"""
from __future__ import annotations

import threading
from contextlib import ContextDecorator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.fp8.gemm_quantizers import GemmQuantizers, gemm_quantizers
from te_parallel.fp8.scaling import update_delayed_scaling
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.parallel.groups import amax_group
from te_parallel.recipe import DelayedScaling, Recipe, fp8_max

__all__ = ["fp8_autocast", "autocast", "is_fp8_available", "is_fp8_block_scaling_available", "FP8Frame",
           "current_frame"]


@dataclass
class _PendingUpdates:
    """Delayed-scaling states whose amaxes were recorded and still await their update.

    Keyed by (id(state), backward) so a module called several times in one pass updates once. The value
    is [state, recipe, group, compiled]: compiled is True once a torch.compile graph recorded into the
    state (its amaxes are then in the state's cells, folded into the history before the update). The
    first registration of a state decides its recipe and group; the order of first registrations is
    the order of the update (and of the amaxes in each all-reduce).
    """

    entries: Dict[Tuple[int, bool], list] = field(default_factory=dict)

    def add(self, state: FP8ScalingState, recipe: DelayedScaling, group, backward: bool,
            compiled: bool = False) -> None:
        entry = self.entries.setdefault((id(state), backward), [state, recipe, group, compiled])
        if compiled:
            entry[3] = True

    def take(self) -> Dict[Tuple[int, bool], list]:
        """The entries, leaving none behind."""
        entries, self.entries = self.entries, {}
        return entries

    def absorb(self, inner: "_PendingUpdates") -> None:
        """Take over an inner region's entries, as if they had been registered here when they were there
        (every one of them was registered after this region's earlier entries and before its later ones)."""
        entries = inner.take()
        if not self.entries:
            self.entries = entries
            return
        for key, (state, recipe, group, compiled) in entries.items():
            self.add(state, recipe, group, key[1], compiled)

    def flush(self) -> None:
        _reduce_and_update(list(self.take().items()))


@dataclass(frozen=True)
class FP8Frame:
    """What the innermost region says to a module's forward, and what the forward leaves with it: the
    delayed-scaling states whose forward amaxes it recorded (updated when the outermost region exits)."""

    enabled: bool
    calibrating: bool
    recipe: Recipe
    group: Optional[dist.ProcessGroup]
    # the recipe's quantizer of each GEMM operand kind (te_parallel.fp8.gemm_quantizers); None in a region
    # that neither computes in FP8 nor calibrates
    quantizers: Optional[GemmQuantizers] = None
    # the forward updates registered in this region (and handed to it by the regions nested in it)
    pending: _PendingUpdates = field(default_factory=_PendingUpdates, compare=False, repr=False)

    def register_forward(self, state: FP8ScalingState, recipe: DelayedScaling, group,
                         compiled: bool = False) -> None:
        """`state` recorded forward amaxes in this region; its update runs when the outermost region exits.
        recipe: the update's rule; group: the ranks whose amaxes it shares (None: this rank's own);
        compiled: recorded by a torch.compile graph (te_parallel.fp8.compiled)."""
        self.pending.add(state, recipe, group, backward=False, compiled=compiled)

    def pending_forward(self) -> list:
        """The states registered in this region so far and not yet handed on or updated."""
        return [entry[0] for entry in self.pending.entries.values()]


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.frames: List[FP8Frame] = []
        self.checkpoint = None  # te_parallel.fp8.recompute: a stash being recorded or replayed


_TLS = _ThreadState()
# Backward runs on autograd engine threads, so its pending list is shared and locked.
_BWD = _PendingUpdates()
_BWD_LOCK = threading.Lock()
# The backward pass (autograd graph task id) whose end-of-pass update is queued. An id, not a flag:
# a pass that raises never runs its callback, and a flag left set would stop every later pass's update.
_BWD_QUEUED: List[Optional[int]] = [None]
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def current_frame() -> Optional[FP8Frame]:
    """The innermost active region, or None outside any `fp8_autocast`."""
    return _TLS.frames[-1] if _TLS.frames else None


def checkpoint_stash():
    """The activation-checkpoint stash of this thread (recording or replaying), or None."""
    return _TLS.checkpoint


def set_checkpoint_stash(stash) -> None:
    _TLS.checkpoint = stash


def push_frame(frame: FP8Frame) -> None:
    """Re-enter a region without its exit update (recompute replays an earlier forward, which registers
    no update a second time: whatever registers with a frame whose region has exited is never updated)."""
    _TLS.frames.append(frame)


def pop_frame() -> None:
    _TLS.frames.pop()


def record_forward(state: FP8ScalingState, recipe: DelayedScaling, group, compiled: bool = False) -> None:
    """`FP8Frame.register_forward` on the innermost region (for code that does not hold its frame)."""
    frames = _TLS.frames
    if not frames:
        raise RuntimeError("an FP8 forward registered its delayed-scaling update outside fp8_autocast; run the "
                           "forward inside an fp8_autocast region")
    frames[-1].pending.add(state, recipe, group, backward=False, compiled=compiled)


def record_backward(state: FP8ScalingState, recipe: DelayedScaling, group, compiled: bool = False) -> None:
    """Called from a backward: update `state`'s backward scales when this backward pass ends."""
    task = _GRAPH_TASK_ID() if _GRAPH_TASK_ID is not None else -1
    with _BWD_LOCK:
        _BWD.add(state, recipe, group, backward=True, compiled=compiled)
        if _BWD_QUEUED[0] == task:
            return
        _BWD_QUEUED[0] = task
    torch.autograd.Variable._execution_engine.queue_callback(_finish_backward)


def _finish_backward() -> None:
    with _BWD_LOCK:
        _BWD_QUEUED[0] = None
        entries = _BWD.take()
    _reduce_and_update(list(entries.items()))


def _reduce_and_update(items) -> None:
    """One amax all-reduce per (group, direction), then one fused scale update per recipe."""
    if not items:
        return
    _fold_compiled(items)
    by_group: Dict[Tuple[int, bool], list] = {}
    for (_, backward), (state, recipe, group, _) in items:
        by_group.setdefault((id(group), backward), []).append((state, recipe, group))
    for (_, backward), members in by_group.items():
        group = members[0][2]
        if group is not None and any(r.reduce_amax for _, r, _ in members) and dist.get_world_size(group) > 1:
            rows = [s.tensors(backward)[0][0] for s, _, _ in members]
            flat = torch.cat(rows)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            for row, part in zip(rows, torch.split(flat, [r.numel() for r in rows])):
                row.copy_(part)
        _update_members(members, backward)


def _fold_compiled(items) -> None:
    """States a compiled graph recorded into: the history takes the recipe's length here (a graph never
    sees it: te_parallel.fp8.state), then the graph's amaxes move into row 0 (two multi-tensor launches
    for all of them)."""
    rows, cells = [], []
    for (_, backward), (state, recipe, _, compiled) in items:
        if compiled:
            state.ensure_history_len(recipe.amax_history_len, backward)
            rows.append(state.history_row0(backward))
            cells.append(state.compiled_tensors(backward)[0])
    if rows:
        torch._foreach_maximum_(rows, cells)
        torch._foreach_zero_(cells)


def _update_members(members, backward: bool) -> None:
    by_recipe: Dict[Tuple[int, bool], list] = {}
    for state, recipe, _ in members:
        update_scale = state.next_update_index(backward) % recipe.interval == 0
        by_recipe.setdefault((id(recipe), update_scale), []).append((state, recipe))
    for (_, update_scale), group_states in by_recipe.items():
        recipe = group_states[0][1]
        dtype = recipe.fp8_format.bwd_dtype if backward else recipe.fp8_format.fwd_dtype
        tensors = [s.tensors(backward) for s, _ in group_states]
        update_delayed_scaling(tensors, recipe, fp8_max(dtype), update_scale)


# "cuda" -> torch.cuda.is_available(); a CUDA device -> (ok, reason): asked once each (every
# fp8_autocast entry asks, and the device's properties cost microseconds)
_FP8_CAPABLE: Dict[object, object] = {}


def is_fp8_available(return_reason: bool = False):
    """FP8 runs on CPU (for development) and on CUDA GPUs of compute capability >= 8.9."""
    ok, reason = True, ""
    cuda = _FP8_CAPABLE.get("cuda")
    if cuda is None:
        cuda = _FP8_CAPABLE["cuda"] = torch.cuda.is_available()
    if cuda:
        device = torch.cuda.current_device()
        known = _FP8_CAPABLE.get(device)
        if known is None:
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                name = torch.cuda.get_device_name(device)
                ok, reason = False, f"FP8 needs compute capability >= 8.9 (Ada/Hopper); {name} has {major}.{minor}"
            known = _FP8_CAPABLE[device] = (ok, reason)
        ok, reason = known
    return (ok, reason) if return_reason else ok


def is_fp8_block_scaling_available(return_reason: bool = False):
    """Float8BlockScaling runs on CPU (te_parallel's emulation, for development and CI) and on CUDA GPUs of
    compute capability 9.x (Hopper) with CUDA >= 12.9 (cuBLASLt's block-scaled FP8 GEMMs)."""
    ok, reason = True, ""
    if _FP8_CAPABLE.get("cuda") is None:
        _FP8_CAPABLE["cuda"] = torch.cuda.is_available()
    if _FP8_CAPABLE["cuda"]:
        key = ("block", torch.cuda.current_device())
        known = _FP8_CAPABLE.get(key)
        if known is None:
            major, minor = torch.cuda.get_device_capability()
            cuda = torch.version.cuda or "0"
            cuda_ok = tuple(int(v) for v in cuda.split(".")[:2]) >= (12, 9)
            known = (True, "")
            if major != 9 or not cuda_ok:
                name = torch.cuda.get_device_name()
                known = (False, f"Float8BlockScaling needs a Hopper GPU (compute capability 9.x) and CUDA >= 12.9; "
                                f"{name} has {major}.{minor} and torch was built with CUDA {cuda}")
            _FP8_CAPABLE[key] = known
        ok, reason = known
    return (ok, reason) if return_reason else ok


def check_recipe_runs(recipe: Recipe) -> GemmQuantizers:
    """The recipe's GEMM quantizers; one line naming what is missing when they cannot run here."""
    quantizers = gemm_quantizers(recipe)  # (raises for a recipe no quantizers are registered for)
    if not quantizers.per_tensor:  # tile / block scales: cuBLASLt's block-scaled GEMMs
        ok, reason = is_fp8_block_scaling_available(return_reason=True)
        if not ok:
            raise RuntimeError(f"fp8_autocast: {reason}")
    return quantizers


_DEFAULT_RECIPE = DelayedScaling()  # the recipe of fp8_autocast(fp8_recipe=None), made once (it is frozen)


class fp8_autocast(ContextDecorator):  # noqa: N801 (TE's name; a class, like torch.autocast, not a generator)
    """Run the enclosed forward pass with FP8 GEMMs (see the module docstring).

    fp8_recipe: None means DelayedScaling() with its defaults.
    fp8_group: the ranks over which amaxes are all-reduced (MAX) so that they share scales: a
    ProcessGroup, or a DeviceMesh meaning all of its ranks (a dp × tp mesh: TP and DP ranks share
    scales); None means each module's tensor-parallel group.
    (A class rather than a @contextmanager generator: a training step enters it once per micro-batch
    and the generator's machinery cost more host time than the region's own work.)
    """

    def __init__(self, enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None) -> None:
        self.enabled, self.calibrating, self.fp8_recipe = enabled, calibrating, fp8_recipe
        self.fp8_group = amax_group("fp8_autocast", fp8_group)  # (a mesh's group is made once, kept on the mesh)

    # Entering and leaving run eagerly even inside a torch.compile'd function (a graph break each): the
    # region stack must hold this region when the graph's bookkeeping op runs (te_parallel.fp8.compiled),
    # and the exit update is per-pass work that belongs outside graphs. Best: enter it around the
    # compiled module, as in TE's examples (docs/compile.md).
    @torch.compiler.disable
    def __enter__(self) -> None:
        if self.enabled:
            ok, reason = is_fp8_available(return_reason=True)
            if not ok:
                raise RuntimeError(f"fp8_autocast(enabled=True): {reason}; run with enabled=False")
        recipe = self.fp8_recipe
        if recipe is None:
            recipe = _DEFAULT_RECIPE
        elif not isinstance(recipe, Recipe):
            raise TypeError(f"fp8_recipe must be a te_parallel recipe (DelayedScaling, Float8CurrentScaling, "
                            f"Float8BlockScaling), got {recipe!r}")
        quantizers = None
        if self.enabled or self.calibrating:
            quantizers = check_recipe_runs(recipe)
            outer = next((f for f in reversed(_TLS.frames) if f.enabled or f.calibrating), None)
            if outer is not None and outer.quantizers.per_tensor != quantizers.per_tensor:
                # (per-tensor recipes nest, the innermost deciding, as in TE; block scaling keeps no per-tensor state
                # and its operands are of another kind, so one pass does not mix it with them)
                raise ValueError(f"fp8_autocast: a {type(recipe).__name__} region inside a {type(outer.recipe).__name__} "
                                 f"region; block scaling and per-tensor scaling do not mix in one forward pass (close "
                                 f"the outer region first, or give both regions the same kind of recipe)")
        _TLS.frames.append(FP8Frame(bool(self.enabled), bool(self.calibrating), recipe, self.fp8_group, quantizers))

    @torch.compiler.disable
    def __exit__(self, *exc) -> None:
        # (also when the body raised: what the pass recorded is updated, and nothing is left for the next region)
        frames = _TLS.frames
        frame = frames.pop()
        if not frame.pending.entries:
            return
        if frames:
            frames[-1].pending.absorb(frame.pending)  # TE's timing: forward scales change at the outermost exit
        else:
            frame.pending.flush()


class autocast(fp8_autocast):  # noqa: N801 (TE 2.9's name)
    """TE 2.9's name for `fp8_autocast`, with its argument names: `recipe` (fp8_recipe) and
    `amax_reduction_group` (fp8_group). Same region, same semantics."""

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
                 amax_reduction_group=None) -> None:
        super().__init__(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe, fp8_group=amax_reduction_group)
