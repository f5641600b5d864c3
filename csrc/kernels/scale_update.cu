// Fused delayed-scaling update: amax from history -> scale, scale_inv -> roll the history.
//
// One launch covers every scaling state (one CUDA block per state), so the end of an FP8 step costs
// one kernel instead of ~4 small torch ops per state. The numerics must be bit-identical to the
// torch reference (te_parallel/fp8/scaling.py, update_delayed_scaling_torch), so:
//   - amax is a NaN-propagating max (torch.amax semantics; fmaxf would drop NaN);
//   - the scale is two IEEE fp32 divisions in the reference's order. __fdiv_rn spells out the
//     round-to-nearest division; the build uses no -use_fast_math, so no flush-to-zero either, and
//     denormal amaxes behave as in torch.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Each thread holds this many history elements in registers across the roll's barrier.
constexpr int kRollItemsPerThread = 4;
// The states travel by value in the kernel's parameters, which every CUDA version and architecture
// we build for caps at 4 KB: 96 states x 32 B = 3 KB. Longer lists are split into several launches.
constexpr int kMaxStatesPerLaunch = 96;

struct StateBatch {
  tep_scaling_state states[kMaxStatesPerLaunch];
};

struct UpdateParams {
  float fp8_max;
  float scale_divisor;
  int amax_algo;  // tep_amax_algo: TEP_AMAX_MAX over history, TEP_AMAX_MOST_RECENT (row 0)
  int update_scale;
};

// max(a, b) that returns NaN if either is NaN, like torch.amax.
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

__device__ __forceinline__ float warp_nan_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Block-wide NaN-propagating max; the result is valid in thread 0. Ends with a barrier so that the
// caller may reuse `warp_max` and may overwrite what the block just read.
__device__ float block_nan_max(float v, float* warp_max) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  v = warp_nan_max(v);
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_nan_max(lane < kWarps ? warp_max[lane] : -INFINITY);
  }
  __syncthreads();
  return v;
}

// amax over rows of column j of hist [L, n]. The per-thread loop strides rows; its loads do not depend
// on each other, so they pipeline (unrolled) instead of stalling one after another.
__device__ float column_amax(const float* hist, int64_t L, int n, int j, float* warp_max) {
  float m = -INFINITY;
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < L; i += kThreads) m = nan_max(m, hist[i * n + j]);
  return block_nan_max(m, warp_max);
}

// scale[j], scale_inv[j] from amax (one thread). A non-finite or non-positive amax, or a non-finite
// new scale, keeps the old scale, exactly as the torch reference's torch.where.
__device__ void update_scale_entry(float amax, float* scale, float* scale_inv, int j,
                                   const UpdateParams& p) {
  const float new_scale = __fdiv_rn(__fdiv_rn(p.fp8_max, amax), p.scale_divisor);
  float s = scale[j];
  if (isfinite(amax) && amax > 0.0f && isfinite(new_scale)) {
    s = new_scale;
    scale[j] = s;
  }
  scale_inv[j] = __fdiv_rn(1.0f, s);
}

