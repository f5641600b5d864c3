"""TE's te.MultiheadAttention: te_parallel.MultiheadAttention with TE 2.9's keywords (qk_norm_type, ...)
and TE's checkpoint layout."""
from __future__ import annotations

import te_parallel

from transformer_engine.pytorch._composite import TECompositeMixin, pop_composite_kwargs

__all__ = ["MultiheadAttention"]


class MultiheadAttention(TECompositeMixin, te_parallel.MultiheadAttention):
    """Self or cross attention with projections (te_parallel.MultiheadAttention)."""

    def __init__(self, hidden_size: int, num_attention_heads: int, *args, **kwargs) -> None:
        te = pop_composite_kwargs("MultiheadAttention", kwargs)
        super().__init__(hidden_size, num_attention_heads, *args, **kwargs)
        self._init_composite(te, [self])

    def forward(self, *args, **kwargs):
        self._before_forward()
        return super().forward(*args, **kwargs)
