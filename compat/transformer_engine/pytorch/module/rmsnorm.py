"""TE's te.RMSNorm (TE 2.x: an operation taking `normalized_shape`), backed by te_parallel.RMSNorm."""
from __future__ import annotations

import te_parallel

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from transformer_engine.pytorch.module.layernorm import norm_kwargs

__all__ = ["RMSNorm"]


class RMSNorm(TransformerEngineBaseModule, te_parallel.RMSNorm):
    """RMSNorm over the last dim (te_parallel.RMSNorm)."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma: bool = False, hidden_size=None, **kwargs) -> None:
        super().__init__(eps=eps, zero_centered_gamma=zero_centered_gamma,
                         **norm_kwargs("RMSNorm", normalized_shape, hidden_size, sequence_parallel, params_dtype, kwargs))
        self._init_te()
