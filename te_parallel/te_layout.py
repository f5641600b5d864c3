"""Transformer Engine's checkpoint layout for te_parallel models, both ways.

te_parallel's state dicts keep each GEMM module's FP8 state as plain tensors (`<m>.fp8_state.*`);
TE 2.x keeps it in one pickled uint8 tensor per module, `<m>._extra_state`, and gives the modules
without FP8 state an `_extra_state` too: DotProductAttention an empty tensor, LayerNorm / RMSNorm (TE
operations) the pickle of an empty dict. Parameter names are the same (TE's).

    sd_te = te.to_te_state_dict(model.state_dict(), model)        # write TE's layout (for TE users)
    model.load_state_dict(te.from_te_state_dict(sd_te, model))    # read it, FP8 state kept, strict

Reading never executes pickled code (te_parallel.fp8.te_extra_state). FP8 attention's scaling state
(`<m>.fp8_attention_state.*`, recipes' fp8_dpa) has no counterpart in TE's layout that te_parallel writes or
reads: it is left out of the TE layout (with a warning where it holds recorded amaxes), and a TE layout loads
into a layer that has it as a fresh state, so the attention's scales restart from their first update, as a
fresh layer's do. A non-empty attention or norm extra state of TE's is dropped with a warning.
"""
from __future__ import annotations

import io
import pickle
import warnings
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from te_parallel.fp8 import te_extra_state as tex
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.module.attention import DotProductAttention
from te_parallel.module.layernorm import LayerNorm, RMSNorm
from te_parallel.recipe import DelayedScaling, Recipe

__all__ = ["to_te_state_dict", "from_te_state_dict", "te_extra_state", "load_te_extra_state", "EXTRA"]

EXTRA = "_extra_state"
_STATE_KEYS = ("fwd_amax_history", "fwd_scale", "fwd_scale_inv", "bwd_amax_history", "bwd_scale", "bwd_scale_inv",
               "update_count")
_DEFAULT_RECIPE = DelayedScaling()


def _kind(module: nn.Module) -> Optional[str]:
    """Which extra state TE gives this module: "fp8" (a GEMM module), "attention", "op" (a norm), or None."""
    if isinstance(module._modules.get("fp8_state"), FP8ScalingState):
        return "fp8"
    if isinstance(module, DotProductAttention):
        return "attention"
    if isinstance(module, (LayerNorm, RMSNorm)):
        return "op"
    return None


def _empty_op_state() -> torch.Tensor:
    """A TE operation's extra state with no quantizers: the pickle of {} as a uint8 tensor."""
    return torch.frombuffer(bytearray(pickle.dumps({}, protocol=4)), dtype=torch.uint8)


def te_extra_state(module: nn.Module, recipe=None) -> torch.Tensor:
    """The `_extra_state` TE would write for `module` (recipe: the recipe its FP8 state was made with;
    None: DelayedScaling())."""
    kind = _kind(module)
    if kind == "fp8":
        state = module._modules["fp8_state"]
        return _fp8_blob(tex.state_tensors(state), state.num_gemms, recipe)
    return _empty_op_state() if kind == "op" else tex.EMPTY()


def _fp8_blob(tensors: Dict[str, torch.Tensor], num_gemms: int, recipe) -> torch.Tensor:
    if not tensors["update_count"].any() and not tensors["fwd_amax_history"].any():
        return tex.EMPTY()  # never ran in FP8: what TE writes for such a module
    return tex.encode(tensors, num_gemms, _DEFAULT_RECIPE if recipe is None else recipe)


def load_te_extra_state(module: nn.Module, blob, where: str = "") -> None:
    """Read a TE `_extra_state` into `module` (its FP8 scaling state; nothing for attention or norms)."""
    kind = _kind(module)
    if kind == "fp8":
        tex.load_into(module._modules["fp8_state"], blob, where)
        return
    _check_stateless(blob, where)


def _check_stateless(blob, where: str) -> None:
    """Attention / norm extra state: read (restricted) to check it; FP8 attention state is dropped."""
    if blob is None or (isinstance(blob, torch.Tensor) and blob.numel() == 0):
        return
    state = tex._RestrictedUnpickler(io.BytesIO(blob.detach().cpu().numpy().tobytes())).load()
    if state:
        warnings.warn(f"TE extra state{where} holds FP8 state of an attention or norm (TE's fp8_dpa); te_parallel runs "
                      f"these in high precision, so it is dropped", stacklevel=3)


