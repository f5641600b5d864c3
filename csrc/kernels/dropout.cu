// Dropout (+ residual add) with a regenerated mask (csrc/include/te_parallel/dropout.h). Each thread takes
// groups of 8 elements (one 16-byte load of bf16 / fp16, two of fp32) and draws their 8 words from two
// Philox4x32-10 calls, one per 4 elements, so the mask is fixed by the element index alone.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "convert.cuh"
#include "te_parallel/dropout.h"

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;

struct Words {
  uint32_t w[4];
};

__device__ __forceinline__ Words philox(uint64_t seed, uint64_t group, uint64_t offset) {
  uint32_t c0 = static_cast<uint32_t>(group), c1 = static_cast<uint32_t>(group >> 32);
  uint32_t c2 = static_cast<uint32_t>(offset), c3 = static_cast<uint32_t>(offset >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Words{{c0, c1, c2, c3}};
}

template <typename T>
struct alignas(16) Pack {
  T v[kVec];
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dropout_kernel(const T* __restrict__ x, const T* __restrict__ residual, T* out, long long n, float scale,
                   uint32_t threshold, uint64_t seed, uint64_t offset) {
  const long long groups = n / kVec;
  const long long stride = static_cast<long long>(gridDim.x) * kThreads;
  for (long long g = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; g < groups; g += stride) {
    const Words a = philox(seed, 2 * g, offset), b = philox(seed, 2 * g + 1, offset);
    const uint32_t words[kVec] = {a.w[0], a.w[1], a.w[2], a.w[3], b.w[0], b.w[1], b.w[2], b.w[3]};
    const Pack<T> xv = reinterpret_cast<const Pack<T>*>(x)[g];
    Pack<T> rv;
    if (residual != nullptr) rv = reinterpret_cast<const Pack<T>*>(residual)[g];
    Pack<T> ov;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float v = words[j] < threshold ? tep::to_float(xv.v[j]) * scale : 0.0f;
      if (residual != nullptr) v += tep::to_float(rv.v[j]);
      ov.v[j] = tep::from_float<T>(v);
    }
    reinterpret_cast<Pack<T>*>(out)[g] = ov;
  }
  // the tail (n % 8 elements), by the first block's threads, one element each
  const long long tail = groups * kVec;
  if (blockIdx.x == 0 && tail + threadIdx.x < n) {
    const long long i = tail + threadIdx.x;
    const Words w = philox(seed, static_cast<unsigned long long>(i) / 4, offset);
    float v = w.w[i % 4] < threshold ? tep::to_float(x[i]) * scale : 0.0f;
    if (residual != nullptr) v += tep::to_float(residual[i]);
    out[i] = tep::from_float<T>(v);
  }
}

int g_sms = 0;

template <typename T>
tep_status launch(const tep_dropout_params& p, cudaStream_t stream) {
  if (g_sms == 0) {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    g_sms = sms > 0 ? sms : 132;
  }
  const long long groups = p.n / kVec;
  const long long want = (groups + kThreads - 1) / kThreads;
  const long long most = static_cast<long long>(g_sms) * 8;  // grid-stride beyond a few waves
  const unsigned blocks = static_cast<unsigned>(want < 1 ? 1 : (want < most ? want : most));
  const float scale = 1.0f / (1.0f - p.p);
  dropout_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(p.x), static_cast<const T*>(p.residual),
                                                      static_cast<T*>(p.out), p.n, scale,
                                                      tep_dropout_keep_threshold(p.p), p.seed, p.offset);
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return TEP_SUCCESS;
  tep::set_error("tep_dropout_add: launch failed: %s: %s", cudaGetErrorName(err), cudaGetErrorString(err));
  return TEP_ERROR_CUDA;
}

}  // namespace

extern "C" uint32_t tep_dropout_keep_threshold(float p) {
  const double keep = 1.0 - static_cast<double>(p);
  if (!(keep > 0.0)) return 0;
  if (keep >= 1.0) return 0xFFFFFFFFu;
  return static_cast<uint32_t>(keep * 4294967296.0);
}

extern "C" tep_status tep_dropout_add(const tep_dropout_params* p, void* stream) {
  if (p == nullptr || p->x == nullptr || p->out == nullptr) {
    tep::set_error("tep_dropout_add: params, x and out must not be NULL");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (p->n < 1 || !(p->p >= 0.0f && p->p < 1.0f)) {
    tep::set_error("tep_dropout_add: n = %lld, p = %g; need n >= 1 and 0 <= p < 1", p->n, static_cast<double>(p->p));
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  const auto misaligned = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0; };
  if (misaligned(p->x) || misaligned(p->out) || (p->residual != nullptr && misaligned(p->residual))) {
    tep::set_error("tep_dropout_add: x, residual and out must be 16-byte aligned");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  cudaGetLastError();  // drop a stale error of an earlier call so the check is about ours
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->dtype) {
    case TEP_FLOAT32: return launch<float>(*p, s);
    case TEP_FLOAT16: return launch<__half>(*p, s);
    case TEP_BFLOAT16: return launch<__nv_bfloat16>(*p, s);
    default:
      tep::set_error("tep_dropout_add: dtype = %d; need TEP_FLOAT32, TEP_FLOAT16 or TEP_BFLOAT16", p->dtype);
      return TEP_ERROR_INVALID_ARGUMENT;
  }
}
