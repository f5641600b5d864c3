// Current scaling of one tensor: amax = max |x| and the FP8 scale it gives, in two launches and no
// host round trip (te_parallel/fp8/scaling.py current_scale and te_parallel/ops/cast.py amax_of are the
// references; the results are bit-identical to theirs).
//
//   pass 1 (many blocks): each block writes the NaN-propagating max |x| of its grid-stride share into
//          partials[block]; no atomics, so nothing has to be zeroed first and the result does not
//          depend on the order blocks finish in.
//   pass 2 (one block):   amax = max over partials (or amax_in), then scale = fp8_max / amax (one IEEE
//          fp32 division) where amax is finite and > 0 and the quotient is finite, else 1; scale_inv =
//          1 / scale.
// A tensor at HBM bandwidth needs ~4 waves of blocks per SM to hide load latency; kMaxBlocks covers
// 132 SMs with 8 blocks each, and a small tensor gets one block per kItemsPerBlock elements.
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "convert.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 1056;
constexpr long long kItemsPerBlock = 16384;

__device__ __forceinline__ float warp_nan_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = tep::nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide NaN-propagating max, valid in thread 0.
__device__ float block_nan_max(float v) {
  __shared__ float warp_max[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = warp_nan_max(v);
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_nan_max(lane < kWarps ? warp_max[lane] : 0.0f);
  return v;
}

// 16-byte vectors of T: the loads of one thread in one iteration.
template <typename T>
struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__global__ void __launch_bounds__(kThreads) partial_amax_kernel(const T* x, long long n, float* partials) {
  float m = 0.0f;  // |x| >= 0: 0 is the identity (and an empty share's max)
  const long long stride = static_cast<long long>(gridDim.x) * kThreads;
  const long long first = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  long long head = 0;  // elements before the first 16-byte boundary go through the scalar loop
  if (reinterpret_cast<std::uintptr_t>(x) % 16 == 0) {
    using V = Vec<T>;
    const long long vectors = n / V::kSize;
    const V* xv = reinterpret_cast<const V*>(x);
#pragma unroll 2
    for (long long i = first; i < vectors; i += stride) {
      const V chunk = xv[i];
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) m = tep::nan_max(m, fabsf(tep::to_float(chunk.v[k])));
    }
    head = vectors * V::kSize;  // the tail after the last whole vector
  }
  for (long long i = head + first; i < n; i += stride) m = tep::nan_max(m, fabsf(tep::to_float(x[i])));
  m = block_nan_max(m);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

__global__ void __launch_bounds__(kThreads)
    scale_from_amax_kernel(const float* partials, int num_partials, const float* amax_in, float fp8_max,
                           float* amax_out, float* scale_out, float* scale_inv_out) {
  float m = 0.0f;
  if (amax_in != nullptr) {
    m = amax_in[0];  // one value: every thread holds it, thread 0 writes
  } else {
    for (int i = threadIdx.x; i < num_partials; i += kThreads) m = tep::nan_max(m, partials[i]);
    m = block_nan_max(m);
  }
  if (threadIdx.x != 0) return;
  if (amax_out != nullptr) amax_out[0] = m;
  if (scale_out == nullptr) return;
  const float quotient = __fdiv_rn(fp8_max, m);
  const float scale = (isfinite(m) && m > 0.0f && isfinite(quotient)) ? quotient : 1.0f;
  scale_out[0] = scale;
  if (scale_inv_out != nullptr) scale_inv_out[0] = __fdiv_rn(1.0f, scale);
}

int blocks_for(long long n) {
  const long long blocks = (n + kItemsPerBlock - 1) / kItemsPerBlock;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

template <typename T>
void launch_partials(const void* x, long long n, float* partials, int blocks, cudaStream_t s) {
  partial_amax_kernel<T><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), n, partials);
}

tep_status check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return TEP_SUCCESS;
  tep::set_error("tep_current_scale: %s launch failed: %s: %s", what, cudaGetErrorName(err), cudaGetErrorString(err));
  return TEP_ERROR_CUDA;
}

}  // namespace

extern "C" int tep_current_scale_partials(long long n) { return blocks_for(n); }

extern "C" tep_status tep_current_scale(const void* x, int x_dtype, long long n, const float* amax_in,
                                        float fp8_max, float* partials, float* amax_out, float* scale_out,
                                        float* scale_inv_out, void* stream) {
  const char* fn = "tep_current_scale";
  if ((x == nullptr) == (amax_in == nullptr)) {
    tep::set_error("%s: give exactly one of x (%p) and amax_in (%p)", fn, x, static_cast<const void*>(amax_in));
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (x != nullptr && (n < 1 || partials == nullptr)) {
    tep::set_error("%s: x needs n >= 1 elements and a partials buffer, got n = %lld, partials = %p", fn, n,
                   static_cast<void*>(partials));
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (x != nullptr && x_dtype != TEP_FLOAT32 && x_dtype != TEP_FLOAT16 && x_dtype != TEP_BFLOAT16) {
    tep::set_error("%s: x_dtype = %d; need TEP_FLOAT32, TEP_FLOAT16 or TEP_BFLOAT16", fn, x_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (!std::isfinite(fp8_max) || !(fp8_max > 0.0f) || (amax_out == nullptr && scale_out == nullptr)) {
    tep::set_error("%s: fp8_max = %g (need finite > 0), amax_out = %p, scale_out = %p (need at least one)", fn,
                   fp8_max, static_cast<void*>(amax_out), static_cast<void*>(scale_out));
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  cudaGetLastError();  // drop a stale error of an earlier call so the checks below are about ours
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int blocks = x != nullptr ? blocks_for(n) : 0;
  if (x != nullptr) {
    if (x_dtype == TEP_FLOAT32) launch_partials<float>(x, n, partials, blocks, s);
    else if (x_dtype == TEP_FLOAT16) launch_partials<__half>(x, n, partials, blocks, s);
    else launch_partials<__nv_bfloat16>(x, n, partials, blocks, s);
    const tep_status st = check_launch("partial amax");
    if (st != TEP_SUCCESS) return st;
  }
  scale_from_amax_kernel<<<1, kThreads, 0, s>>>(partials, blocks, amax_in, fp8_max, amax_out, scale_out,
                                                 scale_inv_out);
  return check_launch("scale");
}
