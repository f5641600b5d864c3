"""Transformer Engine's checkpoint form of the FP8 state (`<module>._extra_state`), both ways.

TE 2.x keeps a module's FP8 metadata in one uint8 tensor: the bytes of `pickle.dumps(state)` with

    state = {"recipe": <transformer_engine.common.recipe object>,
             "scale_fwd": [3G] fp32, "amax_history_fwd": [L, 3G] fp32,      # delayed scaling only
             "scale_bwd": [2G] fp32, "amax_history_bwd": [L, 2G] fp32,
             "extra_fp8_variables": {plain numbers, strings, lists and tuples}}

and an empty uint8 tensor for a module that never ran in FP8. Its slots per GEMM g are forward
(input 3g, weight 3g+1, output 3g+2) and backward (grad output 2g, grad input 2g+1); te_parallel's
are forward (input 2g, weight 2g+1) and backward (grad output g): TE's output and grad-input slots
hold scale 1 and no history here.

History order differs too. After each update TE rolls its history by one row upwards and zeroes
row 0, so the pass just finished sits in the LAST row and row 1 is the oldest; te_parallel rolls
downwards, so that pass sits in row 1 and the oldest in the last row. Row 0 (the pass in progress) is
row 0 in both. The conversion reverses rows 1..L-1, which is its own inverse.

Reading never executes pickled code: `_RestrictedUnpickler` resolves only the globals a TE 2.x
state refers to (torch's tensor rebuild, storage bytes read with `torch.load(weights_only=True)`,
OrderedDict, and TE's recipe classes, which become inert `TERecord`s holding their fields). Any other
global (a user's amax function, an arbitrary callable) makes the read fail with a one-line error.
"""
from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from te_parallel.fp8.gemm_quantizers import gemm_quantizers
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, Recipe

__all__ = ["TERecord", "TEExtraState", "decode", "encode", "load_into", "state_to_te", "te_to_state",
           "EMPTY"]

RECIPE_MODULE = "transformer_engine.common.recipe"
# TE's _FormatHelper(max_fwd, max_bwd) of each Format member
_FORMAT_MAXES = {"E4M3": (448, 448), "E5M2": (57344, 57344), "HYBRID": (448, 57344), "E2M1": (6, 6)}
_FORMAT_BY_MAXES = {v: k for k, v in _FORMAT_MAXES.items()}
_KEYS = ("fwd_amax_history", "fwd_scale", "fwd_scale_inv", "bwd_amax_history", "bwd_scale", "bwd_scale_inv",
         "update_count")


def EMPTY() -> torch.Tensor:  # noqa: N802 (reads as a constant)
    """TE's extra state of a module with no FP8 state to keep."""
    return torch.empty(0, dtype=torch.uint8)


# --- reading ---------------------------------------------------------------------------------------
class TERecord:
    """An object of TE's recipe module read as data: `te_name` (its class name), `fields` (its
    attributes) and `args` (constructor arguments, for Format and _FormatHelper). Never TE's class."""

    te_name = ""

    def __init__(self, *args) -> None:
        self.args, self.fields = args, {}

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"TE extra state: {self.te_name} has state of type {type(state).__name__}")
        self.fields = dict(state)

    def format_name(self) -> Optional[str]:
        """For a Format record: 'E4M3', 'E5M2', 'HYBRID' or 'E2M1'."""
        helper = self.args[0] if self.args else None
        maxes = tuple(helper.args) if isinstance(helper, TERecord) else tuple(helper or ())
        return _FORMAT_BY_MAXES.get(tuple(int(v) for v in maxes)) if len(maxes) == 2 else None

    def __repr__(self) -> str:
        return f"TERecord({self.te_name}, {self.fields or self.args})"


_RECORD_TYPES: Dict[str, type] = {}


def _record_type(name: str) -> type:
    if name not in _RECORD_TYPES:
        _RECORD_TYPES[name] = type(f"TE_{name}", (TERecord,), {"te_name": name})
    return _RECORD_TYPES[name]


