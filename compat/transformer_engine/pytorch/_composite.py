"""What compat's MultiheadAttention and TransformerLayer add to te_parallel's: TE's checkpoint layout
for the modules inside them (state-dict hooks converting with te_parallel.te_layout), TE 2.9's
`qk_norm_type` (a norm of each query and key head, applied right before the attention core, i.e.
after RoPE, TE's default), and the context-parallel group setter."""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

import te_parallel
from te_parallel import te_layout
from te_parallel.fp8 import autocast as _regions

from transformer_engine.common.recipe import Recipe, to_te_parallel

__all__ = ["TECompositeMixin", "pop_composite_kwargs"]

QK_NORMS = (None, "L2Normalization", "RMSNorm", "LayerNorm")


def pop_composite_kwargs(owner: str, kwargs: dict) -> dict:
    """TE 2.9 keywords of MultiheadAttention / TransformerLayer that te_parallel's do not take."""
    te = {k: kwargs.pop(k, d) for k, d in (("qk_norm_type", None), ("qk_norm_eps", 1e-6), ("qk_norm_before_rope", False),
                                            ("name", None), ("softmax_type", "vanilla"), ("delay_wgrad_compute", False),
                                            ("symmetric_ar_type", None), ("cp_group", None), ("cp_global_ranks", None),
                                            ("cp_stream", None), ("cp_comm_type", "p2p"))}
    if owner == "MultiheadAttention":  # shape hints TE's MultiheadAttention takes for its userbuffers; not needed here
        kwargs.pop("seq_length", None)
        kwargs.pop("micro_batch_size", None)
    if te["qk_norm_type"] not in QK_NORMS:
        raise ValueError(f"{owner}: qk_norm_type must be one of {QK_NORMS}, got {te['qk_norm_type']!r}")
    if te["qk_norm_type"] is not None and te["qk_norm_before_rope"]:
        raise NotImplementedError(f"{owner}: qk_norm_before_rope=True is not implemented in te_parallel (the norm is "
                                  f"applied after RoPE, TE's default)")
    if te["softmax_type"] != "vanilla" or te["delay_wgrad_compute"]:
        raise NotImplementedError(f"{owner}: softmax_type={te['softmax_type']!r} / delay_wgrad_compute="
                                  f"{te['delay_wgrad_compute']} are not implemented in te_parallel's {owner}")
    if te["symmetric_ar_type"] is not None:
        warnings.warn(f"{owner}: symmetric_ar_type ignored: te_parallel's all-reduce is torch.distributed's", stacklevel=3)
    return te


def _make_qk_norm(kind: Optional[str], head_dim: int, eps: float, dtype, device) -> Optional[nn.Module]:
    if kind is None:
        return None
    if kind == "L2Normalization":
        return _L2Norm(eps)
    cls = te_parallel.RMSNorm if kind == "RMSNorm" else te_parallel.LayerNorm
    return cls(head_dim, eps=eps, params_dtype=dtype, device=device)


class _L2Norm(nn.Module):
    """x / sqrt(sum(x²) + eps) over the head dim (TE's L2Normalization; no parameters)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + self.eps).to(x.dtype)


class TECompositeMixin:
    """Mixin for compat MultiheadAttention / TransformerLayer (placed before te_parallel's class)."""

    def _init_composite(self, te: dict, attentions) -> None:
        self.name, self.te_recipe = te["name"], None
        for module in self.modules():  # TE's rule: sequence-parallel partial gradients are the caller's to reduce
            if hasattr(module, "allreduce_sp_grads"):
                module.allreduce_sp_grads = False
        self._register_state_dict_hook(_save_te_layout)
        self._register_load_state_dict_pre_hook(_load_te_layout, with_module=True)
        for attn in attentions:
            _install_qk_norm(attn, te["qk_norm_type"], te["qk_norm_eps"])
        self.set_context_parallel_group(te["cp_group"], te["cp_global_ranks"], te["cp_stream"], te["cp_comm_type"])

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p") -> None:
        """The context-parallel group (TE's API), handed to te_parallel's attention blocks."""
        self.cp_group = cp_group
        super().set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _before_forward(self) -> None:
        frame = _regions.current_frame()
        if frame is not None:
            from transformer_engine.pytorch.fp8 import current_te_recipe
            self.te_recipe = current_te_recipe(frame)


def _install_qk_norm(attn: nn.Module, kind: Optional[str], eps: float) -> None:
    """q_norm / k_norm on a te_parallel MultiheadAttention (TE's names), applied to the query and key
    its attention core receives."""
    if attn is None or kind is None:
        return
    weight = next(attn.parameters())
    attn.q_norm = _make_qk_norm(kind, attn.head_dim, eps, weight.dtype, weight.device)
    attn.k_norm = _make_qk_norm(kind, attn.head_dim, eps, weight.dtype, weight.device)

    def normalize(core, args, kwargs):
        args = list(args)
        for i, (key, norm) in enumerate((("query_layer", attn.q_norm), ("key_layer", attn.k_norm))):
            if i < len(args):
                args[i] = norm(args[i])
            elif key in kwargs:
                kwargs[key] = norm(kwargs[key])
        return tuple(args), kwargs

    attn.core_attention.register_forward_pre_hook(normalize, with_kwargs=True)


def _recipe_of(module):
    recipe = getattr(module, "te_recipe", None)
    return to_te_parallel(recipe) if isinstance(recipe, Recipe) else recipe


def _save_te_layout(module, state_dict, prefix, local_metadata):
    own = [k for k in state_dict if k.startswith(prefix)]
    converted = te_layout.to_te_state_dict({k[len(prefix):]: state_dict.pop(k) for k in own}, module, _recipe_of(module))
    state_dict.update({prefix + k: v for k, v in converted.items()})


def _load_te_layout(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    own = [k for k in state_dict if k.startswith(prefix)]
    if not any(k.endswith(te_layout.EXTRA) for k in own):
        return  # te_parallel's layout: nothing to convert
    converted = te_layout.from_te_state_dict({k[len(prefix):]: state_dict.pop(k) for k in own}, module)
    state_dict.update({prefix + k: v for k, v in converted.items()})
