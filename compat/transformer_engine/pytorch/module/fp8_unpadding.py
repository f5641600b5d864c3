"""TE's Fp8Unpadding (drop the rows Fp8Padding added): te_parallel's."""
from te_parallel import Fp8Unpadding

__all__ = ["Fp8Unpadding"]
