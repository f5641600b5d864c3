"""TE's `transformer_engine.common`: the recipes (the C library of TE has no counterpart here)."""
from transformer_engine.common import recipe

__all__ = ["recipe"]
