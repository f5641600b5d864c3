"""TE's `transformer_engine.pytorch.cpp_extensions.fused_attn`: the codes of TE's cuDNN fused-attention
sub-backends (TE's NVTE_Fused_Attn_Backend values), and its kernels' entry points, import-only.
te_parallel's attention picks its own backends (te_parallel.ops.attention; docs/attention.md), none of
which is TE's fused attention, so nothing here reports one as available."""
import enum

from transformer_engine.pytorch._missing import missing_function

__all__ = ["FusedAttnBackend", "fused_attn_fwd", "fused_attn_bwd"]


class FusedAttnBackend(enum.IntEnum):
    """TE's fused-attention sub-backends; `FusedAttnBackend["FP8"]` looks one up by name."""

    No_Backend = -1
    F16_arbitrary_seqlen = 1
    FP8 = 2

    @classmethod
    def cast(cls, backend) -> "FusedAttnBackend":
        """The member with `backend`'s integer value."""
        return backend if isinstance(backend, cls) else cls(int(backend))


fused_attn_fwd = missing_function("cpp_extensions.fused_attn.fused_attn_fwd", "TE's cuDNN fused attention")
fused_attn_bwd = missing_function("cpp_extensions.fused_attn.fused_attn_bwd", "TE's cuDNN fused attention")
