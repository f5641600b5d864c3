"""te_parallel.MoELayer: a Mixture-of-Experts MLP (router → dispatch → grouped SwiGLU experts → combine), with
expert parallelism over an "ep" group and tensor parallelism inside the experts.

Data flow of one forward, per rank (T tokens of the input; TP = tensor-parallel size):

    router              x [T, h] -> probs, routing_map [T, E]; aux loss
    to the TP group     SP: all-gather x and the routing over TP -> [T·tp, h] (backward: reduce-scatter)
                        TP without SP: x is already the group's (identity; backward: all-reduce)
    dispatch            permute by expert; EP: all-to-all, re-sort by local expert (moe/dispatch.py)
    experts             grouped fc1 (column) -> swiglu -> grouped fc2 (row): partial sums over TP
    combine             EP: re-sort, all-to-all back; unpermute weighted by probs -> [T(·tp), h]
    from the TP group   SP: reduce-scatter -> [T, h];  TP without SP: all-reduce

So TP costs one collective each way for all experts, as a dense MLP's does. The partial sums of every
expert (and the routing weights' gradients, which come from them) are reduced once, in that last step; the
router runs on the rank's own tokens, so under SP its weight's gradient is summed over the TP group.

Expert parallelism: the ep ranks hold num_experts / ep experts each (rank j: experts [j·G, (j+1)·G));
tokens are exchanged by all-to-all (te_parallel.moe.dispatch), whose split sizes are read on the host once
per forward. Under TP the ep group is made of ranks of the same TP rank (mesh axes "ep" and "tp"): each TP
rank exchanges the whole TP group's tokens for its shard of the experts.

Data parallelism with FSDP2 (fully_shard over the "dp" axis): the router and the norms are dense
parameters, replicated over dp. The experts' parameters differ across the ep ranks: where the ep ranks are
data-parallel ranks (the usual layout), fully_shard the experts (`layer.experts`) over the ranks that hold
the same experts (dp / ep of them) with `set_gradient_divide_factor(dp)`: the all-to-all's backward already
summed every ep rank's tokens into the expert's gradient, and dividing by dp makes it the data-parallel mean.
With ep = 1 the experts are dense parameters like any other.

Checkpoints and clipping see the whole layer: state_dict() names expert e's parameters
experts.linear_fc*.weight{e} on the rank that holds it (each expert once, in the one-process model's names, TP
shards as whole tensors), so torch.distributed.checkpoint saves every expert and loads at any ep size, and
te.clip_grad_norm_ sums the experts' share of the norm over the ep group (docs/moe.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from te_parallel.module.base import activation_dtype, check_features, check_input, resolve_device, resolve_dtype
from te_parallel.module.init import ShardedInit, draw_key, reset_children
from te_parallel.module.layernorm import LayerNorm, RMSNorm
from te_parallel.module.parallel_mixin import TensorParallelMixin, resolve_tp_size, set_tree_tp_group
from te_parallel.moe.dispatch import combine, dispatch
from te_parallel.moe.experts import ExpertRows, GroupedMLP
from te_parallel.moe.router import TopKRouter, check_router_args
from te_parallel.parallel.collectives import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from te_parallel.parallel.groups import DeviceMesh, as_group, check_divisible, group_rank, group_size
from te_parallel.parallel.sharding import ExpertShard

OWNER = "MoELayer"


@dataclass(frozen=True)
class MoEConfig:
    """The routing of an MoE MLP, for TransformerLayer(moe=...): MoELayer's keyword arguments of the same names."""

    num_experts: int
    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None
    expert_bias: bool = False
    aux_loss_coeff: float = 0.0
    router_dtype: Optional[torch.dtype] = torch.float32
    shared_expert_ffn_hidden_size: Optional[int] = None


def as_ep_group(owner: str, ep_group):
    """The ProcessGroup of an ep_group argument: None, a ProcessGroup, a 1-D DeviceMesh, or a DeviceMesh with
    an axis named "ep" (its ranks of this process's coordinate)."""
    if isinstance(ep_group, DeviceMesh) and ep_group.ndim > 1:
        names = ep_group.mesh_dim_names or ()
        if "ep" not in names:
            raise ValueError(f"{owner}: ep_group is a {ep_group.ndim}-D DeviceMesh with axes {names}; pass a 1-D mesh "
                             f"or a mesh with an axis named 'ep'")
        return ep_group["ep"].get_group()
    return as_group(owner, "ep_group", ep_group)[0]


