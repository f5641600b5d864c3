"""te_parallel: tensor-parallel FP8 transformer layers with Transformer Engine's PyTorch API.

    import te_parallel as te
    from te_parallel.common import recipe
"""
from te_parallel import init, native, recipe
from te_parallel.fp8 import Float8Tensor, fp8_autocast, is_fp8_available
from te_parallel.fp8.autocast import autocast  # TE 2.9's name (the package keeps the submodule name)
from te_parallel.fp8.params import Float8Weight, MasterWeights, fp8_model_init, quantized_model_init
from te_parallel.fp8.recompute import checkpoint
from te_parallel.convert import LLAMA_TP_PLAN, convert
from te_parallel.graph import make_graphed_callables
from te_parallel.module import (
    DotProductAttention,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    MultiheadAttention,
    RMSNorm,
    RotaryPositionEmbedding,
    TransformerLayer,
    apply_rotary_pos_emb,
)
from te_parallel.module.fp8_padding import Fp8Padding, Fp8Unpadding
from te_parallel.moe import MoEConfig, MoELayer, moe_aux_loss
from te_parallel.ops.moe_permute import (moe_permute, moe_permute_and_pad_with_probs, moe_permute_with_probs,
                                         moe_sort_chunks_by_index, moe_sort_chunks_by_index_with_probs, moe_unpermute)
from te_parallel.ops.moe_router import (fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,
                                        fused_topk_with_score_function)
from te_parallel.parallel.clip import clip_grad_norm_, get_total_norm
from te_parallel.parallel.dcp import dcp_state_dict, load_dcp_state_dict
from te_parallel.parallel.overlap import CommOverlap, OverlapConfig, initialize_ub
from te_parallel.parallel.random import CudaRNGStatesTracker
from te_parallel.te_layout import from_te_state_dict, to_te_state_dict
from te_parallel.fp8.quantizers import (DType, Float8BlockQuantizer, Float8BlockwiseQTensor,
                                         Float8CurrentScalingQuantizer, Float8Quantizer, LinearQuantizers,
                                         MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer, NVFP4Tensor, QuantizedTensor,
                                         Quantizer, QuantizerRole, get_default_fp8_recipe, get_device_compute_capability,
                                         is_bf16_available, is_fp8_block_scaling_available, is_mxfp8_available,
                                         is_nvfp4_available, make_quantizer, recipe_quantizers)

__version__ = "0.1.0"

native.available()  # import the compiled kernels now; warns once here if they were not built

__all__ = [
    "Linear",
    "GroupedLinear",
    "LayerNorm",
    "RMSNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "DotProductAttention",
    "MultiheadAttention",
    "TransformerLayer",
    "RotaryPositionEmbedding",
    "apply_rotary_pos_emb",
    "CudaRNGStatesTracker",
    "initialize_ub",
    "CommOverlap",
    "OverlapConfig",
    "checkpoint",
    "clip_grad_norm_",
    "dcp_state_dict",
    "get_total_norm",
    "load_dcp_state_dict",
    "to_te_state_dict",
    "from_te_state_dict",
    "make_graphed_callables",
    "convert",
    "LLAMA_TP_PLAN",
    "fp8_autocast",
    "autocast",
    "is_fp8_available",
    "Float8Tensor",
    "Float8Weight",
    "quantized_model_init",
    "fp8_model_init",
    "MasterWeights",
    "recipe",
    "init",
    "DType",
    "Quantizer",
    "Float8Quantizer",
    "Float8CurrentScalingQuantizer",
    "Float8BlockQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "QuantizedTensor",
    "Float8BlockwiseQTensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "QuantizerRole",
    "LinearQuantizers",
    "make_quantizer",
    "recipe_quantizers",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "get_default_fp8_recipe",
    "Fp8Padding",
    "Fp8Unpadding",
    "moe_permute",
    "moe_permute_with_probs",
    "moe_permute_and_pad_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "MoELayer",
    "MoEConfig",
    "moe_aux_loss",
]
