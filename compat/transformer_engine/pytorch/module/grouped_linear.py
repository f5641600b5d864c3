"""TE's te.GroupedLinear: te_parallel.GroupedLinear with TE's keywords, attributes, checkpoint layout and tensor-
parallel contract (the layer moves nothing across tp_group: the MoE layer's dispatch and combine do)."""
from __future__ import annotations

from typing import Optional

import torch

import te_parallel

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

__all__ = ["GroupedLinear", "is_module_grouped_tensor_path_supported"]


class GroupedLinear(TransformerEngineBaseModule, te_parallel.GroupedLinear):
    """One grouped GEMM per pass over the experts (te_parallel.GroupedLinear). TE's keywords are te_parallel's;
    `tp_collectives` defaults to False here, TE's contract."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *args, **kwargs) -> None:
        kwargs.setdefault("tp_collectives", False)
        super().__init__(num_gemms, in_features, out_features, *args, **kwargs)
        # (delay_wgrad_compute is te_parallel.GroupedLinear's own: the mixin holds nothing back)
        self._init_te({"name": self.name, "save_original_input": self.save_original_input}, num_gemms=num_gemms,
                      ub_name=self.ub_name)
        self.delay_wgrad_compute = self.need_backward_dw()

    def _mark_tensor_parallel(self) -> None:
        """TE's attributes: every weight marked tensor-parallel, split on dim 1 in row mode and dim 0 otherwise
        (also with no parallel mode: Megatron builds its experts so under expert TP or EP, and its gradient norm
        counts each rank's expert shard by this mark); column-parallel biases on dim 0."""
        mode = self.parallel_mode
        for name, param in self.named_parameters(recurse=False):
            dim = (1 if mode == "row" else 0) if name.startswith("weight") else 0 if mode == "column" else None
            if dim is not None:
                param.tensor_model_parallel, param.partition_dim = True, dim
                param.partition_stride = getattr(param, "partition_stride", 1)

    def backward_dw(self) -> None:
        te_parallel.GroupedLinear.backward_dw(self)

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None,
                out: Optional[torch.Tensor] = None, dgrad_out: Optional[torch.Tensor] = None):
        if out is not None or dgrad_out is not None:
            raise NotImplementedError("GroupedLinear: out= / dgrad_out= (caller-provided output buffers) are not "
                                      "implemented in te_parallel; leave them None")
        self._note_region()
        return super().forward(inp, m_splits, is_first_microbatch)


def is_module_grouped_tensor_path_supported(recipe, dtype: torch.dtype) -> bool:
    """TE's check for GroupedLinear's grouped path, the one that reads no split sizes on the host (so CUDA graphs
    can hold it). te_parallel's GroupedLinear runs so for bf16 and for its FP8 recipes (delayed, current and block
    scaling); torch runs fp32 / fp16 grouped GEMMs on CUDA as a loop over host offsets."""
    if recipe is None:
        return dtype == torch.bfloat16
    return bool(recipe.delayed() or recipe.float8_current_scaling() or recipe.float8_block_scaling())