def _rebuild_tensor(storage, offset, size, stride, requires_grad, hooks, *metadata):
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)) or hooks:
        raise pickle.UnpicklingError("TE extra state: a tensor record that is not plain storage data")
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, collections.OrderedDict())


def _storage_from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


_SAFE = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
         ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
         ("collections", "OrderedDict"): collections.OrderedDict}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE:
            return _SAFE[(module, name)]
        if module == RECIPE_MODULE and name.isidentifier():
            return _record_type(name)
        raise pickle.UnpicklingError(
            f"TE extra state refers to {module}.{name}; the restricted loader reads only tensors, numbers, "
            f"strings, lists, dicts and TE recipes (a recipe with a custom amax or scale function cannot be read)")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("TE extra state: persistent ids are not part of TE's format")


@dataclass
class TEExtraState:
    """What a TE extra state says, in te_parallel's slot order and history order (None: not saved)."""

    recipe: Optional[TERecord]
    fwd_scale: Optional[torch.Tensor] = None
    fwd_amax_history: Optional[torch.Tensor] = None
    bwd_scale: Optional[torch.Tensor] = None
    bwd_amax_history: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)


def decode(blob, num_gemms: int, where: str = "") -> Optional[TEExtraState]:
    """A TE extra-state tensor (or None / an empty tensor: no FP8 state) read without executing code.
    num_gemms: the GEMMs of the module it is for; its slot counts must match."""
    if blob is None or (isinstance(blob, torch.Tensor) and blob.numel() == 0):
        return None
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8:
        raise TypeError(f"TE extra state{where}: expected TE 2.x's uint8 tensor, got {type(blob).__name__}"
                        f"{'' if not isinstance(blob, torch.Tensor) else ' of ' + str(blob.dtype)} (TE 1.x's BytesIO form is not read)")
    state = _RestrictedUnpickler(io.BytesIO(blob.detach().cpu().numpy().tobytes())).load()
    if state is None:
        return None
    if not isinstance(state, dict):
        raise ValueError(f"TE extra state{where}: expected a dict, got {type(state).__name__}")
    recipe = state.get("recipe")
    out = TEExtraState(recipe if isinstance(recipe, TERecord) else None, extra=dict(state.get("extra_fp8_variables") or {}))
    if "scale_fwd" not in state:
        return out  # current scaling (or no delayed tensors): nothing per slot
    out.fwd_scale, out.fwd_amax_history = _from_te_slots(state["scale_fwd"], state["amax_history_fwd"], num_gemms, 3, 2, where, "forward")
    out.bwd_scale, out.bwd_amax_history = _from_te_slots(state["scale_bwd"], state["amax_history_bwd"], num_gemms, 2, 1, where, "backward")
    return out


def _from_te_slots(scale, hist, num_gemms: int, te_per: int, ours_per: int, where: str, direction: str):
    if scale.dim() != 1 or scale.numel() != te_per * num_gemms or hist.dim() != 2 or hist.shape[1] != scale.numel():
        raise ValueError(f"TE extra state{where} has {scale.numel()} {direction} slots (history {tuple(hist.shape)}); "
                         f"this module has {num_gemms} GEMM(s), i.e. {te_per * num_gemms}: it is from another module type")
    cols = _te_columns(num_gemms, te_per, ours_per)
    return scale.float()[cols].clone(), _flip_history(hist.float()[:, cols])


def _te_columns(num_gemms: int, te_per: int, ours_per: int) -> torch.Tensor:
    """TE's slot index of each te_parallel slot (te_parallel slot j of GEMM g = TE slot te_per·g + j)."""
    return torch.tensor([te_per * g + j for g in range(num_gemms) for j in range(ours_per)], dtype=torch.long)


