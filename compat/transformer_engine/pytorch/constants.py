"""TE's `transformer_engine.pytorch.constants`: TE's dtype codes (te_parallel's `DType`) and their maps."""
import torch.distributed as dist

from te_parallel.fp8.quantizers import DType, TE_DType, TE_DType_To_Torch

__all__ = ["DType", "TE_DType", "TE_DType_To_Torch", "dist_group_type"]

# TE_DType: torch dtype -> DType code (uint8, int32, fp32, fp16, bf16 and the two FP8 dtypes);
# TE_DType_To_Torch: the inverse. DType.kFloat4E2M1 has no torch dtype, as in TE.
dist_group_type = dist.ProcessGroup
