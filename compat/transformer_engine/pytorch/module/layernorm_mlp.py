"""TE's te.LayerNormMLP: te_parallel.LayerNormMLP with TE's keywords, attributes and checkpoint layout.

`checkpoint=True` (TE's selective recompute) is te_parallel's own: the module's forward is recomputed
in backward, bit-identically (te.checkpoint).
"""
from __future__ import annotations

from typing import Optional

import te_parallel

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, split_te_kwargs

__all__ = ["LayerNormMLP"]


class LayerNormMLP(TransformerEngineBaseModule, te_parallel.LayerNormMLP):
    """fc2(act(fc1(norm(x)))) (te_parallel.LayerNormMLP). TE 2.9's keywords: see TransformerEngineBaseModule."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *args, **kwargs) -> None:
        te_kwargs = split_te_kwargs("LayerNormMLP", kwargs)
        activation_params = kwargs.pop("activation_params", None)
        if activation_params:
            raise NotImplementedError(f"LayerNormMLP: activation_params={activation_params!r} (parametrised "
                                      f"activations) are not implemented in te_parallel; leave it None")
        super().__init__(hidden_size, ffn_hidden_size, *args, **kwargs)
        self._init_te(te_kwargs, num_gemms=2)

    def forward(self, inp, is_first_microbatch: Optional[bool] = None):
        self._note_region()
        return super().forward(inp, is_first_microbatch)