def _flip_history(hist: torch.Tensor) -> torch.Tensor:
    """TE's history order <-> te_parallel's (rows 1..L-1 reversed; see the module docstring)."""
    return torch.cat([hist[:1], hist[1:].flip(0)]).contiguous()


def te_to_state(te: TEExtraState, num_gemms: int) -> Dict[str, torch.Tensor]:
    """The `fp8_state.*` tensors (te_parallel's checkpoint layout, names without prefix) of a decoded TE state."""
    counts = te.extra.get("te_parallel_update_count", (0, 0))
    out = {"fwd_amax_history": te.fwd_amax_history, "fwd_scale": te.fwd_scale, "fwd_scale_inv": 1.0 / te.fwd_scale,
           "bwd_amax_history": te.bwd_amax_history, "bwd_scale": te.bwd_scale, "bwd_scale_inv": 1.0 / te.bwd_scale,
           "update_count": torch.tensor([int(c) for c in counts][:2], dtype=torch.int64)}
    return out


def load_into(state: FP8ScalingState, blob, where: str = "") -> bool:
    """Write a TE extra state into a module's FP8 scaling state; False when it held no per-slot state."""
    te = decode(blob, state.num_gemms, where)
    if te is None or te.fwd_scale is None:
        return False
    tensors = te_to_state(te, state.num_gemms)
    with torch.no_grad():
        state.ensure_history_len(tensors["fwd_amax_history"].shape[0])
        if state.bwd_amax_history.shape[0] != tensors["bwd_amax_history"].shape[0]:
            state.bwd_amax_history = tensors["bwd_amax_history"].to(state.bwd_amax_history.device).clone()
        for name, value in tensors.items():
            getattr(state, name).copy_(value)
    state._count_host = [int(v) for v in tensors["update_count"].tolist()]
    return True


# --- writing ---------------------------------------------------------------------------------------
class _TEObject:
    """An instance of a class of TE's recipe module, written as TE's own pickle has it: the class as
    the global `transformer_engine.common.recipe.<name>` (so TE reads back its own class, and this side
    never imports TE), then NEWOBJ and the fields as the instance dict; or, with `args`, a call of the
    class (Format(_FormatHelper(...)), as an Enum member is pickled)."""

    def __init__(self, name: str, fields: Optional[dict] = None, args: Optional[tuple] = None) -> None:
        self.name, self.fields, self.args = name, fields, args


class _TEPickler(pickle._Pickler):  # the Python pickler, whose save() can be extended
    def save(self, obj, save_persistent_id=True):
        if not isinstance(obj, _TEObject):
            return super().save(obj, save_persistent_id)
        self.save(RECIPE_MODULE)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        if obj.args is not None:
            self.save(tuple(obj.args))
            self.write(pickle.REDUCE)
            return None
        self.save(())
        self.write(pickle.NEWOBJ)
        self.save(dict(obj.fields or {}))
        self.write(pickle.BUILD)
        return None


# the recipes TE's layout names (with the fields each writes below); a subclass is written as its TE base
_TE_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)


def te_format(fmt: Format) -> _TEObject:
    """TE's Format member for a te_parallel Format (pickled as Format(_FormatHelper(max_fwd, max_bwd)))."""
    return _TEObject("Format", args=(_TEObject("_FormatHelper", args=_FORMAT_MAXES[fmt.name]),))


