"""TE's te.LayerNormLinear: te_parallel.LayerNormLinear with TE's keywords, attributes and checkpoint layout."""
from __future__ import annotations

from typing import Optional

import te_parallel

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, split_te_kwargs
from transformer_engine.pytorch.module.linear import check_fp8_io

__all__ = ["LayerNormLinear"]


class LayerNormLinear(TransformerEngineBaseModule, te_parallel.LayerNormLinear):
    """y = norm(x)·Wᵀ + b (te_parallel.LayerNormLinear). TE 2.9's keywords: see TransformerEngineBaseModule."""

    def __init__(self, in_features: int, out_features: int, *args, **kwargs) -> None:
        te_kwargs = split_te_kwargs("LayerNormLinear", kwargs)
        super().__init__(in_features, out_features, *args, **kwargs)
        self._init_te(te_kwargs, num_gemms=1, ub_name=kwargs.get("ub_name"))

    def forward(self, inp, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        check_fp8_io("LayerNormLinear", fp8_output, fp8_grad)
        self._note_region()
        return super().forward(inp, is_first_microbatch)
