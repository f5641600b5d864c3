"""What the modules share: device/dtype resolution and input checks; FP8Module (FP8 state, the quantized
weight cache, the FP8 plan of each GEMM); GemmModule, the base of Linear, LayerNormLinear and
LayerNormMLP (tensor-parallel split of each GEMM, its comm-GEMM overlap settings, the forward of one
GEMM); and the norm pieces of the LayerNorm* modules. The parameters themselves are in params.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from te_parallel.fp8 import autocast as _autocast
from te_parallel.fp8 import compiled as _compiled
from te_parallel.fp8 import gemm_size
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.fp8.params import Float8Weight
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.module.params import LinearParams, cat_params
from te_parallel.module.parallel_mixin import TensorParallelMixin
from te_parallel.ops.fp8_gemm_config import GemmFP8
from te_parallel.ops.fp8_weight import weight_operand
from te_parallel.ops.linear import GemmPlan, LinearFunction, LinearParallel, residual_in_gemm
from te_parallel.ops.norm import apply_norm, check_normalization, fp8_norm_fused, norm_fp8
from te_parallel.parallel.collectives import all_reduce_grad
from te_parallel.parallel.dcp import register_whole_tensor_hooks
from te_parallel.parallel.groups import check_divisible, check_scatter_dim, group_size
from te_parallel.parallel.overlap import CommOverlap, OverlapConfig
from te_parallel.parallel.overlap import initialize_ub  # noqa: F401  (TE's te.module.base.initialize_ub)

DeviceLike = Union[str, torch.device, None]
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def resolve_device(device: DeviceLike) -> torch.device:
    """None means the ambient default device when one is set (`with torch.device("meta"):`,
    torch.set_default_device), else CUDA when available, else CPU."""
    if device is None:
        ambient = torch.get_default_device()
        if ambient.type != "cpu":
            return ambient
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_materialized(module: nn.Module) -> None:
    """A module built on the meta device has no values yet: say how to give it some."""
    for p in module._parameters.values():
        if p is not None and p.is_meta:
            raise RuntimeError(f"{type(module).__name__}: its parameters are on the meta device (no storage); materialise "
                               f"it first with module.to_empty(device=...) and then module.reset_parameters()")


def resolve_dtype(params_dtype: Optional[torch.dtype]) -> torch.dtype:
    dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"params_dtype must be one of {PARAM_DTYPES}, got {params_dtype}")
    return dtype


def check_features(name: str, **dims: int) -> None:
    for key, v in dims.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {key} must be a positive int, got {v!r}")


def activation_dtype(module_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """torch.autocast's dtype when it is on for this device, else the parameters' dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return module_dtype


def check_hidden_states(owner: str, x, layout: str, what: str = "hidden_states") -> None:
    """x must be [seq, batch, hidden] (layout "sbhd") or [batch, seq, hidden] ("bshd")."""
    if isinstance(x, torch.Tensor) and x.dim() != 3:
        dims = "[seq, batch, hidden]" if layout == "sbhd" else "[batch, seq, hidden]"
        hint = "x.unsqueeze(1)" if layout == "sbhd" else "x.unsqueeze(0)"
        raise ValueError(f"{owner}: {what} must be 3-D {dims} (layout {layout!r}), got shape {tuple(x.shape)}; "
                         f"for a single sequence add the batch dim, e.g. {hint}")


def check_input(name: str, inp: torch.Tensor, features: int) -> None:
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name}: input must be a torch.Tensor, got {type(inp).__name__}")
    if not inp.is_floating_point() or inp.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name}: input must be float32, bfloat16, float16 or float64, got {inp.dtype}")
    if inp.dim() < 1 or inp.shape[-1] != features:
        raise ValueError(f"{name}: input's last dim must be {features}, got shape {tuple(inp.shape)}")


