"""TE's Fp8Padding (pad each expert's rows for grouped FP8 GEMMs): te_parallel's. Fp8Unpadding is also
importable from here, as the package's own __init__ does."""
from te_parallel import Fp8Padding, Fp8Unpadding

__all__ = ["Fp8Padding", "Fp8Unpadding"]