def te_recipe(recipe: Recipe, extra_fields: Optional[dict] = None) -> _TEObject:
    """TE's recipe object for a te_parallel recipe (extra_fields: TE-only fields to keep, e.g. fp8_dpa)."""
    fields = {"fp8_format": te_format(recipe.fp8_format), "fp8_dpa": bool(getattr(recipe, "fp8_dpa", False)),
              "fp8_mha": bool(getattr(recipe, "fp8_mha", False))}
    if not isinstance(recipe, _TE_RECIPES):
        raise ValueError(f"TE extra state: {type(recipe).__name__} has no TE recipe of the same meaning to be written "
                         f"as; TE's layout is written for DelayedScaling, Float8CurrentScaling or Float8BlockScaling "
                         f"(or a subclass)")
    if isinstance(recipe, DelayedScaling):
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            raise ValueError("TE extra state: a DelayedScaling with a custom amax or scale function cannot be written "
                             "in TE's layout (TE would have to import that function); use amax_compute_algo='max' or "
                             "'most_recent'")
        fields.update(margin=recipe.margin, amax_history_len=recipe.amax_history_len,
                      amax_compute_algo=recipe.amax_compute_algo, scaling_factor_compute_algo=None,
                      reduce_amax=recipe.reduce_amax)
        name = "DelayedScaling"
    else:
        name = "Float8CurrentScaling"
        if isinstance(recipe, Float8BlockScaling):  # (the recipe's own fields: what TE's recipe object holds)
            name = "Float8BlockScaling"
            for role, key in (("x", "fp8_quant_fwd_inp"), ("w", "fp8_quant_fwd_weight"), ("grad", "fp8_quant_bwd_grad")):
                qp = recipe.qparams(role)
                fields[key] = _TEObject("QParams", {"power_2_scale": qp.power_2_scale, "amax_epsilon": qp.amax_epsilon})
                fields[f"{role}_block_scaling_dim"] = recipe.block_dim(role)
        for gemm in ("fprop", "dgrad", "wgrad"):
            mm = getattr(recipe, f"fp8_gemm_{gemm}")
            fields[f"fp8_gemm_{gemm}"] = _TEObject("MMParams", {"use_split_accumulator": mm.use_split_accumulator})
    fields.update(extra_fields or {})
    return _TEObject(name, fields)


def state_to_te(tensors: Dict[str, torch.Tensor], num_gemms: int, recipe: Recipe,
                extra_fields: Optional[dict] = None) -> dict:
    """TE's state dict (before pickling) from te_parallel's `fp8_state.*` tensors (names without prefix).
    recipe: the te_parallel recipe the state was made with; extra_fields: TE-only recipe fields to store."""
    counts = [int(v) for v in tensors["update_count"].tolist()]
    state = {"recipe": te_recipe(recipe, extra_fields),
             "extra_fp8_variables": {"num_gemms": num_gemms, "fp8_checkpoint": True, "te_parallel_update_count": counts}}
    if not gemm_quantizers(recipe).has_state:  # (only quantizers with state keep scales and histories per slot)
        return state
    for direction, te_per, ours_per in (("fwd", 3, 2), ("bwd", 2, 1)):
        cols = _te_columns(num_gemms, te_per, ours_per)
        hist = tensors[f"{direction}_amax_history"].detach().float().cpu()
        scale = torch.ones(te_per * num_gemms)
        scale[cols] = tensors[f"{direction}_scale"].detach().float().cpu()
        te_hist = torch.zeros(hist.shape[0], te_per * num_gemms)
        te_hist[:, cols] = _flip_history(hist)
        state[f"scale_{direction}"], state[f"amax_history_{direction}"] = scale, te_hist
    return state


def encode(tensors: Dict[str, torch.Tensor], num_gemms: int, recipe: Recipe,
           extra_fields: Optional[dict] = None) -> torch.Tensor:
    """The uint8 extra-state tensor TE 2.x writes, from te_parallel's `fp8_state.*` tensors."""
    buf = io.BytesIO()
    _TEPickler(buf, protocol=4).dump(state_to_te(tensors, num_gemms, recipe, extra_fields))
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def state_tensors(state: FP8ScalingState) -> Dict[str, torch.Tensor]:
    """A module's `fp8_state.*` tensors by name (update_count from the host counts, as a state dict has it)."""
    out = {k: getattr(state, k) for k in _KEYS if k != "update_count"}
    out["update_count"] = torch.tensor(state.updates(), dtype=torch.int64)
    return out