// Rolls hist [L, n] down one row in place (row i <- row i-1, row 0 <- 0). In the flat view that is
// a shift by n elements toward the end. Chunks go from the end to the start: a chunk's loads come
// from below its own range and nothing below it has been stored yet; its stores may overwrite what
// its own loads read, hence the barrier between loads (into registers) and stores. The next chunk's
// stores, after the next barrier, cover what this chunk read below its start.
__device__ void roll_down_one_row(float* hist, int64_t total, int n) {
  constexpr int64_t kChunk = int64_t{kThreads} * kRollItemsPerThread;
  for (int64_t chunk_end = total; chunk_end > 0; chunk_end -= kChunk) {
    const int64_t chunk_begin = chunk_end - kChunk;  // negative on a partial last chunk
    float v[kRollItemsPerThread];
#pragma unroll
    for (int k = 0; k < kRollItemsPerThread; ++k) {
      const int64_t e = chunk_begin + int64_t{k} * kThreads + threadIdx.x;
      v[k] = e >= n ? hist[e - n] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kRollItemsPerThread; ++k) {
      const int64_t e = chunk_begin + int64_t{k} * kThreads + threadIdx.x;
      if (e >= 0) hist[e] = v[k];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(const StateBatch batch, const UpdateParams p) {
  __shared__ float warp_max[kWarps];
  const tep_scaling_state s = batch.states[blockIdx.x];
  const int64_t L = s.history_len;
  const int n = s.num_tensors;
  if (p.update_scale) {  // amax feeds only the scale: without an update it is not needed
    for (int j = 0; j < n; ++j) {
      const float amax = p.amax_algo == TEP_AMAX_MAX ? column_amax(s.amax_history, L, n, j, warp_max)
                                                     : s.amax_history[j];
      if (threadIdx.x == 0) update_scale_entry(amax, s.scale, s.scale_inv, j, p);
    }
  }
  __syncthreads();  // every amax read happens before the roll stores
  roll_down_one_row(s.amax_history, L * n, n);
}

tep_status validate(const tep_scaling_state* states, int num_states, float fp8_max,
                    float scale_divisor, int amax_algo) {
  const char* fn = "tep_delayed_scaling_update";
  if (num_states < 0) {
    tep::set_error("%s: num_states = %d; need >= 0", fn, num_states);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (num_states > 0 && states == nullptr) {
    tep::set_error("%s: states is NULL with num_states = %d", fn, num_states);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (amax_algo != TEP_AMAX_MAX && amax_algo != TEP_AMAX_MOST_RECENT) {
    tep::set_error("%s: amax_algo = %d; need 0 (max over history) or 1 (most recent)", fn,
                   amax_algo);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (!std::isfinite(fp8_max) || !(fp8_max > 0.0f) || !std::isfinite(scale_divisor) ||
      !(scale_divisor > 0.0f)) {
    tep::set_error("%s: fp8_max = %g, scale_divisor = %g; both must be finite and > 0", fn,
                   fp8_max, scale_divisor);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  for (int i = 0; i < num_states; ++i) {
    const tep_scaling_state& s = states[i];
    if (!s.amax_history || !s.scale || !s.scale_inv) {
      tep::set_error("%s: states[%d] has a NULL pointer (amax_history=%p, scale=%p, scale_inv=%p)",
                     fn, i, static_cast<void*>(s.amax_history), static_cast<void*>(s.scale),
                     static_cast<void*>(s.scale_inv));
      return TEP_ERROR_INVALID_ARGUMENT;
    }
    if (s.history_len < 1 || s.num_tensors < 1) {
      tep::set_error("%s: states[%d] has history_len = %d, num_tensors = %d; both must be >= 1", fn,
                     i, s.history_len, s.num_tensors);
      return TEP_ERROR_INVALID_ARGUMENT;
    }
  }
  return TEP_SUCCESS;
}

}  // namespace

extern "C" tep_status tep_delayed_scaling_update(const tep_scaling_state* states, int num_states,
                                                 float fp8_max, float scale_divisor, int amax_algo,
                                                 int update_scale, void* stream) {
  const tep_status status = validate(states, num_states, fp8_max, scale_divisor, amax_algo);
  if (status != TEP_SUCCESS) return status;
  const UpdateParams params{fp8_max, scale_divisor, amax_algo, update_scale != 0};
  cudaGetLastError();  // drop a stale error of an earlier call so the check below is about ours
  for (int first = 0; first < num_states; first += kMaxStatesPerLaunch) {
    const int count = std::min(kMaxStatesPerLaunch, num_states - first);
    StateBatch batch{};
    std::copy(states + first, states + first + count, batch.states);
    delayed_scaling_update_kernel<<<count, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        batch, params);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      tep::set_error("tep_delayed_scaling_update: launch for states [%d, %d) of %d failed: %s: %s",
                     first, first + count, num_states, cudaGetErrorName(err),
                     cudaGetErrorString(err));
      return TEP_ERROR_CUDA;
    }
  }
  return TEP_SUCCESS;
}
