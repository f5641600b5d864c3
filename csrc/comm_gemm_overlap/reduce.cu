// fp32-accumulated sum of up to 8 same-shaped inputs: the owner's reduction of reduce-scatter partials.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../kernels/common.h"
#include "../kernels/convert.cuh"
#include "te_parallel/comm_gemm_overlap.h"

namespace {

using tep::from_float;
using tep::to_float;

constexpr int kMaxInputs = 8;
constexpr int kThreads = 256;

struct Inputs {
  const void* ptr[kMaxInputs];
};

// Each thread handles VEC consecutive elements (one 16-byte load per input when VEC*sizeof(TIn)==16).
template <typename TIn, typename TOut, int VEC>
__global__ void reduce_kernel(Inputs in, int n, TOut* out, size_t num_vecs) {
  struct alignas(sizeof(TIn) * VEC) InVec { TIn v[VEC]; };
  struct alignas(sizeof(TOut) * VEC) OutVec { TOut v[VEC]; };
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < num_vecs;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc[VEC];
    InVec first = reinterpret_cast<const InVec*>(in.ptr[0])[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = to_float(first.v[j]);
    for (int k = 1; k < n; ++k) {
      InVec next = reinterpret_cast<const InVec*>(in.ptr[k])[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += to_float(next.v[j]);
    }
    OutVec result;
#pragma unroll
    for (int j = 0; j < VEC; ++j) result.v[j] = from_float<TOut>(acc[j]);
    reinterpret_cast<OutVec*>(out)[i] = result;
  }
}

template <typename TIn, typename TOut>
cudaError_t launch(const Inputs& in, int n, void* out, size_t numel, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(TIn);
  bool aligned = numel % kVec == 0 && reinterpret_cast<uintptr_t>(out) % (sizeof(TOut) * kVec) == 0;
  for (int k = 0; k < n; ++k) aligned = aligned && reinterpret_cast<uintptr_t>(in.ptr[k]) % 16 == 0;
  int sms = 132;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  auto grid_for = [&](size_t items) {
    size_t blocks = (items + kThreads - 1) / kThreads;
    size_t cap = static_cast<size_t>(sms) * 8;
    return static_cast<unsigned>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
  };
  if (aligned) {
    size_t vecs = numel / kVec;
    reduce_kernel<TIn, TOut, kVec><<<grid_for(vecs), kThreads, 0, stream>>>(in, n, static_cast<TOut*>(out), vecs);
  } else {
    reduce_kernel<TIn, TOut, 1><<<grid_for(numel), kThreads, 0, stream>>>(in, n, static_cast<TOut*>(out), numel);
  }
  return cudaGetLastError();
}

template <typename TIn>
cudaError_t dispatch_out(const Inputs& in, int n, int out_dtype, void* out, size_t numel, cudaStream_t s) {
  switch (out_dtype) {
    case TEP_FLOAT32: return launch<TIn, float>(in, n, out, numel, s);
    case TEP_FLOAT16: return launch<TIn, __half>(in, n, out, numel, s);
    case TEP_BFLOAT16: return launch<TIn, __nv_bfloat16>(in, n, out, numel, s);
    default: return cudaErrorInvalidValue;
  }
}

bool high_precision(int dtype) { return dtype == TEP_FLOAT32 || dtype == TEP_FLOAT16 || dtype == TEP_BFLOAT16; }

}  // namespace

extern "C" tep_status tep_reduce_sum(const void* const* inputs, int num_inputs, int in_dtype, void* out,
                                     int out_dtype, size_t numel, void* stream) {
  if (inputs == nullptr || num_inputs < 1 || num_inputs > kMaxInputs || out == nullptr ||
      !high_precision(in_dtype) || !high_precision(out_dtype)) {
    tep::set_error("tep_reduce_sum: got %d inputs, in_dtype=%d, out_dtype=%d%s; need 1..%d inputs and "
                   "float32/float16/bfloat16 dtypes", num_inputs, in_dtype, out_dtype,
                   out == nullptr ? ", no output" : "", kMaxInputs);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (numel == 0) return TEP_SUCCESS;
  Inputs in{};
  for (int k = 0; k < num_inputs; ++k) {
    if (inputs[k] == nullptr) {
      tep::set_error("tep_reduce_sum: input %d is a null pointer", k);
      return TEP_ERROR_INVALID_ARGUMENT;
    }
    in.ptr[k] = inputs[k];
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  switch (in_dtype) {
    case TEP_FLOAT32: err = dispatch_out<float>(in, num_inputs, out_dtype, out, numel, s); break;
    case TEP_FLOAT16: err = dispatch_out<__half>(in, num_inputs, out_dtype, out, numel, s); break;
    default: err = dispatch_out<__nv_bfloat16>(in, num_inputs, out_dtype, out, numel, s); break;
  }
  if (err != cudaSuccess) {
    tep::set_error("tep_reduce_sum: launch failed: %s", cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}
