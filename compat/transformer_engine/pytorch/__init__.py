"""TE's `transformer_engine.pytorch`, backed by te_parallel (docs/compat.md: what is mapped, what works)."""
from te_parallel import make_graphed_callables
from te_parallel.fp8.quantizers import DType

from transformer_engine.pytorch import fp8, ops, quantization  # TE's module paths
from transformer_engine.pytorch.attention import DotProductAttention, InferenceParams, MultiheadAttention
from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, checkpoint
from transformer_engine.pytorch.fp8 import (autocast, check_fp8_support, check_mxfp8_support, fp8_autocast,
                                            fp8_model_init, is_fp8_available, is_fp8_block_scaling_available,
                                            is_mxfp8_available, is_nvfp4_available, quantized_model_init)
from transformer_engine.pytorch.module import (Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm, LayerNormLinear,
                                               LayerNormMLP, Linear, RMSNorm, initialize_ub)
from transformer_engine.pytorch.permutation import (moe_permute, moe_permute_with_probs, moe_sort_chunks_by_index,
                                                    moe_sort_chunks_by_index_with_probs, moe_unpermute)
from transformer_engine.pytorch.quantization import QuantizerRole, get_default_recipe
from transformer_engine.pytorch.tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor,
                                               Float8BlockwiseQTensorStorage, Float8CurrentScalingQuantizer,
                                               Float8Quantizer, Float8Tensor, Float8TensorStorage, MXFP8Quantizer,
                                               MXFP8Tensor, MXFP8TensorStorage, NVFP4Quantizer, NVFP4Tensor,
                                               NVFP4TensorStorage, QuantizedTensor, QuantizedTensorStorage, Quantizer)
from transformer_engine.pytorch.transformer import TransformerLayer
from transformer_engine.pytorch.utils import get_cudnn_version, get_device_compute_capability, is_bf16_available

__all__ = ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "DotProductAttention",
           "MultiheadAttention", "TransformerLayer", "InferenceParams", "Fp8Padding", "Fp8Unpadding",
           "fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init", "check_fp8_support",
           "check_mxfp8_support", "is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available",
           "is_nvfp4_available", "make_graphed_callables", "checkpoint", "CudaRNGStatesTracker",
           "get_cpu_offload_context", "initialize_ub", "Float8Tensor", "QuantizedTensor", "moe_permute",
           "moe_permute_with_probs", "moe_unpermute", "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs",
           "fp8", "quantization", "ops", "DType", "Quantizer", "QuantizedTensorStorage", "Float8Quantizer",
           "Float8CurrentScalingQuantizer", "Float8BlockQuantizer", "MXFP8Quantizer", "NVFP4Quantizer",
           "Float8TensorStorage", "Float8BlockwiseQTensorStorage", "MXFP8TensorStorage", "NVFP4TensorStorage",
           "Float8BlockwiseQTensor", "MXFP8Tensor", "NVFP4Tensor", "QuantizerRole", "get_default_recipe",
           "is_bf16_available", "get_device_compute_capability", "get_cudnn_version"]
