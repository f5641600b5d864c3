"""te.Linear: y = x·Wᵀ + b with FP8 GEMMs inside `fp8_autocast`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import nn

from te_parallel.module.base import (
    FP8Module,
    activation_dtype,
    cat_params,
    check_features,
    check_input,
    default_init,
    resolve_device,
    resolve_dtype,
    split_sizes,
)
from te_parallel.module.parallel_mixin import TensorParallelMixin
from te_parallel.ops.linear import SINGLE, LinearFunction, LinearParallel, WgradTarget
from te_parallel.parallel.collectives import all_reduce_grad
from te_parallel.parallel.groups import check_divisible, check_scatter_dim, group_size
from te_parallel.parallel.overlap import CommOverlap


class LinearParams:
    """Creates a linear layer's weight [out, in] and bias [out] on `module`, whole or split.

    With `parameters_split` (TE's: names or {name: size}) the parameters are `<name>_weight` /
    `<name>_bias`, views of one buffer so the forward concatenates them without a copy.
    """

    def __init__(self, module: nn.Module, in_features: int, out_features: int, *, bias: bool,
                 parameters_split, init_method: Optional[Callable], device, dtype, prefix: str = "",
                 split_divisor: int = 1) -> None:
        """in/out_features are this rank's (local) sizes; split_divisor: the TP size by which
        `parameters_split` sizes (given for the full layer) are divided."""
        owner = type(module).__name__
        splits = split_sizes(out_features * split_divisor, parameters_split, owner)
        splits = [(name, check_divisible(owner, f"split {name!r} size", size, split_divisor)) for name, size in splits]
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        (init_method or default_init)(weight)
        bias_full = torch.zeros(out_features, device=device, dtype=dtype) if bias else None
        self.weight_names: List[str] = []
        self.bias_names: List[str] = []
        self.bounds = []
        start = 0
        for name, size in splits:
            stop = start + size
            w = weight if len(splits) == 1 else weight[start:stop]
            module.register_parameter(f"{prefix}{name}weight", nn.Parameter(w))
            self.weight_names.append(f"{prefix}{name}weight")
            if bias:
                b = bias_full if len(splits) == 1 else bias_full[start:stop]
                module.register_parameter(f"{prefix}{name}bias", nn.Parameter(b))
                self.bias_names.append(f"{prefix}{name}bias")
            self.bounds.append((start, stop))
            start = stop
        if not bias:
            module.register_parameter(f"{prefix}bias", None)

    # (module._parameters, not getattr: nn.Module.__getattr__ costs about a microsecond per name, and
    # these run on every forward; functional_call and friends swap the entries of _parameters too)
    def weights(self, module) -> List[torch.Tensor]:
        params = module._parameters
        return [params[n] for n in self.weight_names]

    def weight(self, module) -> torch.Tensor:
        return cat_params(self.weights(module))

    def bias(self, module) -> Optional[torch.Tensor]:
        if not self.bias_names:
            return None
        params = module._parameters
        return cat_params([params[n] for n in self.bias_names])

    def wgrad_targets(self, module) -> List[WgradTarget]:
        return [WgradTarget(p, a, b) for p, (a, b) in zip(self.weights(module), self.bounds)]


class Linear(FP8Module, TensorParallelMixin):
    """Applies y = x·Wᵀ + b. Arguments, parameter names and outputs follow TE's `te.Linear`.

    Tensor parallelism (Megatron): parallel_mode="column" splits W on out_features (output
    [.., out/tp]), "row" on in_features (input [.., in/tp], output all-reduced); with
    sequence_parallel the input (column) / output (row) is sharded on dim 0 (the sequence).
    `in_features` / `out_features` attributes hold the local sizes, as in TE.
    forward(inp, is_first_microbatch=None) -> out, or (out, bias) with return_bias=True (the bias
    is then not added, so it can be fused downstream; for row-parallel it is the full bias).
    """

    def __init__(
        self,
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
        parameters_split=None,
        device=None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        ub_comm=None,
    ) -> None:
        check_features("Linear", in_features=in_features, out_features=out_features)
        check_parallel_mode("Linear", parallel_mode)
        if parallel_mode == "row":  # fprop GEMM+RS; dgrad gathers dy under the GEMM
            self_ub = overlap_settings("Linear", parallel_mode, sequence_parallel, ub_comm, ub_name,
                                       fprop=ub_overlap_rs, dgrad=ub_overlap_ag)
        else:  # column fprop AG+GEMM; backward: AG(x) under dgrad, RS(dx) under wgrad
            bwd = ub_overlap_ag or ub_overlap_rs_dgrad or ub_bulk_dgrad or ub_bulk_wgrad
            self_ub = overlap_settings("Linear", parallel_mode, sequence_parallel, ub_comm, ub_name,
                                       fprop=ub_overlap_ag, dgrad=bwd, rs_dgrad=ub_overlap_rs_dgrad)
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        super().__init__(num_gemms=1, device=device)
        self._init_tp("Linear", tp_group, tp_size, sequence_parallel)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.in_features, self.out_features = local_features("Linear", in_features, out_features, parallel_mode, self.tp_size)
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.params_dtype, self.parallel_mode = dtype, parallel_mode
        self.ub = self_ub
        divisor = self.tp_size if parallel_mode == "column" else 1
        self._params = LinearParams(self, self.in_features, self.out_features, bias=bias, parameters_split=parameters_split,
                                    init_method=init_method, device=device, dtype=dtype, split_divisor=divisor)
        mark_sequence_parallel(self, [*self._params.bias_names] if parallel_mode == "row" else [])

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        check_input("Linear", inp, self.in_features)
        dtype = activation_dtype(self.param_dtype, inp.device)
        inp = inp if inp.dtype == dtype else inp.to(dtype)
        frame = self._fp8_frame()
        if self.tp_size == 1 and self.ub is None and not self.fuse_wgrad_accumulation and (
                frame is None or _below_fp8_size(frame, inp.is_cuda, inp.numel() // self.in_features,
                                                 self.in_features, self.out_features, SINGLE)):
            # the short way for a plain one-rank GEMM in high precision (the same as linear_forward's)
            if not self._tp_checked:
                self._check_tp_ready(inp.device)
            params = self._params
            bias = params.bias(self)
            out = torch_linear(inp, params.weight(self), bias, not self.return_bias)
            return (out, None if bias is None else bias.to(dtype)) if self.return_bias else out
        par = self._linear_parallel(self.parallel_mode, inp, self.ub)
        out, bias = linear_forward(self, self._params, 0, inp, is_first_microbatch,
                                   frame, add_bias=not self.return_bias, par=par)
        if not self.return_bias:
            return out
        if par.gathers_grad:  # the caller adds it to its M/tp tokens: sum the grad over the ranks
            bias = all_reduce_grad(bias, par.group)
        return out, None if bias is None else bias.to(dtype)

    def _linear_parallel(self, mode: Optional[str], inp: torch.Tensor, ub: Optional[UbSettings] = None,
                         scatter_rows: Optional[int] = None) -> LinearParallel:
        """scatter_rows: the rows a row-parallel GEMM's output will have before its reduce-scatter under SP
        (default: inp's dim 0; a LayerNormMLP's fc2 gets the gathered sequence, tp × its local input)."""
        if not self._tp_checked:
            self._check_tp_ready(inp.device)
        fp8_gather = getattr(self, "fp8_all_gather", True)
        # The same settings give the same (frozen) LinearParallel: made once, not per call.
        key = (mode, self.tp_group, self.sequence_parallel, fp8_gather, ub)
        cache = self.__dict__.setdefault("_par_cache", {})
        par = cache.get(key)
        if par is None:
            if ub is None:
                par = LinearParallel(mode, self.tp_group, self.sequence_parallel, fp8_gather)
            else:
                ub.comm.check_group(type(self).__name__, self.tp_group)
                par = LinearParallel(mode, self.tp_group, self.sequence_parallel, fp8_gather, ub.comm, ub.fprop,
                                     ub.dgrad, ub.rs_dgrad)
            if len(cache) > 8:  # a module whose group keeps changing: keep only the latest
                cache.clear()
            cache[key] = par
        if par.active and mode == "row" and par.sequence_parallel and inp.dim() > 1:
            check_scatter_dim(type(self).__name__, inp.shape[0] if scatter_rows is None else scatter_rows, self.tp_size)
        return par

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"parallel_mode={self.parallel_mode}, tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}")


def check_parallel_mode(owner: str, parallel_mode) -> None:
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")


@dataclass(frozen=True)
class UbSettings:
    """Comm-GEMM overlap of one GEMM of a module: the communicator and which passes overlap."""

    comm: object  # te_parallel.parallel.overlap.CommOverlap
    fprop: bool
    dgrad: bool
    rs_dgrad: bool = False  # column: dx reduce-scattered pipelined with dgrad, not under wgrad


def overlap_settings(owner: str, mode: Optional[str], sequence_parallel: bool, ub_comm, ub_name: Optional[str],
                     fprop: bool, dgrad: bool, rs_dgrad: bool = False) -> Optional[UbSettings]:
    """Validates the ub_* arguments of one GEMM; None when nothing overlaps.

    fprop: column AG+GEMM / row GEMM+RS requested; dgrad: row AG+dgrad / column bulk backward requested;
    rs_dgrad (column): the backward's reduce-scatter pipelined with dgrad (ub_overlap_rs_dgrad).
    ub_cfgs of the communicator can switch a GEMM off by its "<ub_name>_<fprop|dgrad>" key.
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
    dgrad_on = dgrad and ub_comm.config(ub_name, "dgrad").enabled
    return UbSettings(ub_comm, fprop and ub_comm.config(ub_name, "fprop").enabled, dgrad_on,
                      dgrad_on and rs_dgrad and mode == "column")


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


def linear_forward(module: FP8Module, params: LinearParams, gemm: int, inp: torch.Tensor,
                   is_first_microbatch, frame, add_bias: bool = True, par: LinearParallel = LinearParallel()):
    """Run GEMM number `gemm` of `module` on `inp`; returns (out, bias-or-None)."""
    weight, bias, plan = gemm_plan(module, params, gemm, inp, is_first_microbatch, frame, par)
    if plan[0] is None and plan[1] is None and not par.active:
        return torch_linear(inp, weight, bias, add_bias), bias
    out = LinearFunction.apply(inp, weight, bias if add_bias else None, plan)
    return out, bias


def torch_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], add_bias: bool = True):
    """inp·Wᵀ (+ b) by torch's own linear, in inp's dtype: for a GEMM where te_parallel has nothing to
    do (one rank, no FP8 — none on, or a GEMM below Recipe.min_fp8_gemm — no fused wgrad
    accumulation). torch's linear and its C++ backward cost about half the host time of
    LinearFunction and its Python backward, and a small layer's step is mostly host time."""
    dtype = inp.dtype
    w = weight if weight.dtype == dtype else weight.to(dtype)
    b = None if bias is None or not add_bias else (bias if bias.dtype == dtype else bias.to(dtype))
    return torch.nn.functional.linear(inp, w, b)


