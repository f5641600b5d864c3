// Device code of the bias + activation backward: the tiled kernel (dact + dbias + FP8 cast-transpose +
// amax) and the row kernel for calls without a transposed copy or dbias. Internal (activation.cuh has
// the activations and the dispatch); instantiated in activation_bwd.cu (fp16, bf16) and
// activation_bwd_fp32.cu (fp32).
#pragma once

#include "activation.cuh"

namespace tep {
namespace act {

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

// One row of 8 rounded dx values v (row r, columns c0.., offset col_off as in emit_full) to dx and the
// FP8 rows (no transposed copy), with emit_full's conversions; aligned layout (16-byte dx, 8-byte FP8).
template <class C>
__device__ __forceinline__ void emit_row(const BwdParams& p, const float (&v)[tile::kSub], int64_t r, int64_t c0,
                                         int64_t col_off, float scale) {
  using T = typename C::T;
  const int64_t at = col_off + r * (C::kGated ? 2 * p.n : p.n) + c0;
  if (p.dx != nullptr) tile::store_row(static_cast<T*>(p.dx) + at, v, true);
  if (p.fp8 != nullptr) {
    uint32_t w[2];
    tile::pack_fp8_row(v, scale, p.e5m2, w);
    *reinterpret_cast<uint2*>(p.fp8 + at) = make_uint2(w[0], w[1]);
  }
}

// One element's gradients from a (+ bias) and, gated, b (+ bias), the gate's input, and dy = d, rounded
// to T: v = d/da, u = d/db (gated only). The tiled and the row kernels share it, so their bytes agree.
template <class C>
__device__ __forceinline__ void dact_at(float a, float b, float d, float& v, float& u) {
  using T = typename C::T;
  float y, dydv;
  C::Base::template both<C::kAccurate>(a, y, dydv);
  if constexpr (C::kGated) {
    v = tile::round_to<T>(dydv * b * d);
    u = tile::round_to<T>(y * d);
  } else {
    v = tile::round_to<T>(dydv * d);
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
    for (int i = 0; i < tile::kSub; ++i)
#pragma unroll
      for (int k = 0; k < tile::kSub; ++k) dact_at<C>(ra[i][k] + bias_a[k], rb[i][k] + bias_b[k], rd[i][k], v[i][k], u[i][k]);
    emit_full<C>(p, u, r0, c0, n, scale);
    tile::column_sums(u, sum_b);
    m = tile::abs_max(u, m);
  } else {
    float unused;
#pragma unroll
    for (int i = 0; i < tile::kSub; ++i)
#pragma unroll
      for (int k = 0; k < tile::kSub; ++k) dact_at<C>(ra[i][k] + bias_a[k], 0.f, rd[i][k], v[i][k], unused);
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
// element goes through bwd_full's dact_at (the same rounding, FP8 bytes and amax).
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
        float v[S], u[S];
#pragma unroll
        for (int k = 0; k < S; ++k)
          dact_at<C>(ra[i][k] + bias_a[k], C::kGated ? rb[i][k] + bias_b[k] : 0.f, rd[i][k], v[k], u[k]);
        emit_row<C>(p, v, r0 + i, c0, 0, scale);
        if constexpr (C::kGated) emit_row<C>(p, u, r0 + i, c0, n, scale);
#pragma unroll
        for (int k = 0; k < S; ++k) {
          m = tile::nan_max(m, fabsf(v[k]));
          if constexpr (C::kGated) m = tile::nan_max(m, fabsf(u[k]));
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

extern template tep_status launch_bwd<float>(int, const BwdParams&, dim3, cudaStream_t);
extern template tep_status launch_bwd<__half>(int, const BwdParams&, dim3, cudaStream_t);
extern template tep_status launch_bwd<__nv_bfloat16>(int, const BwdParams&, dim3, cudaStream_t);

}  // namespace act
}  // namespace tep