def _owners(model: nn.Module) -> Iterator[Tuple[str, nn.Module, str]]:
    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is not None:
            yield (name + "." if name else ""), module, kind


def to_te_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module,
                     recipe: Optional[Recipe] = None) -> Dict[str, torch.Tensor]:
    """TE's layout of `state_dict` (a state dict of `model`): every `<m>.fp8_state.*` group becomes
    `<m>._extra_state`, and attention cores and norms get the extra state TE gives them. recipe: the
    recipe the model trained with, stored in each blob as TE does (None: DelayedScaling())."""
    out = dict(state_dict)
    for prefix, module, kind in _owners(model):
        if prefix + EXTRA in out:
            continue
        if kind == "fp8":
            keys = [f"{prefix}fp8_state.{k}" for k in _STATE_KEYS]
            if not all(k in out for k in keys):
                continue
            tensors = {k: out.pop(f"{prefix}fp8_state.{k}") for k in _STATE_KEYS}
            out[prefix + EXTRA] = _fp8_blob(tensors, module._modules["fp8_state"].num_gemms, recipe)
        else:
            out[prefix + EXTRA] = _empty_op_state() if kind == "op" else tex.EMPTY()
            if kind == "attention":
                _drop_attention_state(out, prefix)
    return out


_ATTENTION_STATE = "fp8_attention_state."


def _drop_attention_state(out: Dict[str, torch.Tensor], prefix: str) -> None:
    """Leaves FP8 attention's scaling state out of a TE layout, warning where it has recorded amaxes."""
    keys = [k for k in out if k.startswith(prefix + _ATTENTION_STATE)]
    history = [out[k] for k in keys if k.endswith("amax_history")]
    for k in keys:
        del out[k]
    if any(bool(h.any()) for h in history):
        warnings.warn(f"to_te_state_dict: the FP8 attention scaling state of '{prefix[:-1]}' (fp8_dpa) is not "
                      f"written in TE's layout; a model loaded from it restarts those scales", stacklevel=3)


def from_te_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """te_parallel's layout of a TE-layout state dict for `model`: each `<m>._extra_state` of a GEMM
    module becomes its `<m>.fp8_state.*` tensors (TE's slots and history order converted; a module TE
    saved without FP8 state gets a fresh one), and the attention's and norms' extra states are dropped.
    Read without executing pickled code."""
    out = dict(state_dict)
    for prefix, module, kind in _owners(model):
        blob = out.pop(prefix + EXTRA, None)
        where = f" of '{prefix[:-1]}'" if prefix else ""
        if kind != "fp8":
            _check_stateless(blob, where)
            attention_state = module._modules.get("fp8_attention_state")
            if isinstance(attention_state, FP8ScalingState):  # (a layer that ran FP8 attention: fresh scales)
                for k, v in _fresh_like(attention_state).items():
                    out.setdefault(f"{prefix}{_ATTENTION_STATE}{k}", v)
            continue
        state = module._modules["fp8_state"]
        te = tex.decode(blob, state.num_gemms, where)
        if te is not None and te.fwd_scale is not None:
            tensors = tex.te_to_state(te, state.num_gemms)
        else:
            tensors = _fresh(state)
        for k, v in tensors.items():
            out.setdefault(f"{prefix}fp8_state.{k}", v)
    return out


def _fresh_like(state: FP8ScalingState) -> Dict[str, torch.Tensor]:
    """Every tensor of `state`'s state dict as a state that never ran has it: amax histories and counts zero,
    scales one."""
    return {k: (torch.ones_like(v) if "scale" in k else torch.zeros_like(v)).cpu() for k, v in state.state_dict().items()}


def _fresh(state: FP8ScalingState) -> Dict[str, torch.Tensor]:
    """A fresh state of `state`'s shape (what a module that never ran in FP8 has)."""
    n_fwd, n_bwd, rows = 2 * state.num_gemms, state.num_gemms, state.fwd_amax_history.shape[0]
    return {"fwd_amax_history": torch.zeros(rows, n_fwd), "fwd_scale": torch.ones(n_fwd), "fwd_scale_inv": torch.ones(n_fwd),
            "bwd_amax_history": torch.zeros(rows, n_bwd), "bwd_scale": torch.ones(n_bwd), "bwd_scale_inv": torch.ones(n_bwd),
            "update_count": torch.zeros(2, dtype=torch.int64)}
