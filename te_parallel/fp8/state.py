"""Per-module FP8 scaling state, kept as buffers so that `state_dict()` carries it as plain tensors.

A module with G GEMMs has 2G forward slots (input and weight of each GEMM, in that order) and G
backward slots (the output gradient of each GEMM). Buffer names inside the module's state dict:

    <prefix>fp8_state.fwd_amax_history  [L, 2G]   row 0 = the pass in progress, row i = i passes ago
    <prefix>fp8_state.fwd_scale         [2G]      scale used by the next cast
    <prefix>fp8_state.fwd_scale_inv     [2G]      1 / scale
    <prefix>fp8_state.bwd_*             likewise with G columns
    <prefix>fp8_state.update_count      [2]       forward / backward updates so far (for `interval`)

Loading (documented defaults, docs/checkpoints.md): a checkpoint without these keys (one written by
a non-FP8 model, e.g. plain torch) keeps a fresh state (scale 1, empty history) and warns once; a
history of another length is adopted as saved (the next autocast resizes it to the recipe's
length, keeping the most recent rows); a different number of slots is an error.

`in_extra_state = True` (set by modules that write TE's checkpoint layout, e.g. the `transformer_engine`
compat package): the owner carries this state in its `_extra_state` (te_parallel.fp8.te_extra_state), so
these buffers stay out of `state_dict()`, and a checkpoint without them loads silently.

Under torch.compile (te_parallel.fp8.compiled) the casts record their amaxes into `amax_cells` instead of
history row 0, and the autocast bookkeeping folds the cells into row 0 before the update: the history
never enters a graph, so its length (set by the recipe at the first autocast) cannot force a recompile,
and no [L, n] history is copied back into its buffer by every graph that records one amax.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch
from torch import nn

DEFAULT_HISTORY_LEN = 1024
_KEYS = ("fwd_amax_history", "fwd_scale", "fwd_scale_inv", "bwd_amax_history", "bwd_scale", "bwd_scale_inv")


class FP8ScalingState(nn.Module):
    """Amax histories and scales of the FP8 operands of one module."""

    def __init__(self, num_gemms: int, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        n_fwd, n_bwd = 2 * num_gemms, num_gemms
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("fwd_amax_history", torch.zeros(DEFAULT_HISTORY_LEN, n_fwd, **f32))
        self.register_buffer("fwd_scale", torch.ones(n_fwd, **f32))
        self.register_buffer("fwd_scale_inv", torch.ones(n_fwd, **f32))
        self.register_buffer("bwd_amax_history", torch.zeros(DEFAULT_HISTORY_LEN, n_bwd, **f32))
        self.register_buffer("bwd_scale", torch.ones(n_bwd, **f32))
        self.register_buffer("bwd_scale_inv", torch.ones(n_bwd, **f32))
        self.register_buffer("update_count", torch.zeros(2, dtype=torch.int64, device=device))
        # The counts live on the host (`interval` needs them every step) and are written into the
        # buffer only when a state dict is taken: a device write per update was a launch at the end of
        # every pass and, in the host profile of the GPT layer (hidden 4096, ffn 16384, 32 heads, s2048 b4),
        # where the host waited for the GPU.
        self._count_host = [0, 0]
        # (backward, slot) -> (history, scale, scale view, amax cell view): the per-cast look-ups of
        # `slot_views`, and ("row 0", backward) -> (history, its row 0) of `history_row0`; valid while the
        # buffers are the same tensor objects (every update is in place).
        self._views: dict = {}
        self.in_extra_state = False
        self._make_compiled_tensors(self.fwd_scale.device)

    def _make_compiled_tensors(self, device: torch.device) -> None:
        """The tensors a compiled graph reads besides the scales (te_parallel.fp8.compiled): `amax_cells`,
        the amaxes of the pass in progress ([2G] forward, [G] backward; zero between passes), and `tickets`,
        two empty tensors that name this state to the bookkeeping ops, one for the forward's and one for the
        backward's (a graph hands an op the ticket object itself, and the ticket points back here). Plain
        attributes, not buffers: never in a state dict and never compared or gathered as part of the state;
        `_apply` and `compiled_tensors` keep them on the state's device."""
        f32 = dict(dtype=torch.float32, device=device)
        self.amax_cells = (torch.zeros(2 * self.num_gemms, **f32), torch.zeros(self.num_gemms, **f32))
        self.tickets = (torch.empty(0, dtype=torch.uint8, device=device),
                        torch.empty(0, dtype=torch.uint8, device=device))
        for ticket in self.tickets:
            ticket._te_fp8_state = weakref.ref(self)

    def compiled_tensors(self, backward: bool):
        """(cells, ticket) of the forward or the backward pass, on the scales' device (made again if
        something moved the buffers without `_apply`, e.g. FSDP2 swapping `.data`)."""
        if self.tickets[0].device != self.fwd_scale.device:
            self._make_compiled_tensors(self.fwd_scale.device)
        return self.amax_cells[int(backward)], self.tickets[int(backward)]

    def __setstate__(self, state) -> None:
        """A copy (deepcopy, pickle) gets its own cells and tickets: a copied ticket would still name the original."""
        super().__setstate__(state)
        if "fwd_scale" in self._buffers:
            self._make_compiled_tensors(self.fwd_scale.device)

    def _apply(self, fn, recurse=True):
        """`module.to(dtype)` / `.half()` must not touch the scaling state: amaxes and scales stay fp32."""
        super()._apply(fn, recurse)
        for name in _KEYS:
            t = getattr(self, name)
            if t.dtype != torch.float32:
                setattr(self, name, t.to(torch.float32))
        self._make_compiled_tensors(self.fwd_scale.device)  # (empty between passes: made anew, not moved)
        return self

    # slots -------------------------------------------------------------------------------
    @staticmethod
    def input_slot(gemm: int) -> int:
        return 2 * gemm

    @staticmethod
    def weight_slot(gemm: int) -> int:
        return 2 * gemm + 1

    def tensors(self, backward: bool):
        """(amax_history, scale, scale_inv) of the forward or backward slots."""
        if backward:
            return self.bwd_amax_history, self.bwd_scale, self.bwd_scale_inv
        return self.fwd_amax_history, self.fwd_scale, self.fwd_scale_inv

    def slot_views(self, backward: bool, slot: int):
        """(scale [0-d view], amax cell [1-element view of history row 0]) of one slot, as a cast
        reads and writes them. The views are made once and reused while the buffers are the same
        tensors: indexing a tensor costs microseconds of host time, twice per cast (bench_host.py).
        Under torch.compile the cell is in `amax_cells` (see the module doc), and nothing is cached: a
        view costs nothing in a graph, and a dict written while tracing would be guarded on."""
        bufs = self._buffers
        if torch.compiler.is_compiling():
            cells, _ = self.compiled_tensors(backward)
            scale = bufs["bwd_scale" if backward else "fwd_scale"]
            return scale[slot], cells[slot : slot + 1]
        hist = bufs["bwd_amax_history" if backward else "fwd_amax_history"]
        scale = bufs["bwd_scale" if backward else "fwd_scale"]
        hit = self._views.get((backward, slot))
        if hit is None or hit[0] is not hist or hit[1] is not scale:
            hit = self._views[(backward, slot)] = (hist, scale, scale[slot], hist[0, slot : slot + 1])
        return hit[2], hit[3]

    def history_row0(self, backward: bool) -> torch.Tensor:
        """Row 0 of the forward or backward amax history (the pass in progress), a view made once per
        history tensor like slot_views' (the fold of a compiled pass's amaxes asks at every pass)."""
        hist = self._buffers["bwd_amax_history" if backward else "fwd_amax_history"]
        key = ("row 0", backward)
        hit = self._views.get(key)
        if hit is None or hit[0] is not hist:
            hit = self._views[key] = (hist, hist[0])
        return hit[1]

    def next_update_index(self, backward: bool) -> int:
        """Count one more update of this direction; returns the count before it."""
        i = int(backward)
        n = self._count_host[i]
        self._count_host[i] = n + 1
        return n

    def updates(self) -> list:
        """[forward, backward] updates so far (what `update_count` holds in a state dict)."""
        return list(self._count_host)

    def ensure_history_len(self, length: int, backward: Optional[bool] = None) -> None:
        """Resize both histories (or the backward / forward one only) to `length` rows, keeping the most
        recent rows."""
        bufs = self._buffers  # (every forward asks: the usual answer must cost nothing)
        if bufs["fwd_amax_history"].shape[0] == length and bufs["bwd_amax_history"].shape[0] == length:
            return
        names = ("fwd_amax_history", "bwd_amax_history") if backward is None else (
            "bwd_amax_history" if backward else "fwd_amax_history",)
        for name in names:
            hist = getattr(self, name)
            if hist.shape[0] == length:
                continue
            new = torch.zeros(length, hist.shape[1], dtype=hist.dtype, device=hist.device)
            keep = min(length, hist.shape[0])
            new[:keep].copy_(hist[:keep])
            setattr(self, name, new)

    def reset(self, history_len: Optional[int] = None) -> None:
        """Scales 1, histories and update counts 0; history_len: also resize the histories (the fresh
        state of a constructed module has DEFAULT_HISTORY_LEN rows; module.reset_parameters() asks for it)."""
        if history_len is not None:
            self.ensure_history_len(history_len)
        with torch.no_grad():
            for name in _KEYS:
                t = getattr(self, name)
                t.zero_() if "history" in name else t.fill_(1.0)
            self.update_count.zero_()
            for cells in self.amax_cells:
                cells.zero_()
        self._count_host = [0, 0]

    # checkpoints ---------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.in_extra_state:
            return
        with torch.no_grad():
            self.update_count.copy_(torch.tensor(self._count_host, dtype=torch.int64))
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:
            for name in ("fwd_amax_history", "bwd_amax_history"):
                destination[prefix + name] = AnyLengthHistory.of(destination[prefix + name])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        keys = [prefix + k for k in (*_KEYS, "update_count")]
        present = [k for k in keys if k in state_dict]
        if not present and self.in_extra_state:
            return
        if not present:
            warnings.warn(
                f"checkpoint has no FP8 scaling state under '{prefix}'; keeping a fresh one (scale 1, empty amax history)",
                stacklevel=3,
            )
            self.reset()
            return
        if len(present) != len(keys):
            missing = sorted(set(keys) - set(present))
            error_msgs.append(f"FP8 scaling state under '{prefix}' is incomplete: missing {missing}")
            return
        for name in ("fwd", "bwd"):
            want = getattr(self, f"{name}_scale").shape[0]
            got = state_dict[f"{prefix}{name}_scale"].shape[0]
            hist = state_dict[f"{prefix}{name}_amax_history"]
            if got != want or hist.dim() != 2 or hist.shape[1] != want:
                error_msgs.append(
                    f"FP8 scaling state under '{prefix}' has {got} {name} slots (history {tuple(hist.shape)}); "
                    f"this module needs {want}: the checkpoint is from a different module type"
                )
                return
        # Adopt the saved history length so the copy below cannot fail on shape.
        self.ensure_history_len(state_dict[prefix + "fwd_amax_history"].shape[0])
        bwd_len = state_dict[prefix + "bwd_amax_history"].shape[0]
        if bwd_len != self.bwd_amax_history.shape[0]:
            self.bwd_amax_history = torch.zeros(bwd_len, self.bwd_amax_history.shape[1],
                                                dtype=torch.float32, device=self.bwd_amax_history.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._count_host = [int(v) for v in self.update_count.tolist()]


class AnyLengthHistory(torch.Tensor):
    """An amax history in a state dict: a plain tensor to everything but torch.distributed.checkpoint,
    which stores it as bytes and loads it whole, replacing the entry. A model whose recipe has another
    amax_history_len (or that has not run under its recipe yet: 1024 rows) then loads it and adopts the
    saved length in load_state_dict, where a tensor entry would fail DCP's shape check."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results of operations are plain tensors

    @staticmethod
    def of(t: torch.Tensor) -> "AnyLengthHistory":
        return t.as_subclass(AnyLengthHistory)

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)  # pickled (torch.save, DCP) as a plain tensor