def check_residual(name: str, residual: object, shape: Optional[Sequence[int]], dtype: torch.dtype) -> None:
    """`residual=` of a module's forward (te_parallel's addition: out + residual): a tensor in the output's dtype,
    of the output's shape where that is known before the forward (`shape`; else add_residual checks it)."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{name}: residual must be a torch.Tensor or None, got {type(residual).__name__}")
    if residual.dtype != dtype:
        raise TypeError(f"{name}: residual must have the output's dtype {dtype}, got {residual.dtype}")
    if shape is not None and tuple(residual.shape) != tuple(shape):
        raise ValueError(f"{name}: residual must have the output's shape {tuple(shape)}, got {tuple(residual.shape)}")


def add_residual(name: str, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """out + residual where the GEMM did not add it in its epilogue (same shape: no broadcasting)."""
    if residual.shape != out.shape:
        raise ValueError(f"{name}: residual must have the output's shape {tuple(out.shape)}, got "
                         f"{tuple(residual.shape)}")
    return out + residual


class FP8Module(nn.Module):
    """Base of the GEMM modules: owns `fp8_state` and the quantized-weight cache.

    The weight is cast once and reused while its parameters are unchanged: the cache key is the
    parameters' version counters, which every in-place update through autograd-visible ops
    (optimizers, `load_state_dict`, `copy_` under no_grad) bumps. TE's `is_first_microbatch`
    overrides it: True recasts, False reuses whatever is cached. Writes through `.data` bypass
    version counters; call `drop_fp8_weight_cache()` after those.
    """

    def __init__(self, num_gemms: int, device: torch.device) -> None:
        super().__init__()
        self.fp8_state = FP8ScalingState(num_gemms, device=device)
        self._weight_cache: Dict[int, Tuple[tuple, Float8Tensor]] = {}
        self._always_recast = False  # set while a CUDA graph is captured (te_parallel.graph)

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' dtype now (after any `.to(dtype)`), TE's activation dtype outside torch.autocast."""
        for p in self._parameters.values():  # the module's own parameters: no recursive walk per call
            if p is not None:
                return p.dtype
        return next(self.parameters()).dtype

    def drop_fp8_weight_cache(self) -> None:
        self._weight_cache.clear()

    def _fp8_frame(self) -> Optional[_autocast.FP8Frame]:
        frame = _autocast.current_frame()
        if frame is None or not (frame.enabled or frame.calibrating):
            return None
        return frame

    def _fp8_group(self, frame: _autocast.FP8Frame):
        return frame.group if frame.group is not None else getattr(self, "tp_group", None)

    def _gemm_fp8(
        self,
        frame: Optional[_autocast.FP8Frame],
        gemm: int,
        params: Sequence[torch.Tensor],
        weight: torch.Tensor,
        is_first_microbatch: Optional[bool],
        weight_amax_group=None,
    ) -> Optional[GemmFP8]:
        """The FP8 plan of GEMM number `gemm` this call (None outside FP8 / calibration)."""
        if frame is None:
            return None
        recipe, quantizers, group = frame.recipe, frame.quantizers, self._fp8_group(frame)
        state = self._modules["fp8_state"]  # (not nn.Module.__getattr__: this runs on every forward)
        stateful = quantizers.has_state  # scales and amax histories in `state`, updated after each pass
        compiling = torch.compiler.is_compiling()
        # each backward cast asks for the backward scale update at the end of backward (in a graph through
        # the bookkeeping op: te_parallel.fp8.compiled)
        done = None
        if stateful:
            done = (functools.partial(_compiled.backward_done, state) if compiling
                    else functools.partial(_autocast.record_backward, state, recipe, group))
        stash = _autocast.checkpoint_stash()
        if stash is not None and stash.replaying:  # te.checkpoint's recompute: the original pass's scales, W
            scale, weight_q = stash.replay()
            return GemmFP8(recipe, quantizers, state, gemm, weight_q, frame.enabled, group, fwd_scale=scale,
                           record=False, backward_done=done)
        if frame.enabled and weight.dtype == torch.float64:
            raise TypeError(f"{type(self).__name__}: FP8 GEMMs need float32/bfloat16/float16 parameters, got float64; "
                            f"convert the module with .to(torch.float32) or run it outside fp8_autocast")
        scales = state
        if stateful and compiling:  # (the history is sized by the exit update: a graph never sees it)
            scales = _compiled.TracedScales(state, group)
        elif stateful:
            state.ensure_history_len(recipe.amax_history_len)
            frame.register_forward(state, recipe, group)  # (updated when the outermost region exits)
        cfg = GemmFP8(recipe, quantizers, scales, gemm, None, frame.enabled, group, backward_done=done)
        if frame.enabled and isinstance(weight, Float8Weight):  # FP8 parameters: their bytes, no cast
            cfg.weight = weight_operand(type(self).__name__, weight, recipe)
        elif frame.enabled:
            cfg.weight = self._cached_weight(cfg, params, weight, is_first_microbatch, weight_amax_group)
        else:
            cfg.record_weight_amax(weight)
        if stash is not None:
            stash.record(scales.fwd_scale if stateful else None, cfg.weight)
        return cfg

    def _cached_weight(self, cfg: GemmFP8, params, weight, is_first_microbatch, amax_group) -> Float8Tensor:
        if torch.compiler.is_compiling():
            return self._cached_weight_compiled(cfg, params, weight, is_first_microbatch, amax_group)
        fmt = cfg.recipe.fp8_format
        if is_first_microbatch is False and not self._always_recast:  # TE's "reuse": no versions to read
            hit = self._weight_cache.get(cfg.gemm)
            if hit is not None and hit[0][1] is fmt.fwd_dtype and hit[0][2] == cfg.quantizers.weight.cache_key:
                return hit[1]
        key = (tuple([(p._version, p.data_ptr()) for p in params]), fmt.fwd_dtype, cfg.quantizers.weight.cache_key)
        keep = (is_first_microbatch is not None or not torch.is_grad_enabled()
                or not any(p.requires_grad for p in params))
        # A training forward without TE's micro-batch flag always casts (as TE does): the version key
        # cannot see every write, e.g. FSDP2 all-gathers new values into the same unsharded storage
        # without bumping its version, so a copy cached by an earlier no_grad forward would be stale.
        if keep and is_first_microbatch is None and not self._always_recast:
            hit = self._weight_cache.get(cfg.gemm)
            if hit is not None and hit[0] == key:
                return hit[1]
        # Wᵀ (for dgrad) is made in backward, not here: emitted by this cast it sits in memory through
        # the whole forward, 1.501 instead of 1.376 GiB of the GPT layer's peak on an H200 (+9%), to
        # save ~0.13 ms of transposes (docs/benchmarks.md). Nor is it kept here after that backward.
        with torch.no_grad():
            w_q = cfg.quantize_weight(weight.detach(), amax_group)
        # The FP8 W is kept for the next forward only where that forward can use it: TE's explicit
        # micro-batch flag, inference, frozen weights. In a training step (is_first_microbatch=None)
        # the optimizer changes the weights first, so a kept copy would never be used and would hold
        # 1 byte per parameter from this forward through backward and on to the next step. Not kept,
        # W is freed after its forward GEMM and backward re-encodes Wᵀ from `weight` (unless `weight`
        # is a concatenated copy, which would cost more than W itself).
        if keep:
            self._weight_cache[cfg.gemm] = (key, w_q)
        else:
            self._weight_cache.pop(cfg.gemm, None)
            if weight.data_ptr() == params[0].data_ptr():
                cfg.weight_src = weight
        return w_q

    def _cached_weight_compiled(self, cfg: GemmFP8, params, weight, is_first_microbatch, amax_group) -> Float8Tensor:
        """_cached_weight in a torch.compile graph. The version counters cannot key a cache there: a graph
        specialises on their values, so every optimizer step would recompile it. So without TE's micro-batch
        flag the weight is cast in every forward, inside the graph (the same bytes as eager mode's in
        training, where eager mode casts every forward too; a no_grad forward also casts, with the scale
        it has now). is_first_microbatch keeps its meaning: True casts and keeps the cast, False reuses
        it (the key holds no versions, so the graph for False reads nothing that changes per step). The
        graph keeps W for backward itself (no WeightSource: its version check cannot be traced)."""
        fmt = cfg.recipe.fp8_format
        key = (None, fmt.fwd_dtype, cfg.quantizers.weight.cache_key)
        if is_first_microbatch is False and not self._always_recast:
            hit = self._weight_cache.get(cfg.gemm)
            if hit is not None and hit[0] == key:
                return hit[1]
        with torch.no_grad():
            w_q = cfg.quantize_weight(weight.detach(), amax_group)
        if is_first_microbatch is not None:
            self._weight_cache[cfg.gemm] = (key, w_q)
        return w_q


