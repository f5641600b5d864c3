"""TE's `transformer_engine.pytorch.cpp_extensions` (its compiled kernels' Python face). `general_gemm` runs
high-precision GEMMs (clients call it outside TE's modules: Megatron-core's MoE router); the rest is
import-only: te_parallel's kernels are reached through te_parallel.native, with other signatures.
`fused_attn` holds TE's fused-attention backend codes."""
from transformer_engine.pytorch._missing import missing_function
from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend, fused_attn_bwd, fused_attn_fwd
from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm

cast_to_fp8 = missing_function("cpp_extensions.cast_to_fp8", "TE's cast_to_fp8")

__all__ = ["general_gemm", "cast_to_fp8", "FusedAttnBackend", "fused_attn_fwd", "fused_attn_bwd"]
