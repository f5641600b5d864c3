// Device code of the bias + activation kernels. Internal: the public surface is
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

// ------------------------------------------------------------------------------------------------
// Backward kernel

struct BwdParams {
  const void* dy;    // [rows, n]
  const void* x;     // [rows, ld_x], ld_x = 2n if gated else n
  const void* bias;  // [ld_x] or NULL
  void* dx;          // [rows, ld_x] or NULL
  uint8_t* fp8;      // [rows, ld_x] or NULL
  uint8_t* fp8_t;    // [ld_x, rows] or NULL
  const float* scale;
  float* amax;
  float* ws;  // [row tiles, ld_x] partial column sums, or NULL (no dbias)
  int64_t rows, n;
  bool e5m2;  // FP8 format: E5M2, else E4M3
  bool vec_in, vec_out, vec_fp8, vec_fp8_t;
};

// Writes the rounded dx sub-tile v of the column segment starting at col_off (0, or n for the gate
// half of a gated activation) to dx and the FP8 outputs.
template <class C>
__device__ __forceinline__ void emit_full(const BwdParams& p, const float (&v)[tile::kSub][tile::kSub], int64_t r0,
                                          int64_t c0, int64_t col_off, float scale) {
  using T = typename C::T;
  const int64_t ld_x = C::kGated ? 2 * p.n : p.n;
  if (p.dx != nullptr) tile::store_rows(static_cast<T*>(p.dx) + col_off, ld_x, r0, c0, p.vec_out, v);
  if (p.fp8 != nullptr || p.fp8_t != nullptr) {
    uint32_t w[tile::kSub][2];
    tile::pack_fp8(v, scale, p.e5m2, w);
    tile::store_fp8_full(w, p.fp8 == nullptr ? nullptr : p.fp8 + col_off,
                         p.fp8_t == nullptr ? nullptr : p.fp8_t + col_off * p.rows, p.rows, ld_x, r0, c0, p.vec_fp8,
                         p.vec_fp8_t);
  }
}

// One row of 8 rounded dx values v[0] (row r, columns c0.., offset col_off as in emit_full) to dx and the
// FP8 rows (no transposed copy), with emit_full's conversions; aligned layout (16-byte dx, 8-byte FP8).
template <class C>
__device__ __forceinline__ void emit_row(const BwdParams& p, const float (&v)[1][tile::kSub], int64_t r, int64_t c0,
                                         int64_t col_off, float scale) {
  using T = typename C::T;
  const int64_t ld_x = C::kGated ? 2 * p.n : p.n;
  const float* w = v[0];
  if (p.dx != nullptr) {
    T* out = static_cast<T*>(p.dx) + col_off + r * ld_x + c0;
    if constexpr (sizeof(T) == 2) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < tile::kSub; ++k) e[k] = tile::from_float<T>(w[k]);
      *reinterpret_cast<uint4*>(out) = raw;
    } else {
      reinterpret_cast<float4*>(out)[0] = make_float4(w[0], w[1], w[2], w[3]);
      reinterpret_cast<float4*>(out)[1] = make_float4(w[4], w[5], w[6], w[7]);
    }
  }
  if (p.fp8 != nullptr) {
    uint32_t lo, hi;
    if (p.e5m2) {
      lo = tile::fp8x4<__NV_E5M2>(w[0] * scale, w[1] * scale, w[2] * scale, w[3] * scale);
      hi = tile::fp8x4<__NV_E5M2>(w[4] * scale, w[5] * scale, w[6] * scale, w[7] * scale);
    } else {
      lo = tile::fp8x4<__NV_E4M3>(w[0] * scale, w[1] * scale, w[2] * scale, w[3] * scale);
      hi = tile::fp8x4<__NV_E4M3>(w[4] * scale, w[5] * scale, w[6] * scale, w[7] * scale);
    }
    *reinterpret_cast<uint2*>(p.fp8 + col_off + r * ld_x + c0) = make_uint2(lo, hi);
  }
}

