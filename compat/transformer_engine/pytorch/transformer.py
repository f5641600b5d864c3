"""TE's te.TransformerLayer: te_parallel.TransformerLayer with TE 2.9's keywords (qk_norm_type, ...) and
TE's checkpoint layout."""
from __future__ import annotations

import te_parallel

from transformer_engine.pytorch._composite import TECompositeMixin, pop_composite_kwargs

__all__ = ["TransformerLayer"]


class TransformerLayer(TECompositeMixin, te_parallel.TransformerLayer):
    """One transformer block (te_parallel.TransformerLayer)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int, *args, **kwargs) -> None:
        if kwargs.pop("parallel_attention_mlp", False):
            raise NotImplementedError("TransformerLayer: parallel_attention_mlp=True (attention and MLP side by side on "
                                      "one input) is not implemented in te_parallel; leave it False")
        te = pop_composite_kwargs("TransformerLayer", kwargs)
        super().__init__(hidden_size, ffn_hidden_size, num_attention_heads, *args, **kwargs)
        self._init_composite(te, [getattr(self, "self_attention", None), getattr(self, "inter_attention", None)])

    def forward(self, *args, **kwargs):
        self._before_forward()
        return super().forward(*args, **kwargs)
