"""The experts of an MoE layer: a grouped SwiGLU MLP over rows sorted by local expert, padded per expert to
the row alignment the FP8 recipe needs.

    fc1  GroupedLinear(G, hidden, 2·ffn)   rows of expert g: [gate_g; up_g] · x    -> [rows, 2·ffn/tp]
    act  swiglu: silu(gate) · up                                                  -> [rows, ffn/tp]
    fc2  GroupedLinear(G, ffn, hidden)                                           -> [rows, hidden]

Tensor parallelism inside the experts: fc1 is column-parallel (each rank holds the rows [gate_r; up_r] of
every expert, so the activation stays local), fc2 row-parallel; neither reduces (tp_collectives=False): the
output is this rank's partial sum, reduced by the MoE layer after the tokens are combined (one collective for
all experts).

FP8 row alignment (`fp8_row_alignment`, from the recipe of the innermost fp8_autocast region): 128 rows per
expert under Float8BlockScaling (the weight gradient's 1x128 tiles run along the tokens and must not straddle
two experts), 16 under per-tensor scaling, none outside FP8. `pad_rows` inserts zero rows after each expert's
rows:

* per-expert counts known on the host (after expert parallelism's exchange): the exact padded layout;
* counts on the device only (no expert parallelism): a buffer of a fixed size, the bound
  floor((rows + G·(align − 1)) / align)·align, so that nothing is read back; the rows past the padded counts
  (a multiple of align) go to the last expert. They are zeros, and their output is dropped.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from te_parallel.fp8.autocast import current_frame
from te_parallel.fp8.state import AnyLengthHistory
from te_parallel.module.fp8_padding import align_size_for_recipe
from te_parallel.module.grouped_linear import GroupedLinear
from te_parallel.module.params import tp_rank
from te_parallel.ops.activation import apply_activation
from te_parallel.parallel.groups import group_size
from te_parallel.parallel.sharding import ExpertShard, ShardLayout, split_layout


@dataclass(frozen=True)
class ExpertRows:
    """How the rows of the local experts' input divide among them (rows sorted by local expert).

    counts [G] int64 on the rows' device (the grouped GEMMs' m_splits: a host list would cost them a copy to the
    device, and a pageable copy waits for the stream); host: the same numbers on the host where they are known
    (expert parallelism read them), else None; total: the number of rows (a host int: the tensor's size)."""

    counts: torch.Tensor
    host: Optional[Tuple[int, ...]]
    total: int


def fp8_row_alignment() -> int:
    """Rows per expert the grouped GEMMs need under the innermost fp8_autocast region (1 outside FP8)."""
    frame = current_frame()
    if frame is None or not frame.enabled:
        return 1
    return align_size_for_recipe(frame.recipe)


def pad_rows(x: torch.Tensor, rows: ExpertRows,
             align: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(x_padded [rows_padded, h], m_splits of x_padded [G] on the device, index [rows]: the padded row of each
    row, or None when x is returned as it is). The module docstring has the two layouts. Autograd: index_copy /
    index_select."""
    counts = rows.counts
    if align == 1:
        return x, counts, None
    num = counts.numel()
    padded = (counts + align - 1) // align * align  # [G]
    if rows.host is not None:
        host = [(c + align - 1) // align * align for c in rows.host]
        if host == list(rows.host):
            return x, counts, None
        total, splits = sum(host), padded
    else:
        total = (rows.total + num * (align - 1)) // align * align
        slack = torch.zeros_like(padded)
        slack[-1:] = total - padded.sum()  # (a device op: the bound's spare rows go to the last expert)
        splits = padded + slack
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)  # [G] padded start - start
    expert = torch.repeat_interleave(torch.arange(num, device=x.device), counts, output_size=rows.total)
    index = torch.arange(rows.total, device=x.device) + shift[expert]  # [rows]
    x_padded = x.new_zeros((total, x.shape[1])).index_copy(0, index, x)
    return x_padded, splits, index


def unpad_rows(y: torch.Tensor, index: Optional[torch.Tensor]) -> torch.Tensor:
    """The rows of pad_rows' input back from y [rows_padded, h] (y itself when nothing was padded)."""
    return y if index is None else y.index_select(0, index)


class ExpertLinear(GroupedLinear):
    """GroupedLinear holding G of a layer's experts, the others on the other ranks of an ep group
    (set_expert_parallel). Its state_dict() names each expert's parameters after the expert's place in the
    whole layer (weight{offset + g}), so that PyTorch's checkpoint tools see every expert once, and
    te.clip_grad_norm_ sums the experts' share of the norm over the ep group (te_parallel.parallel.sharding).
    torch's state-dict functions resolve every state-dict key by attribute lookup through the model, so a
    local expert's parameter is also reachable under its whole-layer name (`weight5` on the rank holding
    expert 5 as its weight1); on rank offset > 0 these names are never also local names (offset >= G)."""

    _ep_shard: Optional[ExpertShard] = None
    ep_group = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(_fp8_scales_as_bytes)
        self._register_load_state_dict_pre_hook(_fp8_state_of_this_ep_size, with_module=True)

    def set_expert_parallel(self, shard: Optional[ExpertShard], ep_group) -> None:
        """This module holds experts [shard.offset, shard.offset + G) of shard.num_experts, the rest held by
        the other ranks of ep_group; shard None: it holds all of its layer's experts (or is not a layer's)."""
        if shard is not None and shard.num_local != self.num_gemms:
            raise ValueError(f"{type(self).__name__}.set_expert_parallel: the shard holds {shard.num_local} experts "
                             f"but the module has num_gemms={self.num_gemms}")
        if shard is not None and shard.num_local * group_size(ep_group) != shard.num_experts:
            raise ValueError(f"{type(self).__name__}.set_expert_parallel: {group_size(ep_group)} ep ranks of "
                             f"{shard.num_local} experts each do not make the layer's {shard.num_experts} experts")
        self._ep_shard, self.ep_group = shard, ep_group

    def ep_shard(self) -> Optional[ExpertShard]:
        """Where the local experts sit among the layer's (None: all of them are here)."""
        shard = self._ep_shard
        return None if shard is None or shard.num_local == shard.num_experts else shard

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            shard = self.__dict__.get("_ep_shard")
            local = None if shard is None else shard.local_name(name)
            if local is None or local == name:
                raise
            return super().__getattr__(local)


# The FP8 scaling state of routed experts has one slot per local expert (te_parallel.fp8.state): its shape
# depends on the ep size. Its scales are stored as bytes (as the amax histories are), so that DCP loads them
# whatever their shape, and a state of another ep size is left out of a load (a fresh state, with a warning)
# rather than failing it: local expert g's scale is shared with other experts wherever the fp8 group spans ep
# ranks, so it has no single place among the layer's experts.
_FP8_SCALES = ("fwd_scale", "fwd_scale_inv", "bwd_scale", "bwd_scale_inv")


def _fp8_scales_as_bytes(module: "ExpertLinear", state_dict, prefix: str, local_metadata) -> None:
    if module._ep_shard is None:
        return
    state = module._modules["fp8_state"]
    for name in _FP8_SCALES:
        value = state_dict.get(f"{prefix}fp8_state.{name}")
        if isinstance(value, torch.Tensor) and value is not getattr(state, name):  # (keep_vars: the buffer itself)
            state_dict[f"{prefix}fp8_state.{name}"] = AnyLengthHistory.of(value)


def _fp8_state_of_this_ep_size(module: "ExpertLinear", state_dict, prefix: str, local_metadata, strict,
                               missing_keys, unexpected_keys, error_msgs) -> None:
    scale = state_dict.get(f"{prefix}fp8_state.fwd_scale")
    if module._ep_shard is None or not isinstance(scale, torch.Tensor) or scale.dim() != 1:
        return
    if scale.shape[0] == 2 * module.num_gemms:
        return
    for key in [k for k in state_dict if k.startswith(f"{prefix}fp8_state.")]:
        del state_dict[key]
    warnings.warn(f"{prefix}fp8_state was saved for {scale.shape[0] // 2} local experts and this rank holds "
                  f"{module.num_gemms} (another expert-parallel size): the experts' FP8 scaling state starts fresh; "
                  f"run a few steps under fp8_autocast(calibrating=True) first if that matters", stacklevel=3)


class GatedGroupedLinear(ExpertLinear):
    """GroupedLinear whose experts' rows are two blocks, [gate; up] (SwiGLU's fc1, out_features = 2·ffn).

    Column-parallel, rank r holds [gate_r; up_r] of each expert: both halves split alike, so the activation
    needs no communication. Only where this rank's rows sit in the full weight differs from GroupedLinear's
    contiguous split (shard layouts, layout-independent initialisation, whole-tensor checkpoints)."""

    def _expert_layout(self) -> ShardLayout:
        if self.parallel_mode != "column" or self.tp_size == 1:
            return super()._expert_layout()
        rows = self.out_features * self.tp_size
        return split_layout((rows, self.in_features), 0, tp_rank(self), self.tp_size, [rows // 2, rows // 2])


class GroupedMLP(nn.Module):
    """The local experts: y = fc2(swiglu(fc1(x))), each expert on its own rows (module docstring).

    forward(x [rows, hidden], rows: ExpertRows) -> [rows, hidden], this rank's partial sum under TP.
    Parameters: linear_fc1.weight{g} [2·ffn/tp, hidden] (rows [gate_r; up_r]), linear_fc2.weight{g}
    [hidden, ffn/tp], g the local expert (Megatron's TEGroupedMLP names). expert_shard / ep_group: where these
    experts sit among the layer's, the others on the other ranks of ep_group (ExpertLinear); state_dict()
    names them weight{expert_shard.offset + g}."""

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *, tp_group=None,
                 tp_size: int = 1, bias: bool = False, params_dtype: Optional[torch.dtype] = None, device=None,
                 init_method: Optional[Callable] = None, output_layer_init_method: Optional[Callable] = None,
                 expert_shard: Optional[ExpertShard] = None, ep_group=None) -> None:
        super().__init__()
        split = tp_size > 1
        common = dict(tp_group=tp_group if split else None, tp_size=tp_size, bias=bias, params_dtype=params_dtype,
                      device=device, tp_collectives=False)
        self.linear_fc1 = GatedGroupedLinear(num_local_experts, hidden_size, 2 * ffn_hidden_size,
                                             parallel_mode="column" if split else None, init_method=init_method,
                                             **common)
        self.linear_fc2 = ExpertLinear(num_local_experts, ffn_hidden_size, hidden_size,
                                       parallel_mode="row" if split else None,
                                       init_method=output_layer_init_method or init_method, **common)
        for fc in (self.linear_fc1, self.linear_fc2):  # (names in the whole layer, the norm over the ep group)
            fc.set_expert_parallel(expert_shard, ep_group)

    def reset_parameters(self) -> None:
        self.linear_fc1.reset_parameters()
        self.linear_fc2.reset_parameters()

    def forward(self, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        x_padded, m_splits, index = pad_rows(x, rows, fp8_row_alignment())
        h = self.linear_fc1(x_padded, m_splits)             # [rows_padded, 2·ffn/tp]: [gate_r | up_r]
        y = self.linear_fc2(apply_activation("swiglu", h), m_splits)  # [rows_padded, hidden], partial over TP
        return unpad_rows(y, index)