def gemm_plan(module: FP8Module, params: LinearParams, gemm: int, inp: torch.Tensor, is_first_microbatch, frame,
              par: LinearParallel, in_tokens: Optional[int] = None):
    """(weight, bias, LinearFunction plan) of GEMM number `gemm` of `module` for an input like `inp`
    ([..., K]; or any tensor on the input's device with the token count given as `in_tokens`)."""
    weights = params.weights(module)
    weight, bias = cat_params(weights), params.bias(module)
    if in_tokens is None:
        in_tokens = inp.numel() // max(inp.shape[-1], 1)
    if frame is not None and _below_fp8_size(frame, inp.is_cuda, in_tokens, weight.shape[1], weight.shape[0], par):
        frame = None  # a small GEMM: high precision is faster (Recipe.min_fp8_gemm)
    fp8 = module._gemm_fp8(frame, gemm, weights, weight, is_first_microbatch, par.amax_group)
    targets = params.wgrad_targets(module) if module.fuse_wgrad_accumulation else None
    return weight, bias, (fp8, targets, par, torch.is_grad_enabled())


def _below_fp8_size(frame, is_cuda: bool, tokens: int, k: int, n: int, par: LinearParallel) -> bool:
    """True when this GEMM (M·K·N on this rank, M gathered under SP) is below the recipe's FP8 size on
    CUDA. Never with comm-GEMM overlap (its buffers were sized for the FP8 bytes) or on the CPU."""
    if not (frame.enabled and is_cuda) or par.ub is not None:
        return False
    if par.gathers_input:
        tokens *= group_size(par.group)
    return tokens * k * n < frame.recipe.min_gemm()
