"""TE's `transformer_engine.pytorch.cpp_extensions` (its compiled kernels' Python face): import-only.
te_parallel's kernels are reached through te_parallel.native, with other signatures."""
from transformer_engine.pytorch._missing import missing_function

general_gemm = missing_function("cpp_extensions.general_gemm", "TE's general_gemm")
cast_to_fp8 = missing_function("cpp_extensions.cast_to_fp8", "TE's cast_to_fp8")

__all__ = ["general_gemm", "cast_to_fp8"]
