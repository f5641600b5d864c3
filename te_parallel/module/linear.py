"""te.Linear: y = x·Wᵀ + b with FP8 GEMMs inside `fp8_autocast`."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from te_parallel.fp8 import autocast as _autocast
from te_parallel.fp8.params import Float8Weight
from te_parallel.module.base import (
    GemmModule,
    activation_dtype,
    add_residual,
    below_fp8_size,
    check_features,
    check_input,
    check_parallel_mode,
    check_residual,
    local_features,
    mark_sequence_parallel,
    overlap_settings,
    resolve_device,
    resolve_dtype,
    torch_linear,
)
from te_parallel.module.params import LinearParams, gemm_layouts, reset_gemm_module
from te_parallel.native import torch_ops as native_ops
from te_parallel.ops.linear import SINGLE, OneCallFP8Linear
from te_parallel.parallel.collectives import all_reduce_grad


class Linear(GemmModule):
    """Applies y = x·Wᵀ + b. Arguments, parameter names and outputs follow TE's `te.Linear`.

    Tensor parallelism (Megatron): parallel_mode="column" splits W on out_features (output
    [.., out/tp]), "row" on in_features (input [.., in/tp], output all-reduced); with
    sequence_parallel the input (column) / output (row) is sharded on dim 0 (the sequence).
    `in_features` / `out_features` attributes hold the local sizes, as in TE.
    forward(inp, is_first_microbatch=None) -> out, or (out, bias) with return_bias=True (the bias
    is then not added, so it can be fused downstream; for row-parallel it is the full bias).
    forward(..., residual=t) (te_parallel's addition) returns out + t, t of out's shape and dtype: in the FP8
    GEMM's epilogue on one rank (te_parallel.ops.linear.residual_in_gemm), else added after the GEMM (and
    after its TP reduction).
    allreduce_sp_grads (te_parallel's addition, default True): under sequence parallelism the caller adds
    a row-parallel bias returned by return_bias=True to its 1/tp of the tokens, so its gradient is partial;
    True sums it over the TP group here, False leaves that to the caller, as TE does (the bias carries
    Megatron's `sequence_parallel` marker, which Megatron's gradient finalisation reduces).
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
        allreduce_sp_grads: bool = True,
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
        self.fuse_wgrad_accumulation, self.allreduce_sp_grads = fuse_wgrad_accumulation, allreduce_sp_grads
        self.params_dtype, self.parallel_mode = dtype, parallel_mode
        self.ub = self_ub
        divisor = self.tp_size if parallel_mode == "column" else 1
        self._params = LinearParams(self, self.in_features, self.out_features, bias=bias, parameters_split=parameters_split,
                                    init_method=init_method, device=device, dtype=dtype, split_divisor=divisor)
        self._sp_params = [*self._params.bias_names] if parallel_mode == "row" else []
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the parameters as the constructor does (weight by init_method, bias 0), reset the FP8
        scaling state; after `to_empty` this materialises a module built on the meta device."""
        reset_gemm_module(self, [(self._params, self.parallel_mode)])
        mark_sequence_parallel(self, self._sp_params)

    def tp_shard_layouts(self):
        """Where this rank's weight and bias sit in the full (TP=1) ones (te_parallel.parallel.sharding)."""
        return gemm_layouts(self, [(self._params, self.parallel_mode)])

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, *,
                residual: Optional[torch.Tensor] = None):
        frame = _autocast.current_frame()
        if frame is not None and not frame.enabled:
            frame = frame if frame.calibrating else None
        elif (frame is not None and residual is None and type(inp) is torch.Tensor and inp.is_cuda
              and not torch.compiler.is_compiling()):
            out = self._fp8_one_call(inp, frame, is_first_microbatch)
            if out is not None:
                return out
        check_input("Linear", inp, self.in_features)
        dtype = activation_dtype(self.param_dtype, inp.device)
        inp = inp if inp.dtype == dtype else inp.to(dtype)
        if residual is not None:
            check_residual("Linear", residual, None, dtype)
        if self.tp_size == 1 and self.ub is None and not self.fuse_wgrad_accumulation and (
                frame is None or below_fp8_size(frame, inp.is_cuda, inp.numel() // self.in_features,
                                                self.in_features, self.out_features, SINGLE)):
            # the short way for a plain one-rank GEMM in high precision (the same as _linear_forward's)
            if not self._tp_checked:
                self._check_tp_ready(inp.device)
            params = self._params
            bias = params.bias(self)
            out = torch_linear(inp, params.weight(self), bias, not self.return_bias)
            if residual is not None:
                out = add_residual("Linear", out, residual)
            return (out, None if bias is None else bias.to(dtype)) if self.return_bias else out
        par = self._linear_parallel(self.parallel_mode, inp, self.ub)
        out, bias = self._linear_forward(self._params, 0, inp, is_first_microbatch, frame,
                                         add_bias=not self.return_bias, par=par, residual=residual)
        if not self.return_bias:
            return out
        if par.gathers_grad and self.allreduce_sp_grads:  # the caller adds it to its M/tp tokens: sum the grad
            bias = all_reduce_grad(bias, par.group)
        return out, None if bias is None else bias.to(dtype)

    def _fp8_one_call(self, inp: torch.Tensor, frame, is_first_microbatch) -> Optional[torch.Tensor]:
        """The FP8 forward in one native call (ops.linear.OneCallFP8Linear) where that is the whole job: one
        rank, no comm-GEMM overlap, fused wgrad, returned bias, size threshold, checkpoint replay, torch.autocast
        or tracing; a recipe on the native GEMM; a high-precision weight; an input of the weight's dtype that
        the op takes (contiguous, M, K, N multiples of 16). The same casts, scales, amax records and saved
        operands as the general path (_linear_forward), at a fraction of its host time (docs/benchmarks.md,
        "Host time"). Recipes whose fprop operands the op makes (GemmQuantizers.native_fprop). None where the
        case is another (the general path runs it)."""
        recipe, params = frame.recipe, self._params
        if (recipe.min_fp8_gemm or not frame.quantizers.native_fprop or self.tp_size != 1 or self.ub is not None
                or self.fuse_wgrad_accumulation or self.return_bias or not self._tp_checked
                or len(params.weight_names) != 1
                or recipe.fp8_gemm_fprop.backend != "native" or _autocast.checkpoint_stash() is not None
                or torch.is_autocast_enabled("cuda")):
            return None
        weight = self._parameters[params.weight_names[0]]
        bias = self._parameters[params.bias_names[0]] if params.bias_names else None
        dtype, k, n = inp.dtype, self.in_features, self.out_features
        if (dtype is not weight.dtype or isinstance(weight, Float8Weight) or inp.dim() < 2
                or inp.shape[-1] != k or not inp.is_contiguous() or inp.numel() == 0 or ((inp.numel() // k) | k | n) & 15
                or not (dtype is torch.bfloat16 or dtype is torch.float16 or dtype is torch.float32)
                or not (bias is None or (bias.dtype is dtype and dtype is not torch.float32))  # cuBLASLt's epilogue
                or not native_ops.usable()):
            return None
        cfg = self._gemm_fp8(frame, 0, (weight,), weight, is_first_microbatch)  # scales, amax records, W
        return OneCallFP8Linear.run(inp, weight, bias, cfg)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"parallel_mode={self.parallel_mode}, tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}")
