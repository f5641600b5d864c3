"""TE's te.LayerNorm (TE 2.x: an operation taking `normalized_shape`), backed by te_parallel.LayerNorm."""
from __future__ import annotations

import te_parallel

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

__all__ = ["LayerNorm", "norm_kwargs"]


def norm_kwargs(owner: str, normalized_shape, hidden_size, sequence_parallel, params_dtype, kwargs: dict) -> dict:
    """te_parallel's norm keywords from TE 2.9's: `dtype` is the newer name of params_dtype, `sm_margin`
    (SMs left to communication by TE's kernels) has no counterpart and is dropped."""
    dtype = kwargs.pop("dtype", None)
    kwargs.pop("sm_margin", None)
    if dtype is not None and params_dtype is not None and dtype != params_dtype:
        raise ValueError(f"{owner}: dtype={dtype} and params_dtype={params_dtype} disagree; give one")
    return dict(hidden_size=hidden_size, normalized_shape=normalized_shape, sequence_parallel=bool(sequence_parallel),
                params_dtype=params_dtype if params_dtype is not None else dtype, **kwargs)


class LayerNorm(TransformerEngineBaseModule, te_parallel.LayerNorm):
    """LayerNorm over the last dim (te_parallel.LayerNorm)."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma: bool = False, hidden_size=None, **kwargs) -> None:
        super().__init__(eps=eps, zero_centered_gamma=zero_centered_gamma,
                         **norm_kwargs("LayerNorm", normalized_shape, hidden_size, sequence_parallel, params_dtype, kwargs))
        self._init_te()
