"""FP8 numerics: autocast regions, per-module scaling state, scale updates, the Float8Tensor container."""
from te_parallel.fp8.autocast import fp8_autocast, is_fp8_available
from te_parallel.fp8.tensor import Float8Tensor

__all__ = ["fp8_autocast", "is_fp8_available", "Float8Tensor"]
