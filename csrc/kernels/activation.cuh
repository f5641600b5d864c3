// Device code of the bias + activation kernels (activation.cu: forward, activation_bwd.cu: backward).
// Internal: the public surface is csrc/include/te_parallel/activation.h.
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

template <typename T_, class Base_, bool kGated_, __nv_fp8_interpretation_t kFmt_>
struct Config {
  using T = T_;
  using Base = Base_;
  static constexpr bool kGated = kGated_;
  static constexpr __nv_fp8_interpretation_t kFmt = kFmt_;
};

inline bool valid_act(int act) { return act >= TEP_ACT_GELU && act <= TEP_ACT_SREGLU; }
inline bool gated(int act) { return act >= TEP_ACT_GEGLU && act <= TEP_ACT_SREGLU; }
inline bool valid_hp(int dtype) { return dtype == TEP_FLOAT32 || dtype == TEP_FLOAT16 || dtype == TEP_BFLOAT16; }
inline bool valid_fp8(int dtype) { return dtype == TEP_FLOAT8_E4M3 || dtype == TEP_FLOAT8_E5M2; }

template <typename T, class Base, bool kGated, class Fn>
tep_status by_fmt(int fp8_dtype, Fn& fn) {
  if (fp8_dtype == TEP_FLOAT8_E5M2) return fn(Config<T, Base, kGated, __NV_E5M2>{});
  return fn(Config<T, Base, kGated, __NV_E4M3>{});
}

template <typename T, class Fn>
tep_status by_act(int act, int fp8_dtype, Fn& fn) {
  switch (act) {
    case TEP_ACT_GELU: return by_fmt<T, Gelu, false>(fp8_dtype, fn);
    case TEP_ACT_RELU: return by_fmt<T, Relu, false>(fp8_dtype, fn);
    case TEP_ACT_SILU: return by_fmt<T, Silu, false>(fp8_dtype, fn);
    case TEP_ACT_QGELU: return by_fmt<T, QGelu, false>(fp8_dtype, fn);
    case TEP_ACT_SRELU: return by_fmt<T, SRelu, false>(fp8_dtype, fn);
    case TEP_ACT_GEGLU: return by_fmt<T, Gelu, true>(fp8_dtype, fn);
    case TEP_ACT_REGLU: return by_fmt<T, Relu, true>(fp8_dtype, fn);
    case TEP_ACT_SWIGLU: return by_fmt<T, Silu, true>(fp8_dtype, fn);
    case TEP_ACT_QGEGLU: return by_fmt<T, QGelu, true>(fp8_dtype, fn);
    default: return by_fmt<T, SRelu, true>(fp8_dtype, fn);  // TEP_ACT_SREGLU (validated by the caller)
  }
}

// Calls fn(Config<...>{}) for validated codes; fp8_dtype selects the FP8 format (E4M3 when unused).
template <class Fn>
tep_status dispatch(int act, int x_dtype, int fp8_dtype, Fn&& fn) {
  switch (x_dtype) {
    case TEP_FLOAT32: return by_act<float>(act, fp8_dtype, fn);
    case TEP_FLOAT16: return by_act<__half>(act, fp8_dtype, fn);
    default: return by_act<__nv_bfloat16>(act, fp8_dtype, fn);  // TEP_BFLOAT16
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

}  // namespace act
}  // namespace tep
