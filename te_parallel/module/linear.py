"""te.Linear: y = x·Wᵀ + b with FP8 GEMMs inside `fp8_autocast`."""
from __future__ import annotations

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
from te_parallel.ops.linear import WgradTarget, linear


def reject_tensor_parallel(owner: str, tp_group=None, tp_size: int = 1, sequence_parallel: bool = False,
                           parallel_mode=None, **ub_flags) -> None:
    """Until tensor parallelism lands, accept only the single-rank values of its arguments."""
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
    group_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    if tp_size != 1 or group_size != 1 or sequence_parallel or any(ub_flags.values()):
        raise NotImplementedError(
            f"{owner}: tensor/sequence parallelism and comm-GEMM overlap are not implemented in this version "
            f"(got tp_size={tp_size}, tp_group size={group_size}, sequence_parallel={sequence_parallel}, "
            f"{', '.join(k for k, v in ub_flags.items() if v) or 'no ub flags'})"
        )


class LinearParams:
    """Creates a linear layer's weight [out, in] and bias [out] on `module`, whole or split.

    With `parameters_split` (TE's: names or {name: size}) the parameters are `<name>_weight` /
    `<name>_bias`, views of one buffer so the forward concatenates them without a copy.
    """

    def __init__(self, module: nn.Module, in_features: int, out_features: int, *, bias: bool,
                 parameters_split, init_method: Optional[Callable], device, dtype, prefix: str = "") -> None:
        owner = type(module).__name__
        splits = split_sizes(out_features, parameters_split, owner)
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

    def weights(self, module) -> List[torch.Tensor]:
        return [getattr(module, n) for n in self.weight_names]

    def weight(self, module) -> torch.Tensor:
        return cat_params(self.weights(module))

    def bias(self, module) -> Optional[torch.Tensor]:
        return cat_params([getattr(module, n) for n in self.bias_names]) if self.bias_names else None

    def wgrad_targets(self, module) -> List[WgradTarget]:
        return [WgradTarget(p, a, b) for p, (a, b) in zip(self.weights(module), self.bounds)]


class Linear(FP8Module):
    """Applies y = x·Wᵀ + b. Arguments, parameter names and outputs follow TE's `te.Linear`.

    forward(inp, is_first_microbatch=None) -> out, or (out, bias) with return_bias=True (the bias
    is then not added, so it can be fused downstream).
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
        ub_name: Optional[str] = None,
    ) -> None:
        check_features("Linear", in_features=in_features, out_features=out_features)
        reject_tensor_parallel("Linear", tp_group, tp_size, sequence_parallel, parallel_mode,
                               ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs)
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        super().__init__(num_gemms=1, device=device)
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.params_dtype, self.parallel_mode = dtype, parallel_mode
        self._params = LinearParams(self, in_features, out_features, bias=bias, parameters_split=parameters_split,
                                    init_method=init_method, device=device, dtype=dtype)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        check_input("Linear", inp, self.in_features)
        dtype = activation_dtype(self.params_dtype, inp.device)
        out, bias = linear_forward(self, self._params, 0, inp.to(dtype), is_first_microbatch,
                                   self._fp8_frame(), add_bias=not self.return_bias)
        return (out, bias.to(dtype)) if self.return_bias else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}"


def linear_forward(module: FP8Module, params: LinearParams, gemm: int, inp: torch.Tensor,
                   is_first_microbatch, frame, add_bias: bool = True):
    """Run GEMM number `gemm` of `module` on `inp`; returns (out, bias-or-None)."""
    weights = params.weights(module)
    weight, bias = params.weight(module), params.bias(module)
    fp8 = module._gemm_fp8(frame, gemm, weights, weight, is_first_microbatch)
    targets = params.wgrad_targets(module) if module.fuse_wgrad_accumulation else None
    out = linear(inp, weight, bias if add_bias else None, fp8, targets)
    return out, bias
