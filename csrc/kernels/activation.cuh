// Device code of the bias + activation kernels: the activations, the dispatch and the forward kernel
// (the backward's: activation_bwd.cuh). Internal: the public surface is
// csrc/include/te_parallel/activation.h. The C entry points live in activation.cu (forward) and
// activation_bwd.cu (backward); the kernels are instantiated per dtype in those files (fp16, bf16) and
// in activation_fp32.cu / activation_bwd_fp32.cu (fp32), so a parallel build compiles them side by side.
//
// Both kernels walk the "iteration" matrix [rows, n] (n = columns of the output in forward, of dy in
// backward; n = F for gated activations, whose x has 2F columns) in the tiles of fp8_tile.cuh: each
// thread owns an 8x8 sub-tile, loads x (and the gate half, and dy) with 16-byte loads, computes in
// fp32, rounds once to the tensor dtype, and from that rounded value writes the high-precision output,
// the FP8 bytes and their transpose, the amax and (backward) the per-block column sums for dbias.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common.h"
#include "fp8_tile.cuh"
#include "te_parallel/activation.h"

namespace tep {
namespace act {

// Logistic sigmoid. 16-bit tensors use the MUFU intrinsics (relative error ~1e-6, far below their
// rounding); fp32 tensors use the accurate expf and an IEEE division, to stay within torch's fp32
// error. For z -> -inf, exp(-z) -> inf and the result is 0 (never NaN).
template <bool kAccurate>
__device__ __forceinline__ float sigmoid(float z) {
  if constexpr (kAccurate) {
    return 1.f / (1.f + expf(-z));
  } else {
    return __fdividef(1.f, 1.f + __expf(-z));
  }
}

// Each activation: fwd(v) = act(v); both(v, y, d): y = act(v), d = act'(v).

// tanh-approximated GELU written as v * sigmoid(2u), u = sqrt(2/pi) (v + 0.044715 v^3), since
// 0.5 (1 + tanh(u)) = sigmoid(2u); this avoids the cancellation in 1 + tanh(u) for v << 0.
// act'(v) = s + v s (1 - s) * 2 sqrt(2/pi) (1 + 3 * 0.044715 v^2), s = sigmoid(2u).
struct Gelu {
  static constexpr float kK2 = 1.5957691216057308f;  // 2 sqrt(2/pi)
  static constexpr float kC = 0.044715f;
  template <bool kAccurate>
  __device__ static __forceinline__ float fwd(float v) {
    return v * sigmoid<kAccurate>(kK2 * v * (1.f + kC * v * v));
  }
  template <bool kAccurate>
  __device__ static __forceinline__ void both(float v, float& y, float& d) {
    const float v2 = v * v;
    const float s = sigmoid<kAccurate>(kK2 * v * (1.f + kC * v2));
    y = v * s;
    d = s + y * (1.f - s) * kK2 * (1.f + 3.f * kC * v2);
  }
};

// relu(v) = v for v > 0, 0 otherwise; a NaN stays NaN (as torch.relu). relu'(v) = [v > 0].
struct Relu {
  template <bool kAccurate>
  __device__ static __forceinline__ float fwd(float v) {
    return v <= 0.f ? 0.f : v;
  }
  template <bool kAccurate>
  __device__ static __forceinline__ void both(float v, float& y, float& d) {
    y = v <= 0.f ? 0.f : v;
    d = v > 0.f ? 1.f : 0.f;
  }
};

// silu(v) = v s, s = sigmoid(v); silu'(v) = s (1 + v (1 - s)).
struct Silu {
  template <bool kAccurate>
  __device__ static __forceinline__ float fwd(float v) {
    return v * sigmoid<kAccurate>(v);
  }
  template <bool kAccurate>
  __device__ static __forceinline__ void both(float v, float& y, float& d) {
    const float s = sigmoid<kAccurate>(v);
    y = v * s;
    d = s * (1.f + v * (1.f - s));
  }
};

// qgelu(v) = v s, s = sigmoid(1.702 v); qgelu'(v) = s (1 + 1.702 v (1 - s)).
struct QGelu {
  static constexpr float kA = 1.702f;
  template <bool kAccurate>
  __device__ static __forceinline__ float fwd(float v) {
    return v * sigmoid<kAccurate>(kA * v);
  }
  template <bool kAccurate>
  __device__ static __forceinline__ void both(float v, float& y, float& d) {
    const float s = sigmoid<kAccurate>(kA * v);
    y = v * s;
    d = s * (1.f + kA * v * (1.f - s));
  }
};

// srelu(v) = relu(v)^2; srelu'(v) = 2 relu(v).
struct SRelu {
  template <bool kAccurate>
  __device__ static __forceinline__ float fwd(float v) {
    const float r = v <= 0.f ? 0.f : v;
    return r * r;
  }
  template <bool kAccurate>
  __device__ static __forceinline__ void both(float v, float& y, float& d) {
    const float r = v <= 0.f ? 0.f : v;
    y = r * r;
    d = 2.f * r;
  }
};

// ------------------------------------------------------------------------------------------------
// Host-side dispatch: (act code, dtype code, fp8 code) -> one kernel instantiation.

template <typename T_, class Base_, bool kGated_>
struct Config {
  using T = T_;
  using Base = Base_;
  static constexpr bool kGated = kGated_;
  static constexpr bool kAccurate = sizeof(T_) == 4;  // fp32 tensors: accurate expf (see sigmoid)
};

inline bool valid_act(int act) { return act >= TEP_ACT_GELU && act <= TEP_ACT_SREGLU; }
inline bool gated(int act) { return act >= TEP_ACT_GEGLU && act <= TEP_ACT_SREGLU; }
inline bool valid_hp(int dtype) { return dtype == TEP_FLOAT32 || dtype == TEP_FLOAT16 || dtype == TEP_BFLOAT16; }
inline bool valid_fp8(int dtype) { return dtype == TEP_FLOAT8_E4M3 || dtype == TEP_FLOAT8_E5M2; }

template <typename T, class Fn>
tep_status by_act(int act, Fn& fn) {
  switch (act) {
    case TEP_ACT_GELU: return fn(Config<T, Gelu, false>{});
    case TEP_ACT_RELU: return fn(Config<T, Relu, false>{});
    case TEP_ACT_SILU: return fn(Config<T, Silu, false>{});
    case TEP_ACT_QGELU: return fn(Config<T, QGelu, false>{});
    case TEP_ACT_SRELU: return fn(Config<T, SRelu, false>{});
    case TEP_ACT_GEGLU: return fn(Config<T, Gelu, true>{});
    case TEP_ACT_REGLU: return fn(Config<T, Relu, true>{});
    case TEP_ACT_SWIGLU: return fn(Config<T, Silu, true>{});
    case TEP_ACT_QGEGLU: return fn(Config<T, QGelu, true>{});
    default: return fn(Config<T, SRelu, true>{});  // TEP_ACT_SREGLU (validated by the caller)
  }
}

inline tep_status launch_status(const char* where, long long rows, long long cols) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    tep::set_error("%s: launch of [%lld, %lld] failed: %s", where, rows, cols, cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}

// Checks shared by forward and backward; on failure records the message and returns false.
inline bool check_common(const char* where, int act, int x_dtype, long long rows, long long cols,
                         const tep_fp8_output* fp8) {
  if (!valid_act(act)) {
    tep::set_error("%s: act = %d; need a tep_activation code 0..9", where, act);
    return false;
  }
  if (!valid_hp(x_dtype)) {
    tep::set_error("%s: x_dtype = %d; need TEP_FLOAT32 (0), TEP_FLOAT16 (1) or TEP_BFLOAT16 (2)", where, x_dtype);
    return false;
  }
  const long long n = gated(act) ? cols / 2 : cols;
  if (rows < 1 || cols < 1 || (gated(act) && cols % 2 != 0) ||
      (n + tile::kBlockCols - 1) / tile::kBlockCols > 0x7fffffffLL) {
    tep::set_error("%s: rows = %lld, cols = %lld; need rows, cols >= 1%s and cols < 2^38", where, rows, cols,
                   gated(act) ? ", cols even for a gated activation" : "");
    return false;
  }
  if (fp8 != nullptr) {
    if (!valid_fp8(fp8->dtype)) {
      tep::set_error("%s: fp8->dtype = %d; need TEP_FLOAT8_E4M3 (3) or TEP_FLOAT8_E5M2 (4)", where, fp8->dtype);
      return false;
    }
    if ((fp8->data != nullptr || fp8->data_t != nullptr) && fp8->scale == nullptr) {
      tep::set_error("%s: fp8->scale is NULL; an FP8 output (data or data_t) needs the fp32 scale", where);
      return false;
    }
  }
  return true;
}

// ------------------------------------------------------------------------------------------------
// Forward kernel

struct FwdParams {
  const void* x;     // [rows, ld_x], ld_x = 2n if gated else n
  const void* bias;  // [ld_x] or NULL
  void* out;         // [rows, n] or NULL
  uint8_t* fp8;      // [rows, n] or NULL
  uint8_t* fp8_t;    // [n, rows] or NULL
  const float* scale;
  float* amax;
  int64_t rows, n;
  bool e5m2;  // FP8 format: E5M2, else E4M3
  bool vec_in, vec_out, vec_fp8, vec_fp8_t;
};

// A full sub-tile of an aligned layout: 16-byte loads, unrolled.
template <class C>
__device__ __forceinline__ float fwd_full(const FwdParams& p, int64_t r0, int64_t c0, const float (&bias_a)[tile::kSub],
                                          const float (&bias_b)[tile::kSub], float scale, float m) {
  using T = typename C::T;
  const T* x = static_cast<const T*>(p.x);
  const int64_t n = p.n, ld_x = C::kGated ? 2 * n : n;
  tile::Raw8<T> ra[tile::kSub];
  tile::load_rows(x, ld_x, r0, c0, ra);
  float v[tile::kSub][tile::kSub];
  if constexpr (C::kGated) {
    tile::Raw8<T> rb[tile::kSub];
    tile::load_rows(x + n, ld_x, r0, c0, rb);
#pragma unroll
    for (int i = 0; i < tile::kSub; ++i)
#pragma unroll
      for (int k = 0; k < tile::kSub; ++k)
        v[i][k] = tile::round_to<T>(C::Base::template fwd<C::kAccurate>(ra[i][k] + bias_a[k]) * (rb[i][k] + bias_b[k]));
  } else {
#pragma unroll
    for (int i = 0; i < tile::kSub; ++i)
#pragma unroll
      for (int k = 0; k < tile::kSub; ++k)
        v[i][k] = tile::round_to<T>(C::Base::template fwd<C::kAccurate>(ra[i][k] + bias_a[k]));
  }
  if (p.out != nullptr) tile::store_rows(static_cast<T*>(p.out), n, r0, c0, p.vec_out, v);
  if (p.fp8 != nullptr || p.fp8_t != nullptr) {
    uint32_t w[tile::kSub][2];
    tile::pack_fp8(v, scale, p.e5m2, w);
    tile::store_fp8_full(w, p.fp8, p.fp8_t, p.rows, n, r0, c0, p.vec_fp8, p.vec_fp8_t);
  }
  return tile::abs_max(v, m);
}

// An edge sub-tile, or an unaligned layout: one element at a time, the same arithmetic.
template <class C>
__device__ __forceinline__ float fwd_partial(const FwdParams& p, int64_t r0, int64_t c0, float scale, float m) {
  using T = typename C::T;
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  const int64_t rows = p.rows, n = p.n, ld_x = C::kGated ? 2 * n : n;
#pragma unroll 1
  for (int64_t r = r0; r < r0 + tile::kSub && r < rows; ++r) {
#pragma unroll 1
    for (int64_t c = c0; c < c0 + tile::kSub && c < n; ++c) {
      float y = C::Base::template fwd<C::kAccurate>(tile::to_float(x[r * ld_x + c]) +
                                                    (bias == nullptr ? 0.f : tile::to_float(bias[c])));
      if constexpr (C::kGated) {
        y = y * (tile::to_float(x[r * ld_x + n + c]) + (bias == nullptr ? 0.f : tile::to_float(bias[n + c])));
      }
      y = tile::round_to<T>(y);
      if (out != nullptr) out[r * n + c] = tile::from_float<T>(y);
      if (p.fp8 != nullptr || p.fp8_t != nullptr) {
        const uint8_t q = tile::fp8_byte(y * scale, p.e5m2);
        if (p.fp8 != nullptr) p.fp8[r * n + c] = q;
        if (p.fp8_t != nullptr) p.fp8_t[c * rows + r] = q;
      }
      m = tile::nan_max(m, fabsf(y));
    }
  }
  return m;
}

// 2-byte inputs: at most 128 registers (4 blocks of 128 threads per SM, 64 KB of loads in flight);
// ptxas needs no spills for that. fp32 (tests, not the bandwidth path) keeps its default budget.
template <class C>
__global__ void __launch_bounds__(tile::kThreads, sizeof(typename C::T) == 2 ? 4 : 1)
    bias_act_fwd_kernel(const FwdParams p) {
  using T = typename C::T;
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t rows = p.rows, n = p.n;
  const float scale = (p.fp8 != nullptr || p.fp8_t != nullptr) ? *p.scale : 1.f;
  const int64_t c0 = tile::thread_pos(0).c0;  // the columns do not change with the row tile
  float bias_a[tile::kSub], bias_b[tile::kSub];
  tile::load_vec(bias, c0, n, p.vec_in, bias_a);
  tile::load_vec(C::kGated && bias != nullptr ? bias + n : nullptr, c0, n, p.vec_in, bias_b);
  const int64_t row_tiles = (rows + tile::kBlockRows - 1) / tile::kBlockRows;
  float local_max = 0.f;
  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int64_t r0 = tile::thread_pos(rt).r0;
    if (p.vec_in && tile::full_tile(rows, r0, c0, n)) {
      local_max = fwd_full<C>(p, r0, c0, bias_a, bias_b, scale, local_max);
    } else {
      local_max = fwd_partial<C>(p, r0, c0, scale, local_max);
    }
  }
  if (p.amax != nullptr) tile::block_amax_atomic(local_max, p.amax);
}

// Launches the forward kernel of activation `act` for tensors of type T (explicitly instantiated in
// activation.cu for the 2-byte types and in activation_fp32.cu for fp32, so that they compile apart).
template <typename T>
tep_status launch_fwd(int act, const FwdParams& p, dim3 grid, cudaStream_t s) {
  auto fn = [&](auto config) {
    bias_act_fwd_kernel<decltype(config)><<<grid, tile::kThreads, 0, s>>>(p);
    return launch_status("tep_bias_activation_fwd", p.rows, p.n);
  };
  return by_act<T>(act, fn);
}

extern template tep_status launch_fwd<float>(int, const FwdParams&, dim3, cudaStream_t);
extern template tep_status launch_fwd<__half>(int, const FwdParams&, dim3, cudaStream_t);
extern template tep_status launch_fwd<__nv_bfloat16>(int, const FwdParams&, dim3, cudaStream_t);

}  // namespace act
}  // namespace tep
