"""Delayed scaling's per-pass bookkeeping inside torch.compile graphs.

Eagerly, a module's forward tells the autocast region that its FP8 state recorded amaxes (the update
then runs when the outermost region exits), and each backward cast does the same for the end of the
backward pass (te_parallel.fp8.autocast). Both are Python side effects on containers that change from
step to step, which a graph can neither hold (dynamo would guard on their contents and recompile) nor
run in a traced backward. So a compiled graph calls opaque ops instead, which run the same Python
bookkeeping when the graph runs:

    forward   register_forward(forward ticket, group)                    -> autocast.record_forward
    backward  backward_cast_done(backward ticket, amax_copy(bwd cells))  -> autocast.record_backward

Beside them, `pass_scales(fwd scale, bwd scale)` copies the scales the pass's casts use, and
`amax_copy` the backward cells: device ops in the graph (a CUDA graph may hold them), where the
bookkeeping ops are host work that runs every time.

The backward op reads a copy of the cells the gradient cast has just written (the amaxes of this pass,
te_parallel.fp8.state): that dependency keeps it in the backward graph (an op that reads only forward
inputs is moved into the forward by the partitioner). A copy, not the cells: a module's later gradient
casts write the same cells, so an op reading them would have to run before those casts, and inductor
would split its CUDA graphs there; a fresh tensor lets inductor run every backward_cast_done after the
backward's last kernel, outside one CUDA graph. A ticket is an empty tensor of the state, one per pass:
graphs pass tensors through unchanged, so an op finds the state from it, and one graph serves every layer (no
constant that differs per module, so nothing to guard on). The recipe is the innermost region's when
the forward runs (as eagerly) and is kept on the state for its backward; the group travels by name.

What runs where: casts, amax recording and GEMMs are in the graph; the amax all-reduce and the fused
scale update run once per pass outside it, at the outermost autocast exit and at the end of backward,
exactly as in eager mode (docs/compile.md).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.fp8 import autocast as _autocast
from te_parallel.fp8.state import FP8ScalingState

__all__ = ["TracedScales", "backward_done"]

# A CUDA graph would replay the kernels around these ops but not the ops themselves (they are host work):
# the tag keeps inductor's CUDA graphs (mode="reduce-overhead") from capturing them.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _register_forward(ticket: torch.Tensor, group: str) -> None:
    state = _owner(ticket, backward=False)
    frame = _autocast.current_frame()
    if frame is None:
        raise RuntimeError("a compiled FP8 forward ran outside fp8_autocast, but its graph was traced inside one; "
                           "call it inside an fp8_autocast region")
    pg = _group(group)
    state.compiled_plan = (frame.recipe, pg)  # the backward's recipe is the forward's (TE's rule)
    _autocast.record_forward(state, frame.recipe, pg, compiled=True)


# A device copy with no host work, so a CUDA graph may hold it; an opaque op rather than two clones, so
# that the partitioner keeps its outputs for backward instead of recomputing them there from the state's
# buffers (which the exit update has changed by then). Its outputs are made inside the graph: under
# inductor's CUDA graphs their addresses are the graph's own, the same at every replay.
@torch.library.custom_op("te_parallel_fp8::pass_scales", mutates_args=())
def _pass_scales(fwd_scale: torch.Tensor, bwd_scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return fwd_scale.clone(), bwd_scale.clone()


@_pass_scales.register_fake
def _(fwd_scale, bwd_scale):
    return torch.empty_like(fwd_scale), torch.empty_like(bwd_scale)


def _backward_cast_done(ticket: torch.Tensor, cells: torch.Tensor) -> None:
    state = _owner(ticket, backward=True)
    recipe, pg = state.compiled_plan
    _autocast.record_backward(state, recipe, pg, compiled=True)


# The two host-side ops run at every step, outside the CUDA graphs, so their call is registered with the
# dispatcher directly (a Python kernel for every device, torch's autograd fallback: they return nothing)
# rather than through torch.library.custom_op, whose Python autograd and output checks cost about five times
# the call (docs/compile.md, "Known limits"). Their fake kernels return nothing.
_LIB = torch.library.Library("te_parallel_fp8", "FRAGMENT")
_LIB.define("register_forward(Tensor ticket, str group) -> ()", tags=_TAGS)
_LIB.define("backward_cast_done(Tensor ticket, Tensor cells) -> ()", tags=_TAGS)
_LIB.impl("register_forward", _register_forward, "CompositeExplicitAutograd")
_LIB.impl("backward_cast_done", _backward_cast_done, "CompositeExplicitAutograd")
torch.library.register_fake("te_parallel_fp8::register_forward", lambda ticket, group: None, lib=_LIB)
torch.library.register_fake("te_parallel_fp8::backward_cast_done", lambda ticket, cells: None, lib=_LIB)


@torch.library.custom_op("te_parallel_fp8::amax_copy", mutates_args=())
def _amax_copy(cells: torch.Tensor) -> torch.Tensor:
    return cells.clone()  # (an opaque op: inductor drops a plain clone whose metadata matches its source)


@_amax_copy.register_fake
def _(cells):
    return torch.empty_like(cells)


# te.checkpoint's selective recompute keeps these (te_parallel.fp8.recompute): run again in backward, the
# first would register a forward update from inside backward, the second copy scales the update has changed
KEEP_IN_RECOMPUTE = (torch.ops.te_parallel_fp8.register_forward.default, torch.ops.te_parallel_fp8.pass_scales.default)

# Neither bookkeeping op may be dropped (nothing reads their results: they have none) or merged with
# another call: their point is what they do when they run. A graph keeps an op so marked wherever it has
# the op's inputs, the backward graph included: hence a ticket per pass, so that the backward graph, which
# has the backward ticket, cannot run register_forward after the autocast region has exited.
for _op in (torch.ops.te_parallel_fp8.register_forward.default, torch.ops.te_parallel_fp8.backward_cast_done.default):
    if hasattr(torch.fx.node, "has_side_effect"):
        torch.fx.node.has_side_effect(_op)
    else:  # (older torch)
        torch.fx.node._side_effectful_functions.add(_op)


def _owner(ticket: torch.Tensor, backward: bool) -> FP8ScalingState:
    ref = getattr(ticket, "_te_fp8_state", None)
    state = None if ref is None else ref()
    if state is None or state.tickets[int(backward)] is not ticket:
        pass_ = "backward" if backward else "forward"
        raise RuntimeError(f"te_parallel_fp8 op: its first argument is not the {pass_} ticket of a live FP8 "
                           f"scaling state (FP8ScalingState.tickets); the ops are called by te_parallel's modules only")
    return state


def _group_name(group: Optional[dist.ProcessGroup]) -> str:
    return "" if group is None else group.group_name


def _group(name: str) -> Optional[dist.ProcessGroup]:
    """The group of a name (the functional collectives' own look-up: an op's arguments cannot hold a
    ProcessGroup on every torch this library supports)."""
    if not name:
        return None
    return dist.distributed_c10d._resolve_process_group(name)


class TracedScales:
    """What a GEMM's FP8 plan (GemmFP8) asks of the module's scaling state, inside a compiled forward and
    its backward: `slot_views(backward, slot)` -> (scale, amax cell). Made once per GEMM call, it also
    registers the state for the exit update (the op above).

    The scales are copies made when the graph's forward runs, the forward's and the backward's: the exit
    update changes the state's forward scales in place before backward, and the end of another backward
    (several forwards before their backwards: pipeline schedules) its backward scales; a graph may read
    either in backward (the partitioner may re-derive a scale_inv there rather than keep it). So a
    backward quantizes with the backward scales of its forward's time, eager mode's choice in the usual
    schedule (each backward before the next forward). The cells are the state's (te_parallel.fp8.state).
    """

    __slots__ = ("scales", "cells")

    def __init__(self, state: FP8ScalingState, group) -> None:
        fwd_cells, ticket = state.compiled_tensors(backward=False)
        torch.ops.te_parallel_fp8.register_forward(ticket, _group_name(group))
        self.scales = torch.ops.te_parallel_fp8.pass_scales(state.fwd_scale, state.bwd_scale)
        self.cells = (fwd_cells, state.compiled_tensors(backward=True)[0])

    @property
    def fwd_scale(self) -> torch.Tensor:
        return self.scales[0]

    def slot_views(self, backward: bool, slot: int):
        i = int(backward)
        return self.scales[i][slot], self.cells[i][slot : slot + 1]


def backward_done(state: FP8ScalingState) -> None:
    """In a compiled backward, after a gradient cast (GemmFP8.backward_done): register `state` for the
    update at the end of this backward pass."""
    cells, ticket = state.compiled_tensors(backward=True)
    torch.ops.te_parallel_fp8.backward_cast_done(ticket, torch.ops.te_parallel_fp8.amax_copy(cells))