class MoELayer(TensorParallelMixin, nn.Module):
    """y = Σ over each token's top-k experts e of p_e · fc2_e(swiglu(fc1_e(x))) (module docstring).

    forward(hidden_states [s, b, h] or [T, h]; [s/tp, b, h] under sequence_parallel) -> the same shape. The
    load-balancing loss of the last forward is `aux_loss` (a 0-dim tensor with its graph; None when
    aux_loss_coeff is 0): add it to the training loss (te_parallel.moe.moe_aux_loss sums a model's).

    Routing arguments: TopKRouter's. Parallelism: ep_group (ProcessGroup, 1-D DeviceMesh, or a mesh with an
    "ep" axis; num_experts must divide by its size), tp_group / tp_size (fc1 column-, fc2 row-parallel;
    ffn_hidden_size must divide by tp), sequence_parallel. Parameters: router.weight [E, h] (router_dtype),
    experts.linear_fc1.weight{g} [2·ffn/tp, h], experts.linear_fc2.weight{g} [h, ffn/tp] for the local
    experts g, the global expert being `expert_offset` + g (state_dict() names them by the global expert). The
    experts have no biases.
    shared_expert_ffn_hidden_size: a SwiGLU MLP of that size that every token passes through, its output added
    to the routed experts' (DeepSeek's shared expert; parameters shared_experts.linear_fc1/2.weight0, split
    over TP like the experts', whole on every ep rank).
    init_method: router and fc1 (TE's N(0, 0.023²) when None); output_layer_init_method: fc2 (init_method when
    None). The same seed gives the same full weights at any ep and tp size.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, topk: int, *, ep_group=None,
                 tp_group=None, tp_size: int = 1, sequence_parallel: bool = False, score_function: str = "softmax",
                 use_pre_softmax: bool = False, num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 scaling_factor: Optional[float] = None, expert_bias: bool = False, aux_loss_coeff: float = 0.0,
                 router_dtype: Optional[torch.dtype] = torch.float32,
                 shared_expert_ffn_hidden_size: Optional[int] = None, params_dtype: Optional[torch.dtype] = None,
                 device=None, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None) -> None:
        super().__init__()
        check_features(OWNER, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, num_experts=num_experts)
        if shared_expert_ffn_hidden_size is not None:
            check_features(OWNER, shared_expert_ffn_hidden_size=shared_expert_ffn_hidden_size)
        check_router_args(OWNER, num_experts, topk, score_function, expert_bias, num_groups, group_topk,
                          aux_loss_coeff, router_dtype)
        self.ep_group = as_ep_group(OWNER, ep_group)
        self.ep_size = group_size(self.ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"{OWNER}: num_experts={num_experts} is not divisible by the {self.ep_size} ranks of "
                             f"ep_group; use a multiple of {self.ep_size} experts or a smaller ep group")
        self._init_tp(OWNER, tp_group, tp_size, sequence_parallel)
        self.sequence_parallel = self.sequence_parallel and self.tp_size > 1
        check_divisible(OWNER, "ffn_hidden_size", ffn_hidden_size, self.tp_size)
        if shared_expert_ffn_hidden_size is not None:
            check_divisible(OWNER, "shared_expert_ffn_hidden_size", shared_expert_ffn_hidden_size, self.tp_size)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.topk = num_experts, topk
        self.num_local_experts = num_experts // self.ep_size
        self.expert_offset = group_rank(self.ep_group) * self.num_local_experts
        self.param_dtype = resolve_dtype(params_dtype)
        self.router = TopKRouter(hidden_size, num_experts, topk, score_function=score_function,
                                 use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
                                 scaling_factor=scaling_factor, expert_bias=expert_bias, aux_loss_coeff=aux_loss_coeff,
                                 router_dtype=router_dtype, params_dtype=params_dtype, device=device,
                                 init_method=init_method)
        mlp = dict(tp_group=self.tp_group, tp_size=self.tp_size, params_dtype=params_dtype, init_method=init_method,
                   output_layer_init_method=output_layer_init_method)
        self.shared_experts = None  # every token's expert, added to the routed ones (DeepSeek's shared expert)
        if shared_expert_ffn_hidden_size is not None:
            self.shared_experts = GroupedMLP(1, hidden_size, shared_expert_ffn_hidden_size, device=device, **mlp)
        # built on the meta device (nothing drawn), then given storage and initialised by _reset_experts, which
        # draws the keys of all num_experts experts
        device = resolve_device(device)
        self.experts = GroupedMLP(self.num_local_experts, hidden_size, ffn_hidden_size, device=torch.device("meta"),
                                  expert_shard=ExpertShard(num_experts, self.expert_offset, self.num_local_experts),
                                  ep_group=self.ep_group, **mlp)
        if device.type != "meta":
            self.experts.to_empty(device=device)
        self.aux_loss: Optional[torch.Tensor] = None
        self._reset_experts()

    @classmethod
    def from_config(cls, hidden_size: int, ffn_hidden_size: int, config: MoEConfig, **kwargs) -> "MoELayer":
        return cls(hidden_size, ffn_hidden_size, **dataclasses.asdict(config), **kwargs)

    # --- initialisation -------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Initialise as the constructor does: the router, the shared expert, then fc1 and fc2 of all num_experts
        experts in order, each rank keeping its own (keys are drawn for every expert: the values do not depend
        on ep)."""
        self.router.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        self._reset_experts()

    def _reset_experts(self) -> None:
        for fc in (self.experts.linear_fc1, self.experts.linear_fc2):
            if fc.weight0.is_meta:
                continue
            init = fc.init_method
            before = self.expert_offset
            after = self.num_experts - before - self.num_local_experts
            self._skip_draws(fc, init, before)
            fc.reset_parameters()  # draws the keys of experts [offset, offset + G)
            self._skip_draws(fc, init, after)

    @staticmethod
    def _skip_draws(fc, init, experts: int) -> None:
        """Advance torch's generator as initialising `experts` more experts of `fc` would."""
        for _ in range(experts):
            if init is None or isinstance(init, ShardedInit):
                draw_key()
            else:
                init(torch.empty_like(fc.weight0))

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Hand the layer and its experts the TP group (a ProcessGroup or a 1-D DeviceMesh) after construction."""
        set_tree_tp_group(self, tp_group)

    # --- forward --------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        check_input(OWNER, hidden_states, self.hidden_size)
        if hidden_states.dim() not in (2, 3):
            raise ValueError(f"{OWNER}: hidden_states must be [seq, batch, hidden] or [tokens, hidden], got shape "
                             f"{tuple(hidden_states.shape)}")
        dtype = activation_dtype(self.param_dtype, hidden_states.device)
        x = hidden_states.reshape(-1, self.hidden_size).to(dtype)            # [T, h]
        tp_group = self.tp_group if self.tp_size > 1 else None
        routing = self.router(x, tp_group if self.sequence_parallel else None)
        self.aux_loss = routing.aux_loss
        x, probs, routing_map = self._to_tp_group(x, routing.probs, routing.routing_map, tp_group)
        self.router.count_tokens(routing_map)
        rows, expert_rows, dispatched = dispatch(x, probs, routing_map, self.topk, self.ep_group,
                                                 self.num_local_experts)
        y = combine(self.experts(rows, expert_rows), dispatched)             # [T(·tp), h], partial over TP
        if self.shared_experts is not None:  # (partial over TP too: reduced with the routed experts' sum)
            tokens = x.shape[0]
            one = ExpertRows(torch.full((1,), tokens, dtype=torch.int64, device=x.device), (tokens,), tokens)
            y = y + self.shared_experts(x, one)
        y = reduce_scatter_to_sp(y, tp_group) if self.sequence_parallel else reduce_from_tp(y, tp_group)
        return y.view(hidden_states.shape)

    def _to_tp_group(self, x, probs, routing_map, tp_group):
        """The TP group's tokens and routing on every TP rank (module docstring). Under SP one all-gather moves
        probs and routing map together ([T, 2E]: the map as 0/1 in probs' dtype)."""
        if tp_group is None:
            return x, probs, routing_map
        if not self.sequence_parallel:
            return copy_to_tp(x, tp_group), copy_to_tp(probs, tp_group), routing_map
        both = gather_from_sp(torch.cat([probs, routing_map.to(probs.dtype)], dim=1), tp_group)  # [T·tp, 2E]
        experts = self.num_experts
        return gather_from_sp(x, tp_group), both[:, :experts], both[:, experts:].detach() != 0

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, topk={self.topk}, ep_size={self.ep_size}, tp_size={self.tp_size}")


class LayerNormMoE(nn.Module):
    """The MLP block of an MoE transformer layer: norm → MoELayer (TransformerLayer(moe=...) builds it).

    forward(inp, is_first_microbatch=None, *, residual=None) -> out (+ residual), and the norm's output too with
    return_layernorm_output=True. Parameters: layer_norm.weight (and .bias for LayerNorm), moe.*."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, config: MoEConfig, *, eps: float = 1e-5,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, sequence_parallel: bool = False, tp_group=None,
                 tp_size: int = 1, ep_group=None, params_dtype: Optional[torch.dtype] = None, device=None,
                 init_method: Optional[Callable] = None, output_layer_init_method: Optional[Callable] = None) -> None:
        super().__init__()
        tp_size = resolve_tp_size("LayerNormMoE", tp_group, tp_size)
        sp = sequence_parallel and tp_size > 1
        norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
        self.layer_norm = norm(hidden_size, eps=eps, sequence_parallel=sp, params_dtype=params_dtype,
                               zero_centered_gamma=zero_centered_gamma, device=device,
                               tp_group=tp_group if sp else None)
        self.moe = MoELayer.from_config(hidden_size, ffn_hidden_size, config, ep_group=ep_group, tp_group=tp_group,
                                        tp_size=tp_size, sequence_parallel=sp, params_dtype=params_dtype,
                                        device=device, init_method=init_method,
                                        output_layer_init_method=output_layer_init_method)
        self.hidden_size, self.param_dtype = hidden_size, self.moe.param_dtype
        self.return_layernorm_output = return_layernorm_output

    @property
    def aux_loss(self) -> Optional[torch.Tensor]:
        return self.moe.aux_loss

    def reset_parameters(self) -> None:
        """The norm's, then the MoE layer's (the constructor's order)."""
        reset_children(self)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, *,
                residual: Optional[torch.Tensor] = None):
        ln_out = self.layer_norm(inp)
        out = self.moe(ln_out)
        if residual is not None:
            out = out + residual
        return (out, ln_out) if self.return_layernorm_output else out


def moe_aux_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """The sum of the load-balancing losses of `model`'s MoE layers from their last forward (None if none has one)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoELayer) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