class GemmModule(FP8Module, TensorParallelMixin):
    """Base of Linear, LayerNormLinear and LayerNormMLP: how each of their GEMMs is split over the TP
    group (`_linear_parallel`) and run (`_gemm_plan`, `_linear_forward`)."""

    def _init_tp(self, owner: str, tp_group, tp_size: int, sequence_parallel: bool) -> None:
        super()._init_tp(owner, tp_group, tp_size, sequence_parallel)
        register_whole_tensor_hooks(self)  # state_dict() holds TP shards as whole tensors (parallel/dcp.py)

    def _check_tp_ready(self, device: torch.device) -> None:
        if not self._tp_checked:  # (the first forward's checks; a meta module fails them until materialised)
            check_materialized(self)
        if torch.compiler.is_compiling():
            # checked while tracing, and no flag written: a graph guards on the flag it read (flipping it
            # would make the next call recompile), and a write is a side effect that a checkpointed region
            # cannot trace
            if not self._tp_checked:
                self._tp_checks(device)
            return
        super()._check_tp_ready(device)

    def _linear_parallel(self, mode: Optional[str], inp: torch.Tensor, ub: Optional[UbSettings] = None,
                         scatter_rows: Optional[int] = None) -> LinearParallel:
        """scatter_rows: the rows a row-parallel GEMM's output will have before its reduce-scatter under SP
        (default: inp's dim 0; a LayerNormMLP's fc2 gets the gathered sequence, tp × its local input)."""
        if not self._tp_checked:
            self._check_tp_ready(inp.device)
        fp8_gather = getattr(self, "fp8_all_gather", True)
        sum_bias = getattr(self, "allreduce_sp_grads", True)
        # The same settings give the same (frozen) LinearParallel: made once, not per call. (While tracing it
        # is made anew: it costs nothing in a graph, and a cache filled while tracing would be guarded on.)
        key = (mode, self.tp_group, self.sequence_parallel, fp8_gather, ub, sum_bias)
        compiling = torch.compiler.is_compiling()
        cache = {} if compiling else self.__dict__.setdefault("_par_cache", {})
        par = cache.get(key)
        if par is None:
            if ub is None:
                par = LinearParallel(mode, self.tp_group, self.sequence_parallel, fp8_gather, sum_sp_bias_grad=sum_bias)
            else:
                ub.comm.check_group(type(self).__name__, self.tp_group)
                par = LinearParallel(mode, self.tp_group, self.sequence_parallel, fp8_gather, ub.comm, ub.fprop,
                                     ub.dgrad, ub.rs_dgrad, sum_sp_bias_grad=sum_bias)
            if len(cache) > 8:  # a module whose group keeps changing: keep only the latest
                cache.clear()
            cache[key] = par
        if par.active and mode == "row" and par.sequence_parallel and inp.dim() > 1:
            check_scatter_dim(type(self).__name__, inp.shape[0] if scatter_rows is None else scatter_rows, self.tp_size)
        return par

    def _gemm_plan(self, params: LinearParams, gemm: int, inp: torch.Tensor, is_first_microbatch, frame,
                   par: LinearParallel, in_tokens: Optional[int] = None):
        """(weight, bias, LinearFunction plan) of GEMM number `gemm` for an input like `inp` ([..., K]; or
        any tensor on the input's device with the token count given as `in_tokens`)."""
        weights = params.weights(self)
        weight, bias = cat_params(weights), params.bias(self)
        if in_tokens is None:
            in_tokens = inp.numel() // max(inp.shape[-1], 1)
        if frame is not None and below_fp8_size(frame, inp.is_cuda, in_tokens, weight.shape[1], weight.shape[0], par):
            frame = None  # a GEMM below the recipe's min_fp8_gemm runs in high precision
        if frame is not None and (weight.shape[0] | weight.shape[1]) & 15:
            raise ValueError(
                f"{type(self).__name__}: FP8 GEMMs need in and out features that are multiples of 16 (TE's rule; "
                f"any token count is fine), got a weight of {tuple(weight.shape)} on this rank; use such sizes or run "
                "this layer outside fp8_autocast")
        if frame is not None and frame.enabled and not frame.quantizers.per_tensor and par.ub is not None:
            raise ValueError(f"{type(self).__name__}: comm-GEMM overlap (ub_*) runs with per-tensor recipes "
                             f"(DelayedScaling, Float8CurrentScaling), not {type(frame.recipe).__name__}; turn the ub_* "
                             f"flags off for it")
        fp8 = self._gemm_fp8(frame, gemm, weights, weight, is_first_microbatch, par.amax_group)
        targets = params.wgrad_targets(self) if self.fuse_wgrad_accumulation else None
        return weight, bias, GemmPlan(fp8, targets, par, torch.is_grad_enabled())

    def _linear_forward(self, params: LinearParams, gemm: int, inp: torch.Tensor, is_first_microbatch, frame,
                        add_bias: bool = True, par: LinearParallel = LinearParallel(),
                        residual: Optional[torch.Tensor] = None):
        """Run GEMM number `gemm` on `inp` (+ residual); returns (out, bias-or-None)."""
        weight, bias, plan = self._gemm_plan(params, gemm, inp, is_first_microbatch, frame, par)
        return run_linear(inp, weight, bias, plan, add_bias, residual, type(self).__name__), bias


