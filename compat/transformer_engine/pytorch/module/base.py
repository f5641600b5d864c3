"""TE's `transformer_engine.pytorch.module.base`: what every TE module has, on top of te_parallel's.

`TransformerEngineBaseModule` is a mixin placed before a te_parallel module class. It gives the
module TE's attributes (`fp8_meta`, `fp8`, `fp8_calibration`, `primary_weights_in_fp8`, ...), TE's
checkpoint layout (`_extra_state` through get_extra_state / set_extra_state, read without
executing pickled code: te_parallel.te_layout), TE's keywords that te_parallel has no counterpart for
(`TE_ONLY`: honoured here, or ignored with one warning naming them), and `backward_dw` for
`delay_wgrad_compute=True` (weight gradients held back until backward_dw() is called).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from te_parallel import te_layout
from te_parallel.fp8 import autocast as _regions
from te_parallel.fp8 import te_extra_state as tex
from te_parallel.parallel.overlap import initialize_ub  # noqa: F401  (TE's module.base.initialize_ub)

from transformer_engine.common.recipe import Recipe, to_te_parallel
from transformer_engine.pytorch import fp8 as _fp8

__all__ = ["TransformerEngineBaseModule", "get_workspace", "get_dummy_wgrad", "initialize_ub", "split_te_kwargs"]

# Keywords of TE 2.9's modules that te_parallel's constructors do not take, and what compat does.
TE_ONLY = {"delay_wgrad_compute": False, "symmetric_ar_type": None, "save_original_input": False, "name": None}
_IGNORED_WARNED = set()


def split_te_kwargs(owner: str, kwargs: dict) -> dict:
    """Pop TE-only keywords from `kwargs` (returns them, defaults filled). symmetric_ar_type (an
    all-reduce implementation choice) is ignored with one warning; the rest are honoured.
    Also sets te_parallel's `allreduce_sp_grads=False` unless given: under sequence parallelism TE leaves
    the gradients of norm weights and returned row-parallel biases partial, marked `sequence_parallel`,
    for its caller to reduce (Megatron's finalize_model_grads does); reducing them here too would double them."""
    kwargs.setdefault("allreduce_sp_grads", False)
    te = {k: kwargs.pop(k, default) for k, default in TE_ONLY.items()}
    if te["symmetric_ar_type"] is not None and (owner, "symmetric_ar_type") not in _IGNORED_WARNED:
        _IGNORED_WARNED.add((owner, "symmetric_ar_type"))
        warnings.warn(f"{owner}: symmetric_ar_type={te['symmetric_ar_type']!r} ignored: te_parallel's all-reduce is "
                      f"torch.distributed's", stacklevel=3)
    return te


def get_workspace() -> torch.Tensor:
    """TE's cuBLAS workspace: te_parallel's GEMMs manage their own; this is an empty placeholder."""
    return torch.empty(0, dtype=torch.uint8)


def get_dummy_wgrad(shape, dtype, zero: bool = False) -> torch.Tensor:
    """A weight-gradient placeholder of `shape` (TE returns it when wgrad goes to main_grad)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.zeros(shape, dtype=dtype, device=device) if zero else torch.empty(shape, dtype=dtype, device=device)


def _partition_dim(module, name: str) -> Optional[int]:
    """Which dim of parameter `name` the TP group splits (None: not split)."""
    if name.startswith("layer_norm"):
        return None
    mode = getattr(module, "parallel_mode", None)
    if getattr(module, "set_parallel_mode", False):  # LayerNormMLP: fc1 column, fc2 row
        mode = "column" if name.startswith("fc1") else "row"
    if mode == "column":
        return 0
    if mode == "row":
        return 1 if name.endswith("weight") else None
    return None


class TransformerEngineBaseModule:
    """Mixin: TE's module attributes, checkpoint layout and delayed weight gradients."""

    def _init_te(self, te_kwargs: Optional[dict] = None, num_gemms: int = 1, ub_name: Optional[str] = None) -> None:
        te_kwargs = dict(TE_ONLY, **(te_kwargs or {}))
        self.ub_name = ub_name
        self.fp8 = self.fp8_calibration = self.fp8_initialized = False
        self.fp8_meta = {"recipe": _fp8.get_default_fp8_recipe(), "fp8_checkpoint": False, "num_gemms": num_gemms,
                         "fp8_group": None}
        self.primary_weights_in_fp8 = _fp8.FP8GlobalStateManager.with_fp8_parameters()
        self.save_original_input = bool(te_kwargs["save_original_input"])  # te_parallel keeps no FP8 input copy longer
        self.name = te_kwargs["name"]
        self.delay_wgrad_compute = bool(te_kwargs["delay_wgrad_compute"])
        self._delayed_wgrads: list = []
        state = self._modules.get("fp8_state")
        if state is not None:
            state.in_extra_state = True  # TE's layout: the FP8 state travels in _extra_state
        self.whole_tensor_state_dict = False  # TE's layout: each rank's plain shard (Megatron's sharded_state_dict)
        if self.delay_wgrad_compute:
            self._hold_wgrads()
        self._mark_tensor_parallel()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "fp8_meta"):  # (te_parallel's constructor calls this before _init_te)
            self._mark_tensor_parallel()

    def _mark_tensor_parallel(self) -> None:
        """TE's tensor-parallel attributes on the GEMM parameters, which Megatron reads (gradient norms,
        checkpoints): tensor_model_parallel, partition_dim (0: split on out_features, 1: on in_features),
        partition_stride. Norm weights and a row-parallel bias are whole on every rank: unmarked."""
        for name, param in self.named_parameters(recurse=False):
            dim = _partition_dim(self, name)
            if dim is not None:
                param.tensor_model_parallel, param.partition_dim = True, dim
                param.partition_stride = getattr(param, "partition_stride", 1)

    # --- the FP8 region a forward ran in ------------------------------------------------------------
    def _note_region(self) -> None:
        """Record what TE records per forward: whether it ran in FP8 and with which recipe."""
        frame = _regions.current_frame()
        self.fp8 = bool(frame is not None and frame.enabled)
        self.fp8_calibration = bool(frame is not None and frame.calibrating)
        if frame is not None:
            self.fp8_initialized = True
            self.fp8_meta["recipe"] = _fp8.current_te_recipe(frame)
            self.fp8_meta["fp8_checkpoint"] = True
            self.fp8_meta["fp8_group"] = frame.group

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE's per-forward FP8 set-up (read the autocast region, size fp8_meta). Clients call it outside a
        forward too: Megatron's TEGroupedLinear before loading a checkpoint. Here it records the region as a
        forward does; the FP8 state itself is te_parallel's and sized at construction."""
        self.fp8_meta["num_gemms"] = num_gemms
        self._note_region()

    # --- TE's checkpoint layout ---------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """TE 2.x's `_extra_state`: the FP8 state pickled as TE pickles it (empty when there is none)."""
        recipe = self.fp8_meta.get("recipe")
        extra = {}
        if isinstance(recipe, Recipe):
            extra = {"fp8_dpa": bool(recipe.fp8_dpa), "fp8_mha": bool(recipe.fp8_mha)}
            recipe = to_te_parallel(recipe)
        if self._modules.get("fp8_state") is None:
            return te_layout.te_extra_state(self)
        state = self._modules["fp8_state"]
        tensors = tex.state_tensors(state)
        if not self.fp8_meta["fp8_checkpoint"] and not tensors["update_count"].any():
            return tex.EMPTY()
        return tex.encode(tensors, state.num_gemms, recipe, extra)

    def set_extra_state(self, state) -> None:
        """Read TE's `_extra_state` (restricted unpickler: tensors, numbers and TE recipes only)."""
        te_layout.load_te_extra_state(self, state, f" of {type(self).__name__}")
        if isinstance(state, torch.Tensor) and state.numel() and self._modules.get("fp8_state") is not None:
            self.fp8_meta["fp8_checkpoint"] = True

    # --- delay_wgrad_compute / backward_dw -------------------------------------------------------
    def _hold_wgrads(self) -> None:
        if getattr(self, "fuse_wgrad_accumulation", False):
            raise NotImplementedError(f"{type(self).__name__}: delay_wgrad_compute=True with fuse_wgrad_accumulation=True "
                                      f"is not implemented in te_parallel; turn one of them off")
        for p in self._parameters.values():
            if p is not None and p.requires_grad:
                p.register_hook(self._hold(p))

    def _hold(self, param: nn.Parameter):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self._delayed_wgrads.append((param, grad))
            return torch.zeros_like(grad)  # accumulated now: nothing; the gradient arrives in backward_dw()
        return hook

    def backward_dw(self) -> None:
        """Accumulate the weight gradients held back by delay_wgrad_compute=True (no-op otherwise).
        The GEMMs ran in backward as usual; what is delayed is their effect on `.grad`."""
        held, self._delayed_wgrads = self._delayed_wgrads, []
        with torch.no_grad():
            for param, grad in held:
                param.grad = grad.clone() if param.grad is None else param.grad.add_(grad)
