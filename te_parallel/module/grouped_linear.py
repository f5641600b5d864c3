"""te.GroupedLinear: the experts of a Mixture-of-Experts layer, y[rows_g] = x[rows_g]·W_gᵀ + b_g, one grouped GEMM
per pass (TE's te.GroupedLinear, with TE's arguments, parameter names and outputs)."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import nn

from te_parallel.fp8 import autocast as _autocast
from te_parallel.fp8.state import DEFAULT_HISTORY_LEN
from te_parallel.module.base import (
    GemmModule,
    activation_dtype,
    check_features,
    check_input,
    check_parallel_mode,
    local_features,
    resolve_device,
    resolve_dtype,
)
from te_parallel.module.init import DEFAULT_INIT, ShardedInit
from te_parallel.module.params import _are_adjacent, _retie_views, cat_params, tp_rank
from te_parallel.ops.grouped_fp8 import GroupedFP8, missing_for_grouped
from te_parallel.ops.grouped_gemm import GroupedLinearFunction, GroupedPlan, make_splits
from te_parallel.ops.linear import LinearParallel, WgradTarget
from te_parallel.parallel.sharding import ShardLayout, replicated, split_layout

OWNER = "GroupedLinear"


class GroupedLinear(GemmModule):
    """num_gemms linear layers (the experts of an MoE layer) applied to consecutive row groups of one input:
    forward(inp, m_splits) with inp [..., in] whose flattened rows are sorted by expert and m_splits the rows of
    each (a list of ints, or an int tensor on the input's device: then nothing is read on the host). Returns
    [..., out] (and the biases with return_bias=True: a list, or the [num_gemms, out] parameter with
    single_grouped_bias). Each pass (fprop, dgrad, wgrad) is one grouped GEMM (te_parallel.ops.grouped_gemm).

    Parameters: weight0..weight{n-1} [out, in] and bias0..bias{n-1} [out], TE's names (views of one buffer, so
    the forward stacks them without a copy); single_grouped_weight=True: one `weight` [num_gemms·out, in] (expert
    g's rows at g·out), single_grouped_bias=True: one `bias` [num_gemms, out]. A checkpoint of either layout loads
    into either.

    FP8 under fp8_autocast (delayed, current or block scaling, or any registered recipe whose quantizers give what
    ops.grouped_fp8.missing_for_grouped asks): the input and the output gradient are each cast once for all
    experts (per-tensor recipes: one scale for all of them), each expert's weight with its own scale
    (ops.grouped_fp8). Tiled input and gradient quantizers (block scaling) need, for the weight gradient, every
    expert's rows a multiple of their row_alignment, 128 (checked where m_splits is on the host; pad the experts'
    tokens, e.g. with Fp8Padding).

    Tensor parallelism: parallel_mode "column" splits out_features, "row" in_features; the experts' weights are
    split alike. tp_collectives (te_parallel's addition, default True): the layer sums over tp_group itself, as
    te.Linear does (row: y all-reduced, bias added after; column: dx all-reduced in backward); False leaves it to
    the caller, as TE's GroupedLinear does (its MoE layer reduces in the token combine; biases are then refused
    at tp_size > 1, as in TE). sequence_parallel is stored and marks row-parallel biases (TE's attribute); the
    layer itself moves no sequence shards (tokens reach experts through the MoE dispatch).

    fuse_wgrad_accumulation: dW goes into each weight's `main_grad`. delay_wgrad_compute: backward runs dgrad
    only; backward_dw() runs the weight-gradient GEMM and adds it to the weights' grad (or main_grad).
    save_original_input (FP8 whose input scale comes from the tensor: current or block scaling): keep x in high
    precision and cast it again for wgrad.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        device=None,
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        name: Optional[str] = None,
        use_grouped_tensor: Optional[bool] = None,
        tp_collectives: bool = True,
    ) -> None:
        check_features(OWNER, num_gemms=num_gemms, in_features=in_features, out_features=out_features)
        check_parallel_mode(OWNER, parallel_mode)
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError(f"{OWNER}: comm-GEMM overlap (ub_overlap_rs={ub_overlap_rs}, "
                             f"ub_overlap_ag={ub_overlap_ag}) is not supported for grouped GEMMs; leave them False")
        if use_grouped_tensor is not None and not isinstance(use_grouped_tensor, bool):
            raise TypeError(f"{OWNER}: use_grouped_tensor must be a bool or None, got {use_grouped_tensor!r}")
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        _check_dtype(dtype)
        super().__init__(num_gemms=num_gemms, device=device)
        self._init_tp(OWNER, tp_group, tp_size, sequence_parallel)
        if bias and self.tp_size > 1 and not tp_collectives:
            raise ValueError(f"{OWNER}: bias=True at tp_size={self.tp_size} needs tp_collectives=True (without "
                             f"them the caller reduces the experts' outputs over tp_group and adds the bias, as TE "
                             f"requires); use bias=False or tp_collectives=True")
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)  # (TE's rule)
        self.num_gemms, self.parallel_mode, self.params_dtype = num_gemms, parallel_mode, dtype
        self.in_features, self.out_features = local_features(OWNER, in_features, out_features, parallel_mode,
                                                             self.tp_size)
        self.use_bias, self.return_bias, self.fuse_wgrad_accumulation = bias, return_bias, fuse_wgrad_accumulation
        self.single_grouped_weight, self.single_grouped_bias = bool(single_grouped_weight), bool(single_grouped_bias)
        self.save_original_input, self.tp_collectives = bool(save_original_input), bool(tp_collectives)
        self.init_method, self.get_rng_state_tracker, self.rng_tracker_name = init_method, get_rng_state_tracker, \
            rng_tracker_name
        self.ub_name, self.name, self.use_grouped_tensor = ub_name, name, use_grouped_tensor
        self._defer_wgrad, self._wgrad_thunks = bool(delay_wgrad_compute), []
        self._make_params(device, dtype)
        self.reset_parameters()

    # --- parameters ------------------------------------------------------------------------------------
    def _make_params(self, device, dtype) -> None:
        """TE's registration order: weight0, bias0, weight1, ... (or `weight`, `bias`), each expert's weight a view
        of one [G·out, in] buffer and each bias of one [G·out] buffer."""
        g, n, k = self.num_gemms, self.out_features, self.in_features
        weights = torch.empty(g * n, k, device=device, dtype=dtype)
        biases = torch.empty(g * n, device=device, dtype=dtype) if self.use_bias else None
        if self.single_grouped_weight:
            self.register_parameter("weight", nn.Parameter(weights))
        if self.use_bias and self.single_grouped_bias:
            self.register_parameter("bias", nn.Parameter(biases.view(g, n)))
        for i in range(g):
            if not self.single_grouped_weight:
                self.register_parameter(f"weight{i}", nn.Parameter(weights[i * n:(i + 1) * n]))
            if self.use_bias and not self.single_grouped_bias:
                self.register_parameter(f"bias{i}", nn.Parameter(biases[i * n:(i + 1) * n]))
        self._weight_names = ["weight"] if self.single_grouped_weight else [f"weight{i}" for i in range(g)]
        self._bias_names = [] if not self.use_bias else (
            ["bias"] if self.single_grouped_bias else [f"bias{i}" for i in range(g)])
        for p in self._params(self._weight_names + self._bias_names):
            p.skip_backward_post_hook = self._defer_wgrad  # (TE's marker for Megatron's hooks)
        if self.parallel_mode == "row":  # TE's attribute: the bias's gradient is partial under sequence parallelism
            for p in self._params(self._bias_names):
                p.sequence_parallel = self.sequence_parallel

    def _params(self, names) -> List[nn.Parameter]:
        params = self._parameters
        return [params[n] for n in names]

    def _expert_weights(self) -> List[torch.Tensor]:
        """Each expert's local weight [out, in] (rows of the single weight, or weight{g})."""
        if self.single_grouped_weight:
            n = self.out_features
            w = self._parameters["weight"]
            return [w[i * n:(i + 1) * n] for i in range(self.num_gemms)]
        return self._params(self._weight_names)

    def reset_parameters(self) -> None:
        """Weights by init_method (TE's default N(0, 0.023²), each expert from its own key and full-tensor indices:
        the same values at any TP size and in either parameter layout), biases 0, a fresh FP8 scaling state."""
        weights = self._params(self._weight_names)
        if any(w.is_meta for w in weights):
            return
        _retie_views(weights)
        _retie_views(self._params(self._bias_names))
        init = DEFAULT_INIT if self.init_method is None else self.init_method
        layout = self._expert_layout() if tp_rank(self) is not None else None
        with torch.no_grad():
            for w in self._expert_weights():
                if isinstance(init, ShardedInit):
                    init.fill_(w, layout)
                elif self.get_rng_state_tracker is not None:  # TE: a plain init draws from the tracker's stream
                    with self.get_rng_state_tracker().fork(self.rng_tracker_name):
                        init(w)
                else:
                    init(w)
            for b in self._params(self._bias_names):
                b.zero_()
        state = self._modules["fp8_state"]
        if not state.fwd_scale.is_meta:
            state.reset(DEFAULT_HISTORY_LEN)
        self.drop_fp8_weight_cache()

    def _expert_layout(self) -> ShardLayout:
        """One expert's local weight inside its full [out, in] weight."""
        full = (self.out_features * (self.tp_size if self.parallel_mode == "column" else 1),
                self.in_features * (self.tp_size if self.parallel_mode == "row" else 1))
        if self.parallel_mode is None or self.tp_size == 1:
            return replicated(full)
        return split_layout(full, 0 if self.parallel_mode == "column" else 1, tp_rank(self), self.tp_size)

    def tp_shard_layouts(self):
        """Where this rank's weights and biases sit in the full (TP=1) ones (te_parallel.parallel.sharding)."""
        rank = tp_rank(self)
        if rank is None:
            raise RuntimeError(f"{OWNER}: built with tp_size={self.tp_size} but has no tp_group, so its shard's place "
                               f"in the full parameters is unknown; call set_tensor_parallel_group(group) first")
        g, tp, mode = self.num_gemms, self.tp_size, self.parallel_mode if self.tp_size > 1 else None
        expert = self._expert_layout()
        n_full = expert.full_shape[0]
        out = {}
        if self.single_grouped_weight:
            full = (g * n_full, expert.full_shape[1])
            out["weight"] = (replicated(full) if mode is None else
                             split_layout(full, 0, rank, tp, [n_full] * g) if mode == "column" else
                             split_layout(full, 1, rank, tp))
        else:
            out.update({name: expert for name in self._weight_names})
        if self.use_bias and self.single_grouped_bias:
            out["bias"] = split_layout((g, n_full), 1, rank, tp) if mode == "column" else replicated((g, n_full))
        elif self.use_bias:
            bias = split_layout((n_full,), 0, rank, tp) if mode == "column" else replicated((n_full,))
            out.update({name: bias for name in self._bias_names})
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Either parameter layout loads into either (TE's rule): per-expert weight{g} / bias{g} entries are
        stacked into `weight` / `bias`, a stacked entry ([G·out, in] or [G, out, in]; [G, out]) split into them."""
        g = self.num_gemms
        for single, names, stacked in (("weight", [f"weight{i}" for i in range(g)], self.single_grouped_weight),
                                       ("bias", [f"bias{i}" for i in range(g)], self.single_grouped_bias)):
            if single == "bias" and not self.use_bias:
                continue
            key, keys = prefix + single, [prefix + n for n in names]
            have_one, have_all = key in state_dict, all(k in state_dict for k in keys)
            plain = lambda v: type(v) in (torch.Tensor, nn.Parameter)  # noqa: E731 (not TP shards of a whole tensor)
            if stacked and have_all and not have_one and all(plain(state_dict[k]) for k in keys):
                parts = [state_dict.pop(k) for k in keys]
                state_dict[key] = torch.stack(parts) if single == "bias" else torch.cat(parts)
            elif stacked and have_one and plain(state_dict[key]) and single == "weight":
                state_dict[key] = state_dict[key].reshape(-1, state_dict[key].shape[-1])  # (TE's [G, out, in])
            elif not stacked and have_one and not have_all and plain(state_dict[key]):
                value = state_dict.pop(key)
                for k, part in zip(keys, value.reshape(g, -1, *value.shape[1:]).unbind(0)):
                    state_dict[k] = part.reshape(-1) if single == "bias" else part
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # --- forward ----------------------------------------------------------------------------------------
    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None):
        check_input(OWNER, inp, self.in_features)
        dtype = activation_dtype(self.param_dtype, inp.device)
        _check_dtype(dtype)
        inp = inp if inp.dtype == dtype else inp.to(dtype)
        splits = make_splits(m_splits, self.num_gemms, inp.numel() // self.in_features, inp.device, OWNER)
        if not self._tp_checked:
            self._check_tp_ready(inp.device)
        weights = self._params(self._weight_names)
        weight = weights[0] if len(weights) == 1 else _StackedWeights.apply(*weights)  # [G·out, in]
        bias = None
        if self.use_bias:
            bias = cat_params(self._params(self._bias_names)).view(self.num_gemms, self.out_features)
        par = self._tp_split()
        grad = torch.is_grad_enabled()
        fp8 = self._grouped_fp8(self._fp8_frame(), weights, weight, is_first_microbatch, par, splits,
                                grad and any(w.requires_grad for w in weights))
        targets = None
        if self.fuse_wgrad_accumulation:
            n = self.out_features
            targets = ([WgradTarget(weights[0], 0, self.num_gemms * n)] if self.single_grouped_weight else
                       [WgradTarget(w, i * n, (i + 1) * n) for i, w in enumerate(weights)])
        plan = GroupedPlan(fp8, targets, par, self.tp_collectives, grad,
                           self._wgrad_thunks.append if self._defer_wgrad else None,
                           self.save_original_input and fp8 is not None and fp8.compute)
        out = GroupedLinearFunction.apply(inp, weight, None if self.return_bias else bias, splits, plan)
        if not self.return_bias:
            return out
        if self.single_grouped_bias and self.use_bias:
            return out, self._parameters["bias"]
        return out, [b.to(dtype) for b in self._params(self._bias_names)]

    def _tp_split(self) -> LinearParallel:
        """This layer's TP split (made once per group)."""
        key = (self.parallel_mode, self.tp_group)
        cached = self.__dict__.get("_par")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_par"] = (key, LinearParallel(self.parallel_mode, self.tp_group))
        return cached[1]

    def _grouped_fp8(self, frame, weights, weight, is_first_microbatch, par: LinearParallel, splits,
                     need_wgrad: bool) -> Optional[GroupedFP8]:
        """The FP8 plan of this call (None outside FP8 / calibration): the checks of the recipe's quantizers against
        this layer and these splits, the scaling-state bookkeeping (quantizers with state), the experts' weights
        cast (or taken from the cache)."""
        if frame is None:
            return None
        recipe, quantizers, group = frame.recipe, frame.quantizers, self._fp8_group(frame)
        if frame.enabled:
            self._check_fp8(recipe, quantizers, weight, splits, need_wgrad)
        state = self._modules["fp8_state"]
        stateful = quantizers.has_state  # scales and amax histories in `state`, updated after each pass
        done = None
        if stateful:
            done = lambda: _autocast.record_backward(state, recipe, group)  # noqa: E731
        stash = _autocast.checkpoint_stash()
        if stash is not None and stash.replaying:  # te.checkpoint's recompute: the original pass's scales and W
            scale, weight_q = stash.replay()
            return GroupedFP8(recipe, state, self.num_gemms, weight_q, frame.enabled, par.amax_group, fwd_scale=scale,
                              record=False, backward_done=done, quantizers=quantizers)
        if stateful:
            state.ensure_history_len(recipe.amax_history_len)
            _autocast.record_forward(state, recipe, group)
        cfg = GroupedFP8(recipe, state, self.num_gemms, None, frame.enabled, par.amax_group, backward_done=done,
                         quantizers=quantizers)
        if frame.enabled:
            cfg.weight = self._cached_weight(cfg, weights, weight, is_first_microbatch, par.amax_group)
        else:
            cfg.record_weight_amax(weight.detach())
        if stash is not None:
            stash.record(state.fwd_scale.clone() if stateful else None, cfg.weight)
        return cfg

    def _check_fp8(self, recipe, quantizers, weight: torch.Tensor, splits, need_wgrad: bool) -> None:
        """What this call's FP8 needs of the recipe's quantizers (ops.grouped_fp8.missing_for_grouped), of the
        layer and of the splits; once per call, from what the quantizers declare."""
        n, k = self.out_features, self.in_features
        name = type(recipe).__name__
        missing = missing_for_grouped(quantizers)
        if missing is not None:
            raise ValueError(f"{OWNER}: cannot run FP8 under {name}: {missing}")
        if (n | k) & 15:
            raise ValueError(f"{OWNER}: FP8 GEMMs need in and out features that are multiples of 16 (TE's rule), got "
                             f"{k} and {n} on this rank; use such sizes or run this layer outside fp8_autocast")
        if need_wgrad and not quantizers.per_tensor:  # (tiles: the weight gradient's columnwise ones run along M)
            align = max(quantizers.input.row_alignment, quantizers.grad.row_alignment)
            if splits.aligned(align) is False:
                raise ValueError(f"{OWNER}: under {name} each expert's rows must be a multiple of {align} (the weight "
                                 f"gradient's tiles of the input and gradient run along the tokens), got m_splits "
                                 f"{list(splits.counts)}; pad each expert's tokens to a multiple of {align} "
                                 f"(te.Fp8Padding does)")
        if self.save_original_input and quantizers.input.has_state:
            raise ValueError(f"{OWNER}: save_original_input=True needs an input quantizer whose scale comes from the "
                             f"tensor itself; {name}'s input scale is kept state that moves on before backward; set "
                             f"save_original_input=False under {name}")
        if weight.dtype == torch.float64:
            raise TypeError(f"{OWNER}: FP8 GEMMs need float32/bfloat16/float16 parameters, got float64")

    # --- delayed weight gradients ------------------------------------------------------------------------
    def need_backward_dw(self) -> bool:
        """Whether weight gradients wait for backward_dw() (delay_wgrad_compute=True)."""
        return self._defer_wgrad

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs held back by delay_wgrad_compute=True (one per backward since the last
        call) and add each to its weights' grad (or main_grad with fuse_wgrad_accumulation). No-op otherwise."""
        thunks, self._wgrad_thunks = self._wgrad_thunks, []
        n = self.out_features
        with torch.no_grad():
            for thunk in thunks:
                dw = thunk()  # [G·out, in], or None: it went into main_grad
                if dw is None:
                    continue
                weights = self._params(self._weight_names)
                parts = [dw] if self.single_grouped_weight else [dw[i * n:(i + 1) * n] for i in range(self.num_gemms)]
                for w, part in zip(weights, parts):
                    w.grad = part.to(w.dtype) if w.grad is None else w.grad.add_(part.to(w.dtype))

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, parallel_mode={self.parallel_mode}, tp_size={self.tp_size}")


class _StackedWeights(torch.autograd.Function):
    """The experts' weights [out, in] as one [G·out, in] tensor, without a copy while they are adjacent views of
    one buffer; backward splits dW among them. No gradient (dW went into main_grad, or waits for backward_dw())
    gives the weights none: their .grad is left as it was, not set to zeros."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.set_materialize_grads(False)
        ctx.rows = parts[0].shape[0]
        first = parts[0].detach()
        if _are_adjacent(parts):
            return first.as_strided((ctx.rows * len(parts), first.shape[1]), first.stride(), first.storage_offset())
        return torch.cat([p.detach() for p in parts])

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * len(ctx.needs_input_grad)
        return tuple(torch.split(grad, ctx.rows))


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype == torch.float64:
        raise TypeError(f"{OWNER}: float64 is not supported (grouped GEMMs take float32, bfloat16 or float16); use "
                        f"one of those")

