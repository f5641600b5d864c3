// Element conversions shared by the kernel files (fp32 math on fp32 / fp16 / bf16 storage), and the
// NaN-propagating max used by every amax. Internal, not part of the public C API.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tep {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round-to-nearest-even into T.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// max(a, b) where a NaN in b wins (NaN amaxes propagate, as torch.amax's do).
__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

}  // namespace tep
