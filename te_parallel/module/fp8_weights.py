"""A GEMM module's FP8 weight parameters (quantized_model_init): made after the constructor's
reset_parameters has written the high-precision values, and re-written by a later reset_parameters.

The weight of one GEMM (all its parameters_split pieces) becomes one Float8Weight buffer with one
scale, the pieces dim-0 views of it registered under the same names, so the forward joins them
without a copy and quantizes nothing (te_parallel/fp8/params.py). reset_parameters writes the values
into high-precision stand-ins registered in their place, and `quantize_weights` encodes them into
the FP8 parameters afterwards, all pieces together (a new scale), after the FP8 state was reset (so
delayed scaling records the weight's amax in the fresh state, as the first forward of a
high-precision weight would).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from te_parallel.fp8.params import Float8Weight, QuantizedInit, current_model_init, write_fp8_weights
from te_parallel.ops.fp8_weight import WeightQuantizer


def high_precision_stand_ins(module: nn.Module, params) -> Optional[List[Float8Weight]]:
    """If `params` (a LinearParams) are FP8 weights: register high-precision stand-ins (views of one
    buffer, values unset) for reset_parameters to write, and return the FP8 parameters; else None."""
    names = params.weight_names
    current = [module._parameters[n] for n in names]
    if not isinstance(current[0], Float8Weight):
        return None
    first = current[0]
    buf = torch.empty(params.bounds[-1][1], *first.shape[1:], dtype=first.dtype, device=first.device)
    for (a, b), name, w in zip(params.bounds, names, current):
        module._parameters[name] = nn.Parameter(buf[a:b] if len(names) > 1 else buf, requires_grad=w.requires_grad)
    return current


def quantize_weights(module: nn.Module, parts: Sequence, saved: Sequence[Optional[List[Float8Weight]]]) -> None:
    """After reset_parameters: write the stand-ins' values into the FP8 parameters that were there
    (`saved`), or, inside quantized_model_init, turn the new high-precision weights into FP8 ones.
    GEMM number i is parts[i] (the index the forward's FP8 plan uses)."""
    init = current_model_init()
    for gemm, ((params, _), fp8) in enumerate(zip(parts, saved)):
        names = params.weight_names
        values = [module._parameters[n] for n in names]
        if fp8 is not None:
            if not values[0].is_meta:
                write_fp8_weights(list(zip(fp8, values)))
                if fp8[0]._hp_init is not None:
                    _keep_init_values(fp8, values)
            for name, w in zip(names, fp8):
                module._parameters[name] = w
        elif init is not None:
            _to_fp8(module, params, gemm, init, values)


def _to_fp8(module: nn.Module, params, gemm: int, init: QuantizedInit, values: List[torch.Tensor]) -> None:
    names = params.weight_names
    whole = values[0] if len(values) == 1 else torch.cat([v.detach() for v in values])
    quantizer = WeightQuantizer(module, gemm, init.recipe)
    data = torch.empty(whole.shape, dtype=quantizer.fp8_dtype, device=whole.device)
    scales = torch.ones(2, dtype=torch.float32, device=whole.device)
    keep = init.preserve_high_precision_init_val and not whole.is_meta
    hp_init = whole.detach().to("cpu", copy=True) if keep else None
    buffer = Float8Weight(data, scales, whole.dtype, quantizer, 1, hp_init)
    if not whole.is_meta:
        write_fp8_weights([(buffer, whole)])
    pieces = [buffer] if len(names) == 1 else [buffer[a:b] for a, b in params.bounds]
    for name, piece, v in zip(names, pieces, values):
        piece._pieces = len(names)
        module._parameters[name] = nn.Parameter(piece, requires_grad=v.requires_grad)


def _keep_init_values(fp8: List[Float8Weight], values: List[torch.Tensor]) -> None:
    """reset_parameters of a model built with preserve_high_precision_init_val: the new initial values."""
    for w, v in zip(fp8, values):
        if w._hp_init is not None:
            w._hp_init.copy_(v.detach())