// A full sub-tile of an aligned layout. sum_a / sum_b: column sums of the two halves' dx (sum_b
// unused unless gated). Returns the updated |dx| maximum.
template <class C>
__device__ __forceinline__ float bwd_full(const BwdParams& p, int64_t r0, int64_t c0, const float (&bias_a)[tile::kSub],
                                          const float (&bias_b)[tile::kSub], float scale, float m,
                                          float (&sum_a)[tile::kSub], float (&sum_b)[tile::kSub]) {
  using T = typename C::T;
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  const int64_t n = p.n, ld_x = C::kGated ? 2 * n : n;
  tile::Raw8<T> rd[tile::kSub], ra[tile::kSub];
  tile::load_rows(dy, n, r0, c0, rd);
  tile::load_rows(x, ld_x, r0, c0, ra);
  float v[tile::kSub][tile::kSub];
  if constexpr (C::kGated) {
    tile::Raw8<T> rb[tile::kSub];
    tile::load_rows(x + n, ld_x, r0, c0, rb);
    float u[tile::kSub][tile::kSub];
#pragma unroll
    for (int i = 0; i < tile::kSub; ++i) {
#pragma unroll
      for (int k = 0; k < tile::kSub; ++k) {
        float y, dydv;
        C::Base::template both<C::kAccurate>(ra[i][k] + bias_a[k], y, dydv);
        const float d = rd[i][k];
        v[i][k] = tile::round_to<T>(dydv * (rb[i][k] + bias_b[k]) * d);  // d/da
        u[i][k] = tile::round_to<T>(y * d);                               // d/db
      }
    }
    emit_full<C>(p, u, r0, c0, n, scale);
    tile::column_sums(u, sum_b);
    m = tile::abs_max(u, m);
  } else {
#pragma unroll
    for (int i = 0; i < tile::kSub; ++i) {
#pragma unroll
      for (int k = 0; k < tile::kSub; ++k) {
        float y, dydv;
        C::Base::template both<C::kAccurate>(ra[i][k] + bias_a[k], y, dydv);
        v[i][k] = tile::round_to<T>(dydv * static_cast<float>(rd[i][k]));
      }
    }
  }
  emit_full<C>(p, v, r0, c0, 0, scale);
  tile::column_sums(v, sum_a);
  return tile::abs_max(v, m);
}

template <class C>
__device__ __forceinline__ void emit_one(const BwdParams& p, int64_t r, int64_t col, float v, float scale) {
  using T = typename C::T;
  const int64_t ld_x = C::kGated ? 2 * p.n : p.n;
  if (p.dx != nullptr) static_cast<T*>(p.dx)[r * ld_x + col] = tile::from_float<T>(v);
  if (p.fp8 != nullptr || p.fp8_t != nullptr) {
    const uint8_t q = tile::fp8_byte(v * scale, p.e5m2);
    if (p.fp8 != nullptr) p.fp8[r * ld_x + col] = q;
    if (p.fp8_t != nullptr) p.fp8_t[col * p.rows + r] = q;
  }
}

// An edge sub-tile, or an unaligned layout: one element at a time with the arithmetic of bwd_full;
// columns unrolled so that the column sums stay in registers, rows rolled.
template <class C>
__device__ __forceinline__ float bwd_partial(const BwdParams& p, int64_t r0, int64_t c0, float scale, float m,
                                             float (&sum_a)[tile::kSub], float (&sum_b)[tile::kSub]) {
  using T = typename C::T;
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t rows = p.rows, n = p.n, ld_x = C::kGated ? 2 * n : n;
#pragma unroll
  for (int k = 0; k < tile::kSub; ++k) {
    sum_a[k] = 0.f;
    sum_b[k] = 0.f;
    const int64_t c = c0 + k;
    if (c >= n) continue;
    const float ba = bias == nullptr ? 0.f : tile::to_float(bias[c]);
    const float bb = (C::kGated && bias != nullptr) ? tile::to_float(bias[n + c]) : 0.f;
#pragma unroll 1
    for (int64_t r = r0; r < r0 + tile::kSub && r < rows; ++r) {
      float y, dydv;
      C::Base::template both<C::kAccurate>(tile::to_float(x[r * ld_x + c]) + ba, y, dydv);
      const float d = tile::to_float(dy[r * n + c]);
      if constexpr (C::kGated) {
        const float da = tile::round_to<T>(dydv * (tile::to_float(x[r * ld_x + n + c]) + bb) * d);
        const float db = tile::round_to<T>(y * d);
        emit_one<C>(p, r, c, da, scale);
        emit_one<C>(p, r, n + c, db, scale);
        sum_a[k] = __fadd_rn(sum_a[k], da);
        sum_b[k] = __fadd_rn(sum_b[k], db);
        m = tile::nan_max(tile::nan_max(m, fabsf(da)), fabsf(db));
      } else {
        const float da = tile::round_to<T>(dydv * d);
        emit_one<C>(p, r, c, da, scale);
        sum_a[k] = __fadd_rn(sum_a[k], da);
        m = tile::nan_max(m, fabsf(da));
      }
    }
  }
  return m;
}

