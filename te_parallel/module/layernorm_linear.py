"""te.LayerNormLinear: norm (LayerNorm or RMSNorm) followed by a linear layer, one module."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from te_parallel.module.base import (GemmModule, activation_dtype, add_norm_params, check_features, check_input,
                                     check_parallel_mode, local_features, mark_sequence_parallel, norm_forward,
                                     norm_to_fp8, overlap_settings, pack_outputs, resolve_device, resolve_dtype,
                                     run_linear)
from te_parallel.module.params import LinearParams, gemm_layouts, reset_gemm_module
from te_parallel.ops.linear import LinearFunction
from te_parallel.parallel.collectives import gather_from_sp


class LayerNormLinear(GemmModule):
    """y = norm(x)·Wᵀ + b. Arguments and outputs follow TE's `te.LayerNormLinear`.

    Tensor parallelism as in `Linear`; with column + sequence_parallel the norm runs on this rank's
    sequence shard and its FP8 output is gathered. `allreduce_sp_grads` (te_parallel's addition,
    default True): all-reduce the norm's γ/β gradients over the TP group under sequence parallelism.

    forward(inp, is_first_microbatch=None) -> out[, bias if return_bias][, ln_out if return_layernorm_output].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split=None,
        zero_centered_gamma: bool = False,
        device=None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        ub_comm=None,
        allreduce_sp_grads: bool = True,
    ) -> None:
        check_features("LayerNormLinear", in_features=in_features, out_features=out_features)
        check_parallel_mode("LayerNormLinear", parallel_mode)
        bwd = ub_overlap_ag or ub_overlap_rs_dgrad or ub_bulk_dgrad or ub_bulk_wgrad
        self_ub = overlap_settings("LayerNormLinear", parallel_mode, sequence_parallel, ub_comm, ub_name,
                                   fprop=ub_overlap_ag, dgrad=bwd, rs_dgrad=ub_overlap_rs_dgrad)
        if self_ub is not None and parallel_mode != "column":
            raise ValueError("LayerNormLinear: comm-GEMM overlap needs parallel_mode='column'")
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        super().__init__(num_gemms=1, device=device)
        self._init_tp("LayerNormLinear", tp_group, tp_size, sequence_parallel)
        self.get_rng_state_tracker, self.allreduce_sp_grads = get_rng_state_tracker, allreduce_sp_grads
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        full_in = in_features
        in_features, out_features = local_features("LayerNormLinear", in_features, out_features, parallel_mode, self.tp_size)
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.normalization, self.zero_centered_gamma = normalization, zero_centered_gamma
        self.use_bias, self.return_bias = bias, return_bias
        self.return_layernorm_output = return_layernorm_output
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.params_dtype, self.parallel_mode = dtype, parallel_mode
        self.ub = self_ub
        if parallel_mode == "row" and in_features != full_in:
            raise ValueError("LayerNormLinear: parallel_mode='row' would split the normalized features; use 'column'")
        add_norm_params(self, in_features, normalization, zero_centered_gamma, device, dtype)
        divisor = self.tp_size if parallel_mode == "column" else 1
        self._params = LinearParams(self, in_features, out_features, bias=bias, parameters_split=parameters_split,
                                    init_method=init_method, device=device, dtype=dtype, split_divisor=divisor)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the parameters as the constructor does (norm weight 1, or 0 with zero_centered_gamma;
        biases 0; weight by init_method), reset the FP8 scaling state; after `to_empty` this materialises a
        module built on the meta device."""
        reset_gemm_module(self, [(self._params, self.parallel_mode)])
        mark_sequence_parallel(self, ["layer_norm_weight", "layer_norm_bias"])

    def tp_shard_layouts(self):
        """Where this rank's weight and bias sit in the full (TP=1) ones (te_parallel.parallel.sharding)."""
        return gemm_layouts(self, [(self._params, self.parallel_mode)])

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        check_input("LayerNormLinear", inp, self.in_features)
        dtype = activation_dtype(self.param_dtype, inp.device)
        par = self._linear_parallel(self.parallel_mode, inp, self.ub)
        x = inp.to(dtype)
        weight, bias, plan = self._gemm_plan(self._params, 0, x, is_first_microbatch, self._fp8_frame(), par)
        fused = norm_to_fp8(self, x, weight, plan)
        if fused is not None:  # the norm writes the GEMM's FP8 input: no high-precision ln_out
            carrier, x_q = fused
            out = LinearFunction.apply(carrier, weight, None if self.return_bias else bias, plan, x_q)
            out, ln_out = out.view(*x.shape[:-1], out.shape[-1]), None
        else:
            ln_out = norm_forward(self, x)
            out = run_linear(ln_out, weight, bias, plan, add_bias=not self.return_bias)
        bias = None if bias is None else bias.to(dtype)
        if self.return_layernorm_output and self.return_layernorm_output_gathered and par.gathers_input:
            ln_out = gather_from_sp(ln_out, self.tp_group)
        return pack_outputs(out, bias, ln_out, self.return_bias, self.return_layernorm_output)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"normalization={self.normalization}")
