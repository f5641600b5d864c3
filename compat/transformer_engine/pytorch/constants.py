"""TE's `transformer_engine.pytorch.constants`."""
import torch
import torch.distributed as dist

__all__ = ["TE_DType", "dist_group_type"]

# torch dtype -> TE's dtype code; te_parallel's kernels take torch dtypes, so the codes are the dtypes.
TE_DType = {dtype: dtype for dtype in (torch.uint8, torch.int32, torch.float32, torch.float16, torch.bfloat16,
                                       torch.float8_e4m3fn, torch.float8_e5m2)}
dist_group_type = dist.ProcessGroup
