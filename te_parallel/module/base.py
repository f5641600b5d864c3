"""What every GEMM module shares: parameter creation, FP8 state, the quantized-weight cache."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from te_parallel.fp8 import autocast as _autocast
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops.fp8_gemm_config import GemmFP8
from te_parallel.parallel.overlap import initialize_ub  # noqa: F401  (TE's te.module.base.initialize_ub)

DeviceLike = Union[str, torch.device, None]
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEFAULT_INIT_STD = 0.023  # TE's default init: N(0, 0.023²)


def resolve_device(device: DeviceLike) -> torch.device:
    """None means CUDA when available, else CPU (DESIGN.md §2)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(params_dtype: Optional[torch.dtype]) -> torch.dtype:
    dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"params_dtype must be one of {PARAM_DTYPES}, got {params_dtype}")
    return dtype


def default_init(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def check_features(name: str, **dims: int) -> None:
    for key, v in dims.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {key} must be a positive int, got {v!r}")


def activation_dtype(module_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """torch.autocast's dtype when it is on for this device, else the parameters' dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return module_dtype


def check_input(name: str, inp: torch.Tensor, features: int) -> None:
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name}: input must be a torch.Tensor, got {type(inp).__name__}")
    if not inp.is_floating_point() or inp.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name}: input must be float32, bfloat16, float16 or float64, got {inp.dtype}")
    if inp.dim() < 1 or inp.shape[-1] != features:
        raise ValueError(f"{name}: input's last dim must be {features}, got shape {tuple(inp.shape)}")


class FP8Module(nn.Module):
    """Base of the GEMM modules: owns `fp8_state` and the quantized-weight cache.

    The weight is cast once and reused while its parameters are unchanged: the cache key is the
    parameters' version counters, which every in-place update through autograd-visible ops
    (optimizers, `load_state_dict`, `copy_` under no_grad) bumps. TE's `is_first_microbatch`
    overrides it: True recasts, False reuses whatever is cached. Writes through `.data` bypass
    version counters; call `drop_fp8_weight_cache()` after those.
    """

    def __init__(self, num_gemms: int, device: torch.device) -> None:
        super().__init__()
        self.fp8_state = FP8ScalingState(num_gemms, device=device)
        self._weight_cache: Dict[int, Tuple[tuple, Float8Tensor]] = {}
        self._always_recast = False  # set while a CUDA graph is captured (te_parallel.graph)

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' dtype now (after any `.to(dtype)`), TE's activation dtype outside torch.autocast."""
        for p in self._parameters.values():  # the module's own parameters: no recursive walk per call
            if p is not None:
                return p.dtype
        return next(self.parameters()).dtype

    def drop_fp8_weight_cache(self) -> None:
        self._weight_cache.clear()

    def _fp8_frame(self) -> Optional[_autocast.FP8Frame]:
        frame = _autocast.current_frame()
        if frame is None or not (frame.enabled or frame.calibrating):
            return None
        return frame

    def _fp8_group(self, frame: _autocast.FP8Frame):
        return frame.group if frame.group is not None else getattr(self, "tp_group", None)

    def _gemm_fp8(
        self,
        frame: Optional[_autocast.FP8Frame],
        gemm: int,
        params: Sequence[torch.Tensor],
        weight: torch.Tensor,
        is_first_microbatch: Optional[bool],
        weight_amax_group=None,
    ) -> Optional[GemmFP8]:
        """The FP8 plan of GEMM number `gemm` this call (None outside FP8 / calibration)."""
        if frame is None:
            return None
        stash = _autocast.checkpoint_stash()
        if stash is not None and stash.replaying:
            return stash.replay(self, gemm, frame, self._fp8_group(frame))
        if frame.enabled and weight.dtype == torch.float64:
            raise TypeError(f"{type(self).__name__}: FP8 GEMMs need float32/bfloat16/float16 parameters, got float64")
        recipe, group = frame.recipe, self._fp8_group(frame)
        state = self._modules["fp8_state"]  # (not nn.Module.__getattr__: this runs on every forward)
        if recipe.delayed():
            state.ensure_history_len(recipe.amax_history_len)
            _autocast.record_forward(state, recipe, group)
        cfg = GemmFP8(recipe, state, gemm, None, frame.enabled, group)
        if frame.enabled:
            cfg.weight = self._cached_weight(cfg, params, weight, is_first_microbatch, weight_amax_group)
        else:
            cfg.record_weight_amax(weight)
        if stash is not None:
            stash.record(cfg)
        return cfg

    def _cached_weight(self, cfg: GemmFP8, params, weight, is_first_microbatch, amax_group) -> Float8Tensor:
        fmt = cfg.recipe.fp8_format
        key = (tuple([(p._version, p.data_ptr()) for p in params]), fmt.fwd_dtype, cfg.recipe.delayed())
        hit = None if self._always_recast else self._weight_cache.get(cfg.gemm)
        if hit is not None and hit[0][1:] == key[1:]:
            if is_first_microbatch is False or (is_first_microbatch is None and hit[0] == key):
                return hit[1]
        # Wᵀ (for dgrad) is made in backward, not here: emitted by this cast it sits in memory through
        # the whole forward, 1.501 instead of 1.376 GiB of the seed layer's peak on an H200 (+9%), to
        # save ~0.13 ms of transposes (docs/benchmarks.md). Nor is it kept here after that backward.
        with torch.no_grad():
            w_q = cfg.quantize_weight(weight.detach(), amax_group)
        # The FP8 W is kept for the next forward only where that forward can use it: TE's explicit
        # micro-batch flag, inference, frozen weights. In a training step (is_first_microbatch=None)
        # the optimizer changes the weights first, so a kept copy would never be used and would hold
        # 1 byte per parameter from this forward through backward and on to the next step. Not kept,
        # W is freed after its forward GEMM and backward re-encodes Wᵀ from `weight` (unless `weight`
        # is a concatenated copy, which would cost more than W itself).
        if (is_first_microbatch is not None or not torch.is_grad_enabled()
                or not any(p.requires_grad for p in params)):
            self._weight_cache[cfg.gemm] = (key, w_q)
        else:
            self._weight_cache.pop(cfg.gemm, None)
            if weight.data_ptr() == params[0].data_ptr():
                cfg.weight_src = weight
        return w_q


class _NoopCat(torch.autograd.Function):
    """Concatenate split parameters along dim 0; no copy while they are adjacent views of one buffer.

    backward splits the gradient back into the parts.
    """

    @staticmethod
    def forward(ctx, *parts: torch.Tensor):
        ctx.sizes = [p.shape[0] for p in parts]
        first = parts[0].detach()
        if _are_adjacent(parts):
            return first.as_strided((sum(ctx.sizes), *first.shape[1:]), first.stride(), first.storage_offset())
        return torch.cat([p.detach() for p in parts])

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.split(grad, ctx.sizes))


def _are_adjacent(parts: Sequence[torch.Tensor]) -> bool:
    base = parts[0]
    offset = base.storage_offset()
    for p in parts:
        same = p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        if not (same and p.is_contiguous() and p.storage_offset() == offset):
            return False
        offset += p.numel()
    return True


def cat_params(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else _NoopCat.apply(*parts)


def split_sizes(total: int, parameters_split, owner: str) -> List[Tuple[str, int]]:
    """TE's parameters_split: None, names (equal split) or {name: size}, as [(prefix, size)]."""
    if parameters_split is None:
        return [("", total)]
    if isinstance(parameters_split, dict):
        items = list(parameters_split.items())
    elif isinstance(parameters_split, (list, tuple)) and parameters_split:
        if total % len(parameters_split):
            raise ValueError(
                f"{owner}: out_features={total} is not divisible into {len(parameters_split)} equal splits {tuple(parameters_split)}"
            )
        items = [(name, total // len(parameters_split)) for name in parameters_split]
    else:
        raise ValueError(f"{owner}: parameters_split must be None, a tuple of names or a dict name->size, got {parameters_split!r}")
    if sum(size for _, size in items) != total:
        raise ValueError(f"{owner}: parameters_split sizes {dict(items)} add up to {sum(s for _, s in items)}, not out_features={total}")
    return [(str(name).rstrip("_") + "_", int(size)) for name, size in items]