// Non-gated with 2-byte inputs: at most 128 registers (4 blocks per SM), which ptxas meets without
// spills. Gated ones hold three input tiles and two outputs: capping them would spill, so they keep
// the default budget (2 blocks per SM, still 96 KB of loads in flight).
template <class C>
__global__ void __launch_bounds__(tile::kThreads, (sizeof(typename C::T) == 2 && !C::kGated) ? 4 : 1)
    dbias_dact_kernel(const BwdParams p) {
  using T = typename C::T;
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t rows = p.rows, n = p.n, ld_x = C::kGated ? 2 * n : n;
  const float scale = (p.fp8 != nullptr || p.fp8_t != nullptr) ? *p.scale : 1.f;
  const int64_t c0 = tile::thread_pos(0).c0;
  float bias_a[tile::kSub], bias_b[tile::kSub];
  tile::load_vec(bias, c0, n, p.vec_in, bias_a);
  tile::load_vec(C::kGated && bias != nullptr ? bias + n : nullptr, c0, n, p.vec_in, bias_b);
  const int64_t row_tiles = (rows + tile::kBlockRows - 1) / tile::kBlockRows;
  const int64_t col_base = static_cast<int64_t>(blockIdx.x) * tile::kBlockCols;
  float local_max = 0.f;
  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int64_t r0 = tile::thread_pos(rt).r0;
    float sum_a[tile::kSub], sum_b[tile::kSub];
    if (p.vec_in && tile::full_tile(rows, r0, c0, n)) {
      local_max = bwd_full<C>(p, r0, c0, bias_a, bias_b, scale, local_max, sum_a, sum_b);
    } else {
      local_max = bwd_partial<C>(p, r0, c0, scale, local_max, sum_a, sum_b);
    }
    if (p.ws != nullptr) {
      tile::block_colsum(sum_a, p.ws + rt * ld_x, col_base, n);
      if constexpr (C::kGated) tile::block_colsum(sum_b, p.ws + rt * ld_x + n, col_base, n);
    }
  }
  if (p.amax != nullptr) tile::block_amax_atomic(local_max, p.amax);
}

// The backward without a transposed copy and without dbias (what the MLP's row-chunked backward asks
// for: the FP8 gradient rows, or the high-precision ones), on an aligned layout: each thread takes 8
// columns of kRowsPerThread rows, loads them all, then computes and writes them row by row. The
// tiled kernel holds a whole 8x8 sub-tile of every operand and output to transpose it (246 registers
// for SwiGLU in bf16: 2 blocks per SM); here a 2-byte one needs at most 80 (6 blocks per SM, no spills on
// sm_90), so an SM holds 3x the warps and the loads of some overlap the arithmetic of others. Each
// element goes through bwd_full's instructions (the same rounding, FP8 bytes and amax).
constexpr int kRowsPerThread = 2;

