"""TE's `transformer_engine.pytorch.attention.rope`: rotary position embeddings (te_parallel.module.rope).

TE 2.9's apply_rotary_pos_emb keywords: `fused` is accepted (te_parallel picks its own kernels);
interleaved pairs, packed sequences (`cu_seqlens`, "thd"), `start_positions` and context parallelism
raise NotImplementedError.
"""
from __future__ import annotations

import torch

from te_parallel.module.rope import RotaryPositionEmbedding
from te_parallel.module.rope import apply_rotary_pos_emb as _apply

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd", start_positions=None,
                         interleaved: bool = False, fused: bool = False, cu_seqlens=None, cp_size: int = 1,
                         cp_rank: int = 0) -> torch.Tensor:
    """Rotate the first rot_dim channels of t ("sbhd" [s, b, h, d] or "bshd") by freqs [s, 1, 1, rot_dim]."""
    unsupported = {"interleaved=True": interleaved, "cu_seqlens (packed 'thd' input)": cu_seqlens is not None
                   or tensor_format == "thd", "start_positions": start_positions is not None, "cp_size > 1": cp_size > 1}
    named = [k for k, v in unsupported.items() if v]
    if named:
        raise NotImplementedError(f"apply_rotary_pos_emb: {', '.join(named)} is not implemented in te_parallel")
    return _apply(t, freqs, tensor_format)
