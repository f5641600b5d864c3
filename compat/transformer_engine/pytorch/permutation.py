"""TE's MoE token permutation kernels: import-only in te_parallel."""
from transformer_engine.pytorch._missing import missing_function

_WHAT = "MoE token permutation"
moe_permute = missing_function("permutation.moe_permute", _WHAT)
moe_permute_with_probs = missing_function("permutation.moe_permute_with_probs", _WHAT)
moe_unpermute = missing_function("permutation.moe_unpermute", _WHAT)
moe_sort_chunks_by_index = missing_function("permutation.moe_sort_chunks_by_index", _WHAT)
moe_sort_chunks_by_index_with_probs = missing_function("permutation.moe_sort_chunks_by_index_with_probs", _WHAT)

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_unpermute", "moe_sort_chunks_by_index",
           "moe_sort_chunks_by_index_with_probs"]