def run_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan, add_bias: bool = True,
               residual: Optional[torch.Tensor] = None, owner: str = "Linear"):
    """out = inp·Wᵀ (+ bias when add_bias) (+ residual: in the FP8 GEMM's epilogue where residual_in_gemm
    holds, else added after) by a GEMM plan of GemmModule._gemm_plan."""
    bias = bias if add_bias else None
    if residual is not None and residual_in_gemm(plan, residual, inp.dtype):
        check_residual(owner, residual, (*inp.shape[:-1], weight.shape[0]), inp.dtype)  # (one rank: out's shape)
        return LinearFunction.apply(inp, weight, bias, plan, None, residual)
    if plan.fp8 is None and plan.targets is None and not plan.par.active:
        out = torch_linear(inp, weight, bias, True)
    else:
        out = LinearFunction.apply(inp, weight, bias, plan)
    return out if residual is None else add_residual(owner, out, residual)


def check_parallel_mode(owner: str, parallel_mode) -> None:
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")


@dataclass(frozen=True)
class UbSettings:
    """Comm-GEMM overlap of one GEMM of a module: the communicator and the OverlapConfig of each pass
    that overlaps (None: that pass runs its plain collective)."""

    comm: CommOverlap
    fprop: Optional[OverlapConfig]
    dgrad: Optional[OverlapConfig]
    rs_dgrad: bool = False  # column: dx reduce-scattered pipelined with dgrad, not under wgrad


