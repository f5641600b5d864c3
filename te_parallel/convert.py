"""te.convert: swap torch.nn.Linear / LayerNorm / RMSNorm in an existing model for te_parallel modules.

    model = te.convert(model)                                          # single device, FP8-capable
    model = te.convert(model, tp_group=group, plan=te.LLAMA_TP_PLAN)   # + tensor parallelism

Weights are copied (sharded where the plan says), so outputs are unchanged in fp32 (up to
RMSNorm's rounding order); FP8 then comes from `fp8_autocast`. `plan` maps fnmatch patterns of
qualified module names to "column" or "row"; the first matching pattern wins. A column-parallel
Linear outputs its shard of the features, a row-parallel one takes a shard and all-reduces its
output, so a plan must pair them (q/k/v and gate/up column, o/down row) around code that is
agnostic to the local width (Hugging Face Llama reshapes heads with -1, which is). Sequence
parallelism is not offered here: it needs the [seq, batch, hidden] layout, and most existing models
are batch-first. Only exact `nn.Linear` modules are replaced (subclasses such as the projection
inside nn.MultiheadAttention are used through their weights by other code and are left alone).
"""
from __future__ import annotations

import fnmatch
from typing import Dict, Optional

import torch
from torch import nn

from te_parallel.module.layernorm import LayerNorm, RMSNorm
from te_parallel.module.linear import Linear
from te_parallel.parallel.groups import as_group, group_rank, group_size

LLAMA_TP_PLAN: Dict[str, str] = {
    "*.q_proj": "column", "*.k_proj": "column", "*.v_proj": "column", "*.o_proj": "row",
    "*.gate_proj": "column", "*.up_proj": "column", "*.down_proj": "row",
}


def _mode(name: str, plan: Optional[Dict[str, str]]) -> Optional[str]:
    for pattern, mode in (plan or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            if mode not in ("column", "row"):
                raise ValueError(f"convert: plan[{pattern!r}] must be 'column' or 'row', got {mode!r}")
            return mode
    return None


@torch.no_grad()
def _linear(name: str, old: nn.Linear, mode, tp_group) -> Linear:
    group = as_group("convert", "tp_group", tp_group)[0]  # a ProcessGroup or a 1-D DeviceMesh
    tp, r = group_size(group), group_rank(group)
    new = Linear(old.in_features, old.out_features, bias=old.bias is not None, params_dtype=old.weight.dtype,
                 device=old.weight.device, parallel_mode=mode, tp_group=tp_group if mode else None,
                 init_method=lambda w: None)  # the weights are copied in below: generating them would be wasted
    w = old.weight
    if mode == "column":
        w = w.chunk(tp, 0)[r]
    elif mode == "row":
        w = w.chunk(tp, 1)[r]
    new.weight.copy_(w)
    new.weight.requires_grad_(old.weight.requires_grad)
    if old.bias is not None:
        new.bias.copy_(old.bias.chunk(tp, 0)[r] if mode == "column" else old.bias)
    return new


def _rms_eps(m: nn.Module) -> Optional[float]:
    """eps of an RMSNorm-like module (torch.nn.RMSNorm, Hugging Face *RMSNorm), None if it is not one."""
    if isinstance(m, nn.RMSNorm):
        return m.eps if m.eps is not None else torch.finfo(m.weight.dtype).eps
    if type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter):
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
        return None if eps is None or getattr(m, "bias", None) is not None else float(eps)
    return None


@torch.no_grad()
def _norm(m: nn.Module) -> Optional[nn.Module]:
    if isinstance(m, nn.LayerNorm) and m.elementwise_affine and len(m.normalized_shape) == 1 and m.bias is not None:
        new = LayerNorm(m.normalized_shape[0], eps=m.eps, params_dtype=m.weight.dtype, device=m.weight.device)
        new.weight.copy_(m.weight)
        new.bias.copy_(m.bias)
        return new
    eps = _rms_eps(m)
    if eps is not None and m.weight.dim() == 1:
        new = RMSNorm(m.weight.shape[0], eps=eps, params_dtype=m.weight.dtype, device=m.weight.device)
        new.weight.copy_(m.weight)
        return new
    return None


def convert(model: nn.Module, *, tp_group=None, plan: Optional[Dict[str, str]] = None) -> nn.Module:
    """Replace the model's Linear / LayerNorm / RMSNorm modules in place; returns the model."""
    if plan and tp_group is None:
        raise ValueError("convert: a tensor-parallel plan needs tp_group (the ranks that share each layer)")
    replacements = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            mode = _mode(name, plan) if group_size(as_group("convert", "tp_group", tp_group)[0]) > 1 else None
            replacements.append((name, _linear(name, module, mode, tp_group)))
        else:
            new = _norm(module)
            if new is not None:
                replacements.append((name, new))
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model
