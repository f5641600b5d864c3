// Shared by the LayerNorm / RMSNorm kernel files (norm.cu: forward, norm_bwd.cu: backward); C API and
// math: te_parallel/norm.h. Internal, not part of the public API.
//
// Rows are split into chunks of 8 consecutive elements (one 16-byte load of a 2-byte dtype, two of
// fp32). A row is owned by `tpr` threads (a multiple of 32); thread t owns chunks t, t + tpr, ...
// Which thread owns which element, and so every sum's order, depends only on (rows, hidden): the
// aligned (vector) and unaligned (element-wise) paths load and store the same chunks differently,
// so the result bits do not depend on pointer alignment or on the output dtype.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "convert.cuh"
#include "te_parallel/norm.h"

namespace tep {
namespace norm {

constexpr int kVec = 8;            // elements per chunk
constexpr int kMaxThreads = 512;   // threads per block of the row kernels
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kRowThreads = 256;   // rows narrower than this share a block up to this many threads
constexpr int64_t kMaxGrid = 1 << 22;  // row kernels stride over the rows beyond this many blocks
constexpr int kColRows = 8;        // row lanes of the dgamma/dbeta column kernel (blockDim.y)

// ------------------------------------------------------------------------------------------------
// Element access
// Element conversions and the NaN-propagating max: convert.cuh (re-exported here).
using tep::from_float;
using tep::nan_max;
using tep::to_float;

// Elements col .. col+7 of `row` (zeros past `hidden`); the caller guarantees col < hidden. `vec`:
// the host checked hidden % 8 == 0 and 16-byte alignment, so the chunk is whole and aligned.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, int64_t col, int64_t hidden, bool vec,
                                           float (&v)[kVec]) {
  if (vec) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + col);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[k] = to_float(e[k]);
    } else {
      const float4 a = reinterpret_cast<const float4*>(row + col)[0];
      const float4 b = reinterpret_cast<const float4*>(row + col)[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = col + k < hidden ? to_float(row[col + k]) : 0.f;
  }
}

// gamma / beta, whose dtype is a runtime argument (uniform over the grid, so no divergence).
__device__ __forceinline__ void load_chunk_any(const void* p, int dtype, int64_t col, int64_t hidden, bool vec,
                                               float (&v)[kVec]) {
  switch (dtype) {
    case TEP_FLOAT16: load_chunk(static_cast<const __half*>(p), col, hidden, vec, v); break;
    case TEP_BFLOAT16: load_chunk(static_cast<const __nv_bfloat16*>(p), col, hidden, vec, v); break;
    default: load_chunk(static_cast<const float*>(p), col, hidden, vec, v); break;
  }
}

template <typename T>
__device__ __forceinline__ void store_chunk(T* __restrict__ row, int64_t col, int64_t hidden, bool vec,
                                            const float (&v)[kVec]) {
  if (vec) {
    if constexpr (sizeof(T) == 2) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) e[k] = from_float<T>(v[k]);
      *reinterpret_cast<uint4*>(row + col) = raw;
    } else {
      reinterpret_cast<float4*>(row + col)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(row + col)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      if (col + k < hidden) row[col + k] = from_float<T>(v[k]);
  }
}

// fp8(y * scale): one fp32 multiplication (no contraction), then the saturating RNE conversion.
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ void store_fp8(uint8_t* __restrict__ row, int64_t col, int64_t hidden, bool vec,
                                          const float (&y)[kVec], float scale) {
  alignas(8) uint8_t q[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k)
    q[k] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(y[k], scale), __NV_SATFINITE, kFmt));
  if (vec) {
    *reinterpret_cast<uint2*>(row + col) = *reinterpret_cast<const uint2*>(q);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      if (col + k < hidden) row[col + k] = q[k];
  }
}

// Chunk of one output row (`offset` = row * hidden elements) in the runtime output dtype.
__device__ __forceinline__ void store_out(void* out, int out_dtype, int64_t offset, int64_t col, int64_t hidden,
                                          bool vec, const float (&y)[kVec], float scale) {
  switch (out_dtype) {
    case TEP_FLOAT32: store_chunk(static_cast<float*>(out) + offset, col, hidden, vec, y); break;
    case TEP_FLOAT16: store_chunk(static_cast<__half*>(out) + offset, col, hidden, vec, y); break;
    case TEP_BFLOAT16: store_chunk(static_cast<__nv_bfloat16*>(out) + offset, col, hidden, vec, y); break;
    case TEP_FLOAT8_E4M3: store_fp8<__NV_E4M3>(static_cast<uint8_t*>(out) + offset, col, hidden, vec, y, scale); break;
    default: store_fp8<__NV_E5M2>(static_cast<uint8_t*>(out) + offset, col, hidden, vec, y, scale); break;
  }
}

