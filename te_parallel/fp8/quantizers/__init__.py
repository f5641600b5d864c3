"""Quantizers and quantized tensors with TE 2.x's API: its class names, constructors, attributes and layouts.

A quantizer turns a high-precision tensor into a `QuantizedTensor`: a torch.Tensor subclass that presents
the high-precision dtype and shape and holds the FP8 bytes and scales under TE's attribute names, so TE's
clients read them. Any torch op it does not handle itself runs on its dequantized value. `to_operand()`
gives te_parallel's GEMM operand of the same bytes (fp8.tensor.Float8Tensor, fp8.blockwise.BlockwiseTensor);
`recipe_quantizers` gives a recipe's quantizer of each GEMM operand.

| quantizer | scales | tensor |
|---|---|---|
| `Float8Quantizer(scale, amax, fp8_dtype)` | one per tensor: `scale` as given (delayed scaling); amax(x) is folded into `amax` | `Float8Tensor` |
| `Float8CurrentScalingQuantizer(fp8_dtype, device)` | one per tensor, from amax(x) (all-reduced MAX if asked) | `Float8Tensor` |
| `Float8BlockQuantizer(fp8_dtype, rowwise=, columnwise=)` | one per 1x128 tile or 128x128 block | `Float8BlockwiseQTensor` |
| `MXFP8Quantizer`, `NVFP4Quantizer` | Blackwell formats: making one raises | - |

A tensor of any rank is quantized as the matrix [M, K] = [prod(shape[:-1]), shape[-1]]. Usages: rowwise is
that matrix as it is (fprop reads x and W so, dgrad dy); columnwise is its transpose, stored [K, *shape[:-1]]
(dgrad's W, wgrad's dy and x). Bytes are stored as uint8, as in TE; `fp8_dtype` is one of TE's `DType` codes
(torch's FP8 dtypes are accepted). Current scaling uses TE's formula (fp8.blockwise.scales_from_amax):
amax = max(amax, amax_epsilon); scale = fp8_max / amax in fp32 (+inf becomes the input dtype's largest
value); rounded down to a power of two with force_pow_2_scales; 1 where amax is 0, inf or NaN.

Modules: `base` (Quantizer, QuantizedTensor and the ops it handles), `per_tensor`, `block`, `blackwell`
(the formats), `recipes` (QuantizerRole, recipe -> quantizers), `support` (where each format runs).
"""
from te_parallel.fp8.quantizers.base import QuantizedTensor, Quantizer
from te_parallel.fp8.quantizers.blackwell import MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer, NVFP4Tensor
from te_parallel.fp8.quantizers.block import Float8BlockQuantizer, Float8BlockwiseQTensor
from te_parallel.fp8.quantizers.dtypes import DType, TE_DType, TE_DType_To_Torch
from te_parallel.fp8.quantizers.per_tensor import (Float8CurrentScalingQuantizer, Float8Quantizer,
                                                   Float8Tensor)
from te_parallel.fp8.quantizers.recipes import (TENSOR_TYPES, LinearQuantizers, QuantizerRole, make_quantizer,
                                                recipe_quantizers)
from te_parallel.fp8.quantizers.support import (get_default_fp8_recipe, get_device_compute_capability,
                                                is_bf16_available, is_fp8_block_scaling_available, is_mxfp8_available,
                                                is_nvfp4_available)

__all__ = ["DType", "TE_DType", "TE_DType_To_Torch", "Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer",
           "Float8BlockQuantizer", "MXFP8Quantizer", "NVFP4Quantizer", "QuantizedTensor", "Float8Tensor",
           "Float8BlockwiseQTensor", "MXFP8Tensor", "NVFP4Tensor", "QuantizerRole", "TENSOR_TYPES", "LinearQuantizers",
           "make_quantizer", "recipe_quantizers", "get_device_compute_capability", "is_bf16_available",
           "is_fp8_block_scaling_available", "is_mxfp8_available", "is_nvfp4_available", "get_default_fp8_recipe"]
