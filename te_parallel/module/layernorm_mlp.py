"""te.LayerNormMLP: norm → fc1 → activation → fc2, one module with two FP8 GEMMs."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from te_parallel.fp8 import recompute
from te_parallel.module.base import (GemmModule, activation_dtype, add_norm_params, check_features, check_input,
                                     mark_sequence_parallel, norm_forward, norm_to_fp8, overlap_settings, pack_outputs,
                                     resolve_device, resolve_dtype, add_residual, check_residual)
from te_parallel.module.params import LinearParams, gemm_layouts, reset_gemm_module
from te_parallel.parallel.collectives import all_reduce_grad, gather_from_sp
from te_parallel.parallel.groups import check_divisible
from te_parallel.ops.activation import apply_activation, check_activation, is_gated
from te_parallel.ops.linear import LinearFunction, residual_in_gemm
from te_parallel.ops.mlp import DEFAULT_BWD_CHUNK_BYTES, FusedMLPFunction, MLPPlan, can_fuse


class LayerNormMLP(GemmModule):
    """y = fc2(act(fc1(norm(x)))). Arguments, parameter names and outputs follow TE's `te.LayerNormMLP`.

    Gated activations (geglu, reglu, swiglu, qgeglu, sreglu) give fc1 2·ffn_hidden_size outputs.
    With set_parallel_mode=True and a TP group: fc1 column-parallel, fc2 row-parallel (Megatron's
    MLP: one collective each way); a gated fc1 shard holds [a_r; b_r], this rank's rows of each
    half, so the activation stays local. Under sequence_parallel the norm sees 1/tp of the tokens
    and its γ/β gradients, and those of an fc2 bias returned by return_bias, are all-reduced here
    (`allreduce_sp_grads`, default True; False leaves them to the caller, as TE does).
    bwd_chunk_bytes (te_parallel's addition): the backward makes fc2's data gradient, the largest
    tensor of the step, in row chunks of about this many bytes (ops.mlp), bounding peak memory.
    checkpoint (TE's selective recompute): keep only the input for backward and recompute the module's
    forward there (te.checkpoint: bit-identical, FP8 scales and quantized weights replayed), so fc1's
    output and the activation are not held from forward to backward.
    forward(inp, is_first_microbatch=None) -> out[, fc2 bias if return_bias][, ln_out if return_layernorm_output].
    forward(..., residual=t) (te_parallel's addition) returns out + t, t of out's shape and dtype: in fc2's
    FP8 epilogue on one rank (te_parallel.ops.linear.residual_in_gemm), else added after fc2.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker=None,
        tp_group=None,
        tp_size: int = 1,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        output_layer_init_method: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device=None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_comm=None,
        allreduce_sp_grads: bool = True,
        bwd_chunk_bytes: int = DEFAULT_BWD_CHUNK_BYTES,
        checkpoint: bool = False,
    ) -> None:
        check_features("LayerNormMLP", hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                       bwd_chunk_bytes=bwd_chunk_bytes)
        check_activation(activation)
        # fc1 (column): AG+GEMM in fprop, bulk overlaps in backward; fc2 (row): GEMM+RS, AG(dy) under dgrad.
        mode = "column" if set_parallel_mode else None
        fc1_bwd = ub_overlap_ag or ub_overlap_rs_dgrad or ub_bulk_dgrad or ub_bulk_wgrad
        self.ub_fc1 = overlap_settings("LayerNormMLP", mode, sequence_parallel, ub_comm, "fc1",
                                       fprop=ub_overlap_ag, dgrad=fc1_bwd, rs_dgrad=ub_overlap_rs_dgrad)
        self.ub_fc2 = overlap_settings("LayerNormMLP", mode and "row", sequence_parallel, ub_comm, "fc2",
                                       fprop=ub_overlap_rs, dgrad=ub_overlap_ag)
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        super().__init__(num_gemms=2, device=device)
        self._init_tp("LayerNormMLP", tp_group, tp_size, sequence_parallel)
        self.get_rng_state_tracker, self.allreduce_sp_grads = get_rng_state_tracker, allreduce_sp_grads
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        split = self.tp_size if set_parallel_mode else 1
        ffn_local = check_divisible("LayerNormMLP", "ffn_hidden_size", ffn_hidden_size, split)
        self.hidden_size, self.ffn_hidden_size, self.eps = hidden_size, ffn_hidden_size, eps
        self.normalization, self.activation = normalization, activation
        self.zero_centered_gamma, self.use_bias, self.return_bias = zero_centered_gamma, bias, return_bias
        self.return_layernorm_output = return_layernorm_output
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.params_dtype, self.set_parallel_mode = dtype, set_parallel_mode
        self.bwd_chunk_bytes, self.checkpoint = bwd_chunk_bytes, bool(checkpoint)
        add_norm_params(self, hidden_size, normalization, zero_centered_gamma, device, dtype)
        gated = is_gated(activation)  # fc1's local rows are [a_r; b_r]: two blocks of the full weight
        common = dict(bias=bias, parameters_split=None, device=device, dtype=dtype)
        self._fc1 = LinearParams(self, hidden_size, 2 * ffn_local if gated else ffn_local, init_method=init_method,
                                 prefix="fc1_", row_blocks=(ffn_local, ffn_local) if gated else None, **common)
        # TE's rule: fc2 takes output_layer_init_method, the default init when that is None
        self._fc2 = LinearParams(self, ffn_local, hidden_size, prefix="fc2_", init_method=output_layer_init_method,
                                 **common)
        self.reset_parameters()

    def _param_parts(self):
        mode = self.set_parallel_mode and self.tp_size > 1
        return [(self._fc1, "column" if mode else None), (self._fc2, "row" if mode else None)]

    def reset_parameters(self) -> None:
        """Initialise the parameters as the constructor does (norm weight 1, or 0 with zero_centered_gamma;
        biases 0; fc1 by init_method, fc2 by output_layer_init_method), reset the FP8 scaling state; after
        `to_empty` this materialises a module built on the meta device."""
        reset_gemm_module(self, self._param_parts())
        mark_sequence_parallel(self, ["layer_norm_weight", "layer_norm_bias", "fc2_bias"])

    def tp_shard_layouts(self):
        """Where this rank's parameters sit in the full (TP=1) ones: fc1 column (gated: two pieces), fc2 row."""
        return gemm_layouts(self, self._param_parts())

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, *,
                residual: Optional[torch.Tensor] = None):
        if self.checkpoint and torch.is_grad_enabled():
            return recompute.checkpoint(self._forward, inp, is_first_microbatch, residual)
        return self._forward(inp, is_first_microbatch, residual)

    def _forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool], residual: Optional[torch.Tensor]):
        check_input("LayerNormMLP", inp, self.hidden_size)
        dtype = activation_dtype(self.param_dtype, inp.device)
        frame = self._fp8_frame()
        fc1_par = self._linear_parallel("column" if self.set_parallel_mode else None, inp, self.ub_fc1)
        gathered = self.tp_size if fc1_par.gathers_input else 1  # fc1's input rows -> fc2's rows (SP gather)
        fc2_par = self._linear_parallel("row" if self.set_parallel_mode else None, inp, self.ub_fc2,
                                        scatter_rows=inp.shape[0] * gathered)
        x = inp.to(dtype)
        w1, b1, plan1 = self._gemm_plan(self._fc1, 0, x, is_first_microbatch, frame, fc1_par)
        tokens = x.numel() // self.hidden_size * gathered
        w2, fc2_bias, plan2 = self._gemm_plan(self._fc2, 1, x, is_first_microbatch, frame, fc2_par,
                                              in_tokens=tokens)
        b2 = None if self.return_bias else fc2_bias
        if residual is not None:  # (out has inp's shape: fc2's reduce-scatter undoes fc1's gather)
            check_residual("LayerNormMLP", residual, x.shape, dtype)
        acc = residual if residual_in_gemm(plan2, residual, dtype) else None  # (else added after fc2)
        fused = norm_to_fp8(self, x, w1, plan1)
        mlp_plan = MLPPlan(self.activation, plan1, plan2, self.bwd_chunk_bytes)
        fuse = can_fuse(self.activation, x)
        if fused is not None and fuse:  # the norm writes fc1's FP8 input: no high-precision ln_out
            carrier, x_q = fused
            out = FusedMLPFunction.apply(carrier, w1, b1, w2, b2, mlp_plan, x_q, acc, x.shape[:-1])
            ln_out = None
        elif fuse:  # one Function: FP8 activation casts, chunked backward
            ln_out = norm_forward(self, x)
            out = FusedMLPFunction.apply(ln_out, w1, b1, w2, b2, mlp_plan, None, acc)
        else:  # (under torch.compile without the activation kernels) fc1, the activation and fc2 apart
            if fused is not None:  # ([tokens, hidden] carrier: 2-D outputs)
                carrier, x_q = fused
                fc1_out, ln_out = LinearFunction.apply(carrier, w1, b1, plan1, x_q), None
            else:
                ln_out = norm_forward(self, x)
                fc1_out = LinearFunction.apply(ln_out, w1, b1, plan1)
            act = apply_activation(self.activation, fc1_out)
            out = LinearFunction.apply(act, w2, b2, plan2, None, acc)
            out = out.view(*x.shape[:-1], out.shape[-1])
        if residual is not None and acc is None:
            out = add_residual("LayerNormMLP", out, residual)
        fc2_bias = None if fc2_bias is None else fc2_bias.to(dtype)
        if self.return_bias and fc2_par.gathers_grad and self.allreduce_sp_grads:
            fc2_bias = all_reduce_grad(fc2_bias, self.tp_group)
        if self.return_layernorm_output and self.return_layernorm_output_gathered and fc1_par.gathers_input:
            ln_out = gather_from_sp(ln_out, self.tp_group)
        return pack_outputs(out, fc2_bias, ln_out, self.return_bias, self.return_layernorm_output)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}")