__device__ __forceinline__ void store_scalar_any(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case TEP_FLOAT16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case TEP_BFLOAT16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// ------------------------------------------------------------------------------------------------
// Reductions

// Sums of (v.x, v.y) over the blockDim.x threads of row slot threadIdx.y. Lanes combine by a xor
// butterfly (a + b == b + a, so every lane gets the same bits) and warps in a fixed order: all threads
// of a row agree, and reruns give the same bits. Every thread of the block must call it.
__device__ __forceinline__ float2 row_sum2(float2 v, float2* buf) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, off);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, off);
  }
  const int nw = blockDim.x >> 5;
  if (nw == 1) return v;  // uniform over the block: no barrier needed
  const int base = threadIdx.y * nw;
  if ((threadIdx.x & 31) == 0) buf[base + (threadIdx.x >> 5)] = v;
  __syncthreads();
  float2 s = buf[base];
  for (int w = 1; w < nw; ++w) {
    s.x += buf[base + w].x;
    s.y += buf[base + w].y;
  }
  __syncthreads();  // the next call overwrites buf
  return s;
}

// amax[0] = max(amax[0], block max of m): one atomicMax on the float's bits (valid for values >= 0;
// a NaN has larger bits than +inf, so NaN wins, as in torch.amax). Every thread must call it.
__device__ __forceinline__ void block_amax(float m, float* amax, float* buf) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, off));
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  if ((tid & 31) == 0) buf[tid >> 5] = m;
  __syncthreads();
  if (tid == 0) {
    float r = 0.f;
    const int nw = (blockDim.x * blockDim.y) >> 5;
    for (int w = 0; w < nw; ++w) r = nan_max(r, buf[w]);
    atomicMax(reinterpret_cast<int*>(amax), __float_as_int(r));
  }
}

// ------------------------------------------------------------------------------------------------
// Host side: launch plans

// How a row is spread over a block: `vecs` chunks per thread (0: the looped kernel), `tpr` threads
// per row, `rpc` rows per block. caps[i]: the most threads per row allowed with 1, 2, 4 chunks.
struct RowShape {
  int vecs, tpr, rpc;
};

inline RowShape row_shape(int64_t hidden, const int (&caps)[3]) {
  const int64_t nchunks = (hidden + kVec - 1) / kVec;
  const int vecs[3] = {1, 2, 4};
  for (int i = 0; i < 3; ++i) {
    const int64_t tpr = ((nchunks + vecs[i] - 1) / vecs[i] + 31) / 32 * 32;
    if (tpr <= caps[i]) {
      const int t = static_cast<int>(tpr);
      return {vecs[i], t, std::max(1, kRowThreads / t)};
    }
  }
  return {0, kMaxThreads, 1};
}

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

inline unsigned grid_for(int64_t rows, int rpc) {
  return static_cast<unsigned>(std::min<int64_t>((rows + rpc - 1) / rpc, kMaxGrid));
}

inline tep_status cuda_failed(const char* what, cudaError_t err) {
  cudaGetLastError();  // a failed query must not surface at the next launch check
  tep::set_error("%s: %s", what, cudaGetErrorString(err));
  return TEP_ERROR_CUDA;
}

// ------------------------------------------------------------------------------------------------
// Argument checks (one line each: what was given, what is needed)

inline bool is_hp(int dtype) { return dtype == TEP_FLOAT32 || dtype == TEP_FLOAT16 || dtype == TEP_BFLOAT16; }
inline bool is_fp8(int dtype) { return dtype == TEP_FLOAT8_E4M3 || dtype == TEP_FLOAT8_E5M2; }

inline tep_status check_params(const char* fn, const tep_norm_params* p, int x_dtype) {
  if (p == nullptr) {
    tep::set_error("%s: params is NULL", fn);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (p->norm_type != TEP_LAYERNORM && p->norm_type != TEP_RMSNORM) {
    tep::set_error("%s: norm_type = %d; need TEP_LAYERNORM (0) or TEP_RMSNORM (1)", fn, p->norm_type);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (p->rows < 1 || p->hidden < 1) {
    tep::set_error("%s: rows = %lld, hidden = %lld; need both >= 1", fn, p->rows, p->hidden);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (!is_hp(x_dtype) || !is_hp(p->w_dtype)) {
    tep::set_error("%s: x_dtype = %d, w_dtype = %d; need TEP_FLOAT32 (0), TEP_FLOAT16 (1) or TEP_BFLOAT16 (2)", fn,
                   x_dtype, p->w_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (p->gamma == nullptr || (p->norm_type == TEP_RMSNORM && p->beta != nullptr)) {
    tep::set_error("%s: gamma must be non-NULL, and beta NULL for RMSNorm", fn);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  return TEP_SUCCESS;
}

}  // namespace norm
}  // namespace tep
