"""Rotary position embedding (RoPE): the frequency table and its application to q / k."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from te_parallel.ops.rope import apply_rope


class RotaryPositionEmbedding(nn.Module):
    """freqs[s] = s · base^(−2i/dim), i < dim/2; forward(max_seq_len) -> [s, 1, 1, rot_dim] (TE's layout).

    rotary_percent < 1 rotates only the first rotary_percent · dim channels of each head.
    seq_len_interpolation_factor divides the positions (linear position interpolation).
    """

    def __init__(self, dim: int, rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[float] = None,
                 pretrained_max_position_embeddings: Optional[int] = None, rotary_base: float = 10000.0) -> None:
        super().__init__()
        if not 0 < rotary_percent <= 1:
            raise ValueError(f"RotaryPositionEmbedding: rotary_percent must be in (0, 1], got {rotary_percent}")
        rot_dim = int(dim * rotary_percent)
        if rot_dim % 2:
            raise ValueError(f"RotaryPositionEmbedding: rotated channels dim·rotary_percent={rot_dim} must be even")
        self.rot_dim, self.interpolation, self.rotary_base = rot_dim, seq_len_interpolation_factor, rotary_base
        # on the ambient default device (meta under `with torch.device("meta")`), like any module's state
        self.register_buffer("inv_freq", torch.empty(rot_dim // 2, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recompute inv_freq (a buffer, not saved in the state dict): after `to_empty` it holds garbage.
        Computed on the CPU and copied, so it is the same bits whatever device the module lives on."""
        if self.inv_freq.is_meta:
            return
        exponent = torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device="cpu") / self.rot_dim
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / (self.rotary_base ** exponent))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.inv_freq.is_meta:
            raise RuntimeError("RotaryPositionEmbedding: its inv_freq buffer is on the meta device (no storage); "
                               "materialise it first with module.to_empty(device=...) and then module.reset_parameters()")
        pos = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        if self.interpolation is not None:
            pos = pos / self.interpolation
        freqs = torch.outer(pos, self.inv_freq)  # [s, rot_dim/2]
        return torch.cat([freqs, freqs], dim=-1).view(max_seq_len, 1, 1, self.rot_dim)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd") -> torch.Tensor:
    """Rotate the first rot_dim channels of t [s, b, h, d] ("sbhd") or [b, s, h, d] ("bshd") by freqs
    [s', 1, 1, rot_dim] (one fused kernel on CUDA: te_parallel.ops.rope)."""
    seq_dim = 0 if tensor_format == "sbhd" else 1
    s = t.shape[seq_dim]
    if freqs.shape[0] < s:
        raise ValueError(f"rotary_pos_emb covers {freqs.shape[0]} positions, the input has {s}")
    return apply_rope(t, freqs[:s], bshd=tensor_format == "bshd")