def overlap_settings(owner: str, mode: Optional[str], sequence_parallel: bool, ub_comm, ub_name: Optional[str],
                     fprop: bool, dgrad: bool, rs_dgrad: bool = False) -> Optional[UbSettings]:
    """Validates the ub_* arguments of one GEMM; None when nothing overlaps.

    fprop: column AG+GEMM / row GEMM+RS requested; dgrad: row AG+dgrad / column bulk backward requested;
    rs_dgrad (column): the backward's reduce-scatter pipelined with dgrad (ub_overlap_rs_dgrad).
    The communicator's OverlapConfig of each GEMM (ub_cfgs' "<ub_name>_<fprop|dgrad>" entry) can switch it off.
    """
    if not (fprop or dgrad):
        return None
    if ub_comm is None:
        raise ValueError(f"{owner}: comm-GEMM overlap was requested (ub_*=True) but no ub_comm was given; pass "
                         f"ub_comm=te_parallel.initialize_ub(shape, tp_group, ...)")
    if not isinstance(ub_comm, CommOverlap):
        raise TypeError(f"{owner}: ub_comm must be the object returned by initialize_ub, got {type(ub_comm).__name__}")
    if mode is None or not sequence_parallel:
        raise ValueError(f"{owner}: comm-GEMM overlap needs parallel_mode 'column'/'row' with sequence_parallel=True "
                         f"(got parallel_mode={mode!r}, sequence_parallel={sequence_parallel})")
    fprop_cfg, dgrad_cfg = ub_comm.config(ub_name, "fprop"), ub_comm.config(ub_name, "dgrad")
    fprop_cfg = fprop_cfg if fprop and fprop_cfg.enabled else None
    dgrad_cfg = dgrad_cfg if dgrad and dgrad_cfg.enabled else None
    return UbSettings(ub_comm, fprop_cfg, dgrad_cfg, dgrad_cfg is not None and rs_dgrad and mode == "column")


