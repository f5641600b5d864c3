"""TE's MoE token permutation (`transformer_engine.pytorch.permutation`): te_parallel's, with TE's signatures.

The row_id_map these return is te_parallel's own format (docs/moe.md): pass it back to these functions only."""
from te_parallel import (moe_permute, moe_permute_and_pad_with_probs, moe_permute_with_probs, moe_sort_chunks_by_index,
                         moe_sort_chunks_by_index_with_probs, moe_unpermute)

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]