template <class C>
__global__ void __launch_bounds__(tile::kThreads, sizeof(typename C::T) == 2 ? 6 : 1)
    dact_rows_kernel(const BwdParams p) {
  using T = typename C::T;
  constexpr int R = kRowsPerThread, S = tile::kSub;
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t rows = p.rows, n = p.n, ld_x = C::kGated ? 2 * n : n;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * tile::kThreads + threadIdx.x) * S;
  float m = 0.f;
  if (c0 < n) {  // (n % 8 == 0 on this path: a thread's 8 columns are all in or all out)
    const float scale = p.fp8 != nullptr ? *p.scale : 1.f;
    float bias_a[S], bias_b[S];
    tile::load_vec(bias, c0, n, true, bias_a);
    tile::load_vec(C::kGated && bias != nullptr ? bias + n : nullptr, c0, n, true, bias_b);
    for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * R; r0 < rows; r0 += static_cast<int64_t>(gridDim.y) * R) {
      tile::Raw8<T> rd[R], ra[R], rb[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (r0 + i < rows) {
          rd[i] = tile::load_raw(dy + (r0 + i) * n + c0);
          ra[i] = tile::load_raw(x + (r0 + i) * ld_x + c0);
          if constexpr (C::kGated) rb[i] = tile::load_raw(x + (r0 + i) * ld_x + n + c0);
        }
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (r0 + i >= rows) break;
        float v[1][S], u[1][S];
#pragma unroll
        for (int k = 0; k < S; ++k) {
          float y, dydv;
          C::Base::template both<C::kAccurate>(ra[i][k] + bias_a[k], y, dydv);
          const float d = rd[i][k];
          if constexpr (C::kGated) {
            v[0][k] = tile::round_to<T>(dydv * (rb[i][k] + bias_b[k]) * d);  // d/da
            u[0][k] = tile::round_to<T>(y * d);                               // d/db
          } else {
            v[0][k] = tile::round_to<T>(dydv * d);
          }
        }
        emit_row<C>(p, v, r0 + i, c0, 0, scale);
        if constexpr (C::kGated) emit_row<C>(p, u, r0 + i, c0, n, scale);
#pragma unroll
        for (int k = 0; k < S; ++k) {
          m = tile::nan_max(m, fabsf(v[0][k]));
          if constexpr (C::kGated) m = tile::nan_max(m, fabsf(u[0][k]));
        }
      }
    }
  }
  if (p.amax != nullptr) tile::block_amax_atomic(m, p.amax);
}

// True where dact_rows_kernel takes the call: no transposed copy, no dbias, 16-byte rows in and out.
inline bool rows_path(const BwdParams& p) {
  return p.fp8_t == nullptr && p.ws == nullptr && p.vec_in && p.vec_out && p.vec_fp8;
}

// Launches the backward kernel (instantiated in activation_bwd.cu / activation_bwd_fp32.cu): the row
// kernel where it applies, else the tiled one on `grid`.
template <typename T>
tep_status launch_bwd(int act, const BwdParams& p, dim3 grid, cudaStream_t s) {
  auto fn = [&](auto config) {
    if (rows_path(p)) {
      const int64_t col_blocks = (p.n / tile::kSub + tile::kThreads - 1) / tile::kThreads;
      const int64_t row_groups = (p.rows + kRowsPerThread - 1) / kRowsPerThread;
      const dim3 row_grid(static_cast<unsigned>(col_blocks),
                          static_cast<unsigned>(row_groups < tile::kMaxGridY ? row_groups : tile::kMaxGridY));
      dact_rows_kernel<decltype(config)><<<row_grid, tile::kThreads, 0, s>>>(p);
    } else {
      dbias_dact_kernel<decltype(config)><<<grid, tile::kThreads, 0, s>>>(p);
    }
    return launch_status("tep_dbias_dactivation", p.rows, p.n);
  };
  return by_act<T>(act, fn);
}

extern template tep_status launch_fwd<float>(int, const FwdParams&, dim3, cudaStream_t);
extern template tep_status launch_fwd<__half>(int, const FwdParams&, dim3, cudaStream_t);
extern template tep_status launch_fwd<__nv_bfloat16>(int, const FwdParams&, dim3, cudaStream_t);
extern template tep_status launch_bwd<float>(int, const BwdParams&, dim3, cudaStream_t);
extern template tep_status launch_bwd<__half>(int, const BwdParams&, dim3, cudaStream_t);
extern template tep_status launch_bwd<__nv_bfloat16>(int, const BwdParams&, dim3, cudaStream_t);

}  // namespace act
}  // namespace tep