def local_features(owner: str, in_features: int, out_features: int, parallel_mode, tp_size: int):
    """This rank's (in, out): column splits out_features, row splits in_features."""
    if parallel_mode == "column":
        return in_features, check_divisible(owner, "out_features", out_features, tp_size)
    if parallel_mode == "row":
        return check_divisible(owner, "in_features", in_features, tp_size), out_features
    return in_features, out_features


def mark_sequence_parallel(module: nn.Module, names) -> None:
    """Megatron's marker on parameters whose gradient is partial per rank under sequence parallelism
    (te_parallel all-reduces those itself unless told not to; the marker lets other tools see it)."""
    if getattr(module, "sequence_parallel", False):
        for n in names:
            p = getattr(module, n, None)
            if p is not None:
                p.sequence_parallel = True


def torch_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], add_bias: bool = True):
    """inp·Wᵀ (+ b) by torch's own linear, in inp's dtype: for a GEMM where te_parallel has nothing to
    do (one rank, no FP8 — none on, or a GEMM below Recipe.min_fp8_gemm — no fused wgrad
    accumulation). torch's linear and its C++ backward cost about half the host time of
    LinearFunction and its Python backward, and a small layer's step is mostly host time."""
    dtype = inp.dtype
    w = weight if weight.dtype == dtype else weight.to(dtype)
    b = None if bias is None or not add_bias else (bias if bias.dtype == dtype else bias.to(dtype))
    return torch.nn.functional.linear(inp, w, b)


def below_fp8_size(frame, is_cuda: bool, tokens: int, k: int, n: int, par: LinearParallel) -> bool:
    """True when this GEMM (M·K·N on this rank, M gathered under SP) is below the recipe's FP8 size on
    CUDA (te_parallel.fp8.gemm_size). Never with comm-GEMM overlap (its buffers were sized for the FP8
    bytes) or on the CPU."""
    if not (frame.enabled and is_cuda) or par.ub is not None:
        return False
    if frame.recipe.min_fp8_gemm == 0:
        return False
    if par.gathers_input:
        tokens *= group_size(par.group)
    return gemm_size.below_threshold(frame.recipe, tokens, k, n)


