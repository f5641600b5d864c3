// FP8 cast with fused transpose and amax: one read of the source, two FP8 writes (DESIGN.md §3).
//
// One block per 64x64 tile, 256 threads. Each thread converts 2 groups of 8 consecutive elements of a
// row (16-byte loads for 2-byte inputs when the row layout allows), writes the 8 FP8 bytes of each
// group with one 8-byte store, and parks them in shared memory; after a barrier each thread writes 2
// groups of 8 consecutive rows of one column of the transposed output. Partial tiles and unaligned
// layouts take an element-wise path inside the same kernel. |x| maxima are reduced per warp, per
// block, then folded into amax[0] with one atomicMax on the float's bits (valid for values >= 0; a
// NaN has larger bits than +inf, so NaN wins, as in torch.amax).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;
constexpr int kVec = 8;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFmt));
}

__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ src, float (&v)[kVec]) {
  // 8 consecutive elements, 16 or 32 bytes, aligned by the caller's check.
  if constexpr (sizeof(T) == 2) {
    uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = to_float(e[k]);
  } else {
    float4 a = reinterpret_cast<const float4*>(src)[0];
    float4 b = reinterpret_cast<const float4*>(src)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
}

template <typename T, __nv_fp8_interpretation_t kFmt>
__global__ void __launch_bounds__(kThreads) cast_transpose_kernel(
    const T* __restrict__ x, int64_t rows, int64_t cols, const float* __restrict__ scale_ptr,
    uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, float* __restrict__ amax_out, bool vec_in,
    bool vec_out, bool vec_out_t) {
  __shared__ uint8_t tile[kTile][kTile + 8];
  __shared__ float warp_max[kThreads / 32];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const float scale = *scale_ptr;
  float local_max = 0.f;
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    const int v = threadIdx.x + g * kThreads;  // 512 groups of 8 per tile
    const int r = v / (kTile / kVec), c = (v % (kTile / kVec)) * kVec;
    const int64_t gr = row0 + r, gc = col0 + c;
    float vals[kVec];
    uint8_t q[kVec];
    const bool full = gr < rows && gc + kVec <= cols;
    if (full && vec_in) {
      load8(x + gr * cols + gc, vals);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) vals[k] = (gr < rows && gc + k < cols) ? to_float(x[gr * cols + gc + k]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      local_max = nan_max(local_max, fabsf(vals[k]));
      q[k] = to_fp8<kFmt>(vals[k] * scale);
      tile[r][c + k] = q[k];
    }
    if (out != nullptr && gr < rows) {
      if (full && vec_out) {
        *reinterpret_cast<uint2*>(out + gr * cols + gc) = *reinterpret_cast<const uint2*>(q);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          if (gc + k < cols) out[gr * cols + gc + k] = q[k];
      }
    }
  }
  // Block amax: warp shuffle, then the first warp over the per-warp results.
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) local_max = nan_max(local_max, __shfl_xor_sync(0xffffffffu, local_max, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = local_max;
  __syncthreads();  // also publishes `tile` for the transposed writes
  if (amax_out != nullptr && threadIdx.x == 0) {
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = nan_max(m, warp_max[w]);
    atomicMax(reinterpret_cast<int*>(amax_out), __float_as_int(m));
  }
  if (out_t == nullptr) return;
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    const int v = threadIdx.x + g * kThreads;
    const int c = v / (kTile / kVec), r = (v % (kTile / kVec)) * kVec;  // column c, rows r..r+7
    const int64_t gc = col0 + c, gr = row0 + r;
    if (gc >= cols) continue;
    uint8_t q[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) q[k] = tile[r + k][c];
    if (gr + kVec <= rows && vec_out_t) {
      *reinterpret_cast<uint2*>(out_t + gc * rows + gr) = *reinterpret_cast<const uint2*>(q);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        if (gr + k < rows) out_t[gc * rows + gr + k] = q[k];
    }
  }
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

template <typename T>
tep_status launch(const void* x, int64_t rows, int64_t cols, const float* scale, void* out, void* out_t,
                  float* amax, int out_dtype, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  const bool vec_in = cols % kVec == 0 && aligned(x, 16);
  const bool vec_out = cols % kVec == 0 && (out == nullptr || aligned(out, 8));
  const bool vec_out_t = rows % kVec == 0 && (out_t == nullptr || aligned(out_t, 8));
  auto* xo = static_cast<uint8_t*>(out);
  auto* xt = static_cast<uint8_t*>(out_t);
  if (out_dtype == TEP_FLOAT8_E4M3) {
    cast_transpose_kernel<T, __NV_E4M3><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(x), rows, cols, scale, xo, xt, amax, vec_in, vec_out, vec_out_t);
  } else {
    cast_transpose_kernel<T, __NV_E5M2><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(x), rows, cols, scale, xo, xt, amax, vec_in, vec_out, vec_out_t);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    tep::set_error("tep_cast_transpose_amax: launch of [%lld, %lld] failed: %s", static_cast<long long>(rows),
                   static_cast<long long>(cols), cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}

}  // namespace

extern "C" tep_status tep_cast_transpose_amax(const void* x, int x_dtype, long long rows, long long cols,
                                              const float* scale, void* out, void* out_t, float* amax,
                                              int out_dtype, void* stream) {
  if (x == nullptr || scale == nullptr || (out == nullptr && out_t == nullptr)) {
    tep::set_error("tep_cast_transpose_amax: x, scale and at least one of out / out_t must be non-NULL");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (rows < 1 || cols < 1 || (rows + kTile - 1) / kTile > 65535) {
    tep::set_error("tep_cast_transpose_amax: rows = %lld, cols = %lld; need rows, cols >= 1 and rows <= %d", rows, cols,
                   65535 * kTile);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (out_dtype != TEP_FLOAT8_E4M3 && out_dtype != TEP_FLOAT8_E5M2) {
    tep::set_error("tep_cast_transpose_amax: out_dtype = %d; need TEP_FLOAT8_E4M3 (3) or TEP_FLOAT8_E5M2 (4)", out_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  auto s = static_cast<cudaStream_t>(stream);
  switch (x_dtype) {
    case TEP_FLOAT32: return launch<float>(x, rows, cols, scale, out, out_t, amax, out_dtype, s);
    case TEP_FLOAT16: return launch<__half>(x, rows, cols, scale, out, out_t, amax, out_dtype, s);
    case TEP_BFLOAT16: return launch<__nv_bfloat16>(x, rows, cols, scale, out, out_t, amax, out_dtype, s);
    default:
      tep::set_error("tep_cast_transpose_amax: x_dtype = %d; need TEP_FLOAT32 (0), TEP_FLOAT16 (1) or TEP_BFLOAT16 (2)",
                     x_dtype);
      return TEP_ERROR_INVALID_ARGUMENT;
  }
}
