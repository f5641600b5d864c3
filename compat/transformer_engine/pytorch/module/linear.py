"""TE's te.Linear: te_parallel.Linear with TE's keywords, attributes and checkpoint layout."""
from __future__ import annotations

from typing import Optional

import te_parallel

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, split_te_kwargs

__all__ = ["Linear", "check_fp8_io"]


def check_fp8_io(owner: str, fp8_output: bool, fp8_grad: bool) -> None:
    """TE can hand FP8 tensors between modules (fp8_output / fp8_grad); te_parallel's modules exchange
    high-precision tensors only."""
    if fp8_output or fp8_grad:
        raise NotImplementedError(f"{owner}: fp8_output / fp8_grad (FP8 tensors between modules) are not implemented "
                                  f"in te_parallel; leave them False")


class Linear(TransformerEngineBaseModule, te_parallel.Linear):
    """y = x·Wᵀ + b (te_parallel.Linear). TE 2.9's keywords: see TransformerEngineBaseModule."""

    def __init__(self, in_features: int, out_features: int, *args, **kwargs) -> None:
        te_kwargs = split_te_kwargs("Linear", kwargs)
        super().__init__(in_features, out_features, *args, **kwargs)
        self._init_te(te_kwargs, num_gemms=1, ub_name=kwargs.get("ub_name"))

    def forward(self, inp, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        check_fp8_io("Linear", fp8_output, fp8_grad)
        self._note_region()
        return super().forward(inp, is_first_microbatch)