def add_norm_params(module: nn.Module, hidden_size: int, normalization: str, zero_centered_gamma: bool,
                    device, dtype) -> None:
    """`layer_norm_weight` (and `layer_norm_bias` for LayerNorm), TE's names."""
    check_normalization(normalization)
    init = torch.zeros if zero_centered_gamma else torch.ones
    module.layer_norm_weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
    bias = torch.zeros(hidden_size, device=device, dtype=dtype) if normalization == "LayerNorm" else None
    module.layer_norm_bias = None if bias is None else nn.Parameter(bias)


def _norm_params(module: nn.Module):
    """The norm's (weight, bias). Under sequence parallelism the norm sees 1/tp of the tokens, so its
    γ/β gradients are partial: all-reduced over the TP group here (TE leaves that to the caller)."""
    weight, bias = module.layer_norm_weight, module.layer_norm_bias
    if module.sequence_parallel and module.tp_size > 1 and module.allreduce_sp_grads:
        weight, bias = all_reduce_grad(weight, module.tp_group), all_reduce_grad(bias, module.tp_group)
    return weight, bias


def norm_forward(module: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    """The norm on this rank's tokens, in inp's dtype."""
    weight, bias = _norm_params(module)
    return norm_outside_autocast(apply_norm, inp, module.normalization, inp, weight, bias, module.eps,
                                 module.zero_centered_gamma)


def norm_to_fp8(module: nn.Module, inp: torch.Tensor, weight: torch.Tensor, plan):
    """(carrier, FP8 norm output) where the norm can write the first GEMM's FP8 input itself (one
    native pass: norm, cast, its transposed copy for wgrad, amax), else None.

    The case: that GEMM casts its input on this rank with a scale known before the pass (delayed
    scaling; current scaling needs the output's amax first, block scaling each tile's), no gather or
    comm-GEMM overlap of the input, the norm output not returned, the native kernels usable (CUDA, not
    compiling). The carrier ([tokens, hidden], no storage) goes to the GEMM's Function as its input and
    brings the norm's output gradient back to the norm's backward (te_parallel.ops.norm.layer_norm_fp8)."""
    fp8, targets, par, grad = plan.fp8, plan.targets, plan.par, plan.grad
    if (fp8 is None or not fp8.compute or not fp8.quantizers.input.scale_known_before_cast or par.gathers_input
            or par.overlap_fprop or module.return_layernorm_output):
        return None
    if not fp8_norm_fused(inp, module.layer_norm_weight, module.layer_norm_bias):
        return None
    norm_weight, norm_bias = _norm_params(module)
    scale, amax = fp8.input_scale()
    need_wgrad = grad and (weight.requires_grad or bool(targets))
    x_q, carrier = norm_fp8(module.normalization, inp, norm_weight, norm_bias, module.eps, module.zero_centered_gamma,
                            scale=scale, fp8_dtype=fp8.quantizers.input.fp8_dtype, amax_out=amax,
                            transpose=need_wgrad)
    return carrier, x_q


def norm_outside_autocast(fn, x: torch.Tensor, *args):
    """fn(*args), a norm of x already in the activation dtype. torch.autocast would run it in fp32 and
    return fp32; the modules' activations stay in the autocast dtype (as TE's do), so the norm runs
    outside autocast (F.layer_norm / rms_norm compute in fp32 internally and round once)."""
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return fn(*args)
    return fn(*args)


def pack_outputs(out, bias, ln_out, return_bias: bool, return_layernorm_output: bool):
    """TE's output order: out[, bias][, ln_out]."""
    result = (out,)
    if return_bias:
        result += (bias,)
    if return_layernorm_output:
        result += (ln_out,)
    return result[0] if len(result) == 1 else result
