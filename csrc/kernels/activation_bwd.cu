// Bias + activation backward: dx = dy * act'(x + bias) fused with dbias (column sums of dx) and the FP8
// cast + transpose + amax of dx, in one read of dy and x. This is what feeds fc1's FP8 dgrad (dx) and
// wgrad (dx transposed) GEMMs. dbias is deterministic: the main kernel writes one fp32 partial sum per
// (64-row tile, column) into the workspace, a second small kernel adds the partials of each column in
// a fixed order.
#include "activation.cuh"

namespace {

namespace tile = tep::tile;
namespace act = tep::act;

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
  bool vec_in, vec_out, vec_fp8, vec_fp8_t;
};

// Writes the rounded dx sub-tile `v` of the column segment starting at `col_off` (0, or n for the
// gate half of a gated activation) to every requested output; returns the updated |dx| maximum.
template <class C>
__device__ __forceinline__ float emit(const BwdParams& p, float (&v)[tile::kSub][tile::kSub], int64_t rt, int64_t r0,
                                      int64_t c0, int64_t col_off, float scale, float local_max) {
  using T = typename C::T;
  const int64_t rows = p.rows, n = p.n, ld_x = C::kGated ? 2 * n : n;
  tile::zero_outside(v, rows, r0, c0, n);
  if (p.dx != nullptr) tile::store_tile(static_cast<T*>(p.dx) + col_off, rows, ld_x, r0, c0, n, p.vec_out, v);
  if (p.fp8 != nullptr || p.fp8_t != nullptr) {
    tile::store_fp8_tile<C::kFmt>(v, scale, p.fp8 == nullptr ? nullptr : p.fp8 + col_off,
                                  p.fp8_t == nullptr ? nullptr : p.fp8_t + col_off * rows, rows, ld_x, r0, c0, n,
                                  p.vec_fp8, p.vec_fp8_t);
  }
  if (p.ws != nullptr) {
    tile::block_colsum(v, p.ws + rt * ld_x + col_off, static_cast<int64_t>(blockIdx.x) * tile::kBlockCols, n);
  }
  return tile::abs_max(v, local_max);
}

template <class C>
__global__ void __launch_bounds__(tile::kThreads) dbias_dact_kernel(const BwdParams p) {
  using T = typename C::T;
  constexpr bool kAccurate = sizeof(T) == 4;
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t rows = p.rows, n = p.n, ld_x = C::kGated ? 2 * n : n;
  const float scale = (p.fp8 != nullptr || p.fp8_t != nullptr) ? *p.scale : 1.f;
  const int64_t c0 = tile::thread_pos(0).c0;
  float bias_a[tile::kSub], bias_b[tile::kSub];
  tile::load_vec(bias, c0, n, p.vec_in, bias_a);
  if constexpr (C::kGated) tile::load_vec(bias == nullptr ? nullptr : bias + n, c0, n, p.vec_in, bias_b);
  const int64_t row_tiles = (rows + tile::kBlockRows - 1) / tile::kBlockRows;
  float local_max = 0.f;
  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int64_t r0 = tile::thread_pos(rt).r0;
    float d[tile::kSub][tile::kSub], a[tile::kSub][tile::kSub];
    tile::load_tile(dy, rows, n, r0, c0, n, p.vec_in, d);
    tile::load_tile(x, rows, ld_x, r0, c0, n, p.vec_in, a);
    if constexpr (C::kGated) {
      float b[tile::kSub][tile::kSub];
      tile::load_tile(x + n, rows, ld_x, r0, c0, n, p.vec_in, b);
#pragma unroll
      for (int i = 0; i < tile::kSub; ++i) {
#pragma unroll
        for (int k = 0; k < tile::kSub; ++k) {
          float y, dydv;
          C::Base::template both<kAccurate>(a[i][k] + bias_a[k], y, dydv);
          a[i][k] = tile::round_to<T>(dydv * (b[i][k] + bias_b[k]) * d[i][k]);  // d/da
          b[i][k] = tile::round_to<T>(y * d[i][k]);                             // d/db
        }
      }
      local_max = emit<C>(p, a, rt, r0, c0, 0, scale, local_max);
      local_max = emit<C>(p, b, rt, r0, c0, n, scale, local_max);
    } else {
#pragma unroll
      for (int i = 0; i < tile::kSub; ++i) {
#pragma unroll
        for (int k = 0; k < tile::kSub; ++k) {
          float y, dydv;
          C::Base::template both<kAccurate>(a[i][k] + bias_a[k], y, dydv);
          a[i][k] = tile::round_to<T>(dydv * d[i][k]);
        }
      }
      local_max = emit<C>(p, a, rt, r0, c0, 0, scale, local_max);
    }
  }
  if (p.amax != nullptr) tile::block_amax_atomic(local_max, p.amax);
}

// dbias[c] = sum over row tiles of ws[rt, c]: 32 columns x 8 row-tile strides per block, then the 8
// partials of a column in order. Deterministic.
template <typename TOut>
__global__ void __launch_bounds__(256) colsum_finalize_kernel(const float* __restrict__ ws, int64_t row_tiles,
                                                              int64_t cols, TOut* __restrict__ dbias) {
  __shared__ float part[8][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + tx;
  float s = 0.f;
  if (c < cols) {
    for (int64_t rt = ty; rt < row_tiles; rt += 8) s += ws[rt * cols + c];
  }
  part[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < cols) {
    float total = part[0][tx];
#pragma unroll
    for (int k = 1; k < 8; ++k) total += part[k][tx];
    dbias[c] = tile::from_float<TOut>(total);
  }
}

tep_status finalize(const float* ws, long long rows, long long cols, void* dbias, int dbias_dtype, cudaStream_t s) {
  const long long row_tiles = (rows + tile::kBlockRows - 1) / tile::kBlockRows;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32));
  switch (dbias_dtype) {
    case TEP_FLOAT32:
      colsum_finalize_kernel<<<grid, 256, 0, s>>>(ws, row_tiles, cols, static_cast<float*>(dbias));
      break;
    case TEP_FLOAT16:
      colsum_finalize_kernel<<<grid, 256, 0, s>>>(ws, row_tiles, cols, static_cast<__half*>(dbias));
      break;
    default:
      colsum_finalize_kernel<<<grid, 256, 0, s>>>(ws, row_tiles, cols, static_cast<__nv_bfloat16*>(dbias));
      break;
  }
  return act::launch_status("tep_dbias_dactivation (dbias)", rows, cols);
}

}  // namespace

extern "C" tep_status tep_dbias_dactivation(int a, const void* dy, const void* x, const void* bias, int x_dtype,
                                            long long rows, long long cols, void* dx, const tep_fp8_output* fp8,
                                            void* dbias, int dbias_dtype, void* workspace, long long workspace_bytes,
                                            void* stream) {
  constexpr const char* kWhere = "tep_dbias_dactivation";
  if (!act::check_common(kWhere, a, x_dtype, rows, cols, fp8)) return TEP_ERROR_INVALID_ARGUMENT;
  const bool want_fp8 = fp8 != nullptr && (fp8->data != nullptr || fp8->data_t != nullptr);
  const bool want_amax = fp8 != nullptr && fp8->amax != nullptr;
  if (dy == nullptr || x == nullptr || (dx == nullptr && !want_fp8 && !want_amax && dbias == nullptr)) {
    tep::set_error("%s: dy or x is NULL, or no output was asked for; need dy, x and at least one of dx, fp8, dbias",
                   kWhere);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (dbias != nullptr) {
    const long long need = tep_dbias_dactivation_workspace_size(rows, cols);
    if (!act::valid_hp(dbias_dtype) || workspace == nullptr || workspace_bytes < need ||
        !tile::aligned(workspace, 4)) {
      tep::set_error("%s: dbias_dtype = %d, workspace %p of %lld bytes; need a float dtype code (0, 1, 2) and a "
                     "4-byte aligned workspace of >= %lld bytes",
                     kWhere, dbias_dtype, workspace, workspace_bytes, need);
      return TEP_ERROR_INVALID_ARGUMENT;
    }
  }
  BwdParams p{};
  p.dy = dy;
  p.x = x;
  p.bias = bias;
  p.dx = dx;
  p.fp8 = fp8 == nullptr ? nullptr : static_cast<uint8_t*>(fp8->data);
  p.fp8_t = fp8 == nullptr ? nullptr : static_cast<uint8_t*>(fp8->data_t);
  p.scale = fp8 == nullptr ? nullptr : fp8->scale;
  p.amax = fp8 == nullptr ? nullptr : fp8->amax;
  p.ws = dbias == nullptr ? nullptr : static_cast<float*>(workspace);
  p.rows = rows;
  p.n = act::gated(a) ? cols / 2 : cols;
  const bool n8 = p.n % tile::kSub == 0;
  p.vec_in = n8 && tile::aligned(dy, 16) && tile::aligned(x, 16) && (bias == nullptr || tile::aligned(bias, 16));
  p.vec_out = n8 && (dx == nullptr || tile::aligned(dx, 16));
  p.vec_fp8 = n8 && (p.fp8 == nullptr || tile::aligned(p.fp8, 8));
  p.vec_fp8_t = rows % tile::kSub == 0 && (p.fp8_t == nullptr || tile::aligned(p.fp8_t, 8));
  const dim3 grid(static_cast<unsigned>((p.n + tile::kBlockCols - 1) / tile::kBlockCols), tile::grid_y(rows));
  auto s = static_cast<cudaStream_t>(stream);
  const tep_status status = act::dispatch(a, x_dtype, fp8 == nullptr ? TEP_FLOAT8_E4M3 : fp8->dtype, [&](auto config) {
    dbias_dact_kernel<decltype(config)><<<grid, tile::kThreads, 0, s>>>(p);
    return act::launch_status(kWhere, rows, cols);
  });
  if (status != TEP_SUCCESS || dbias == nullptr) return status;
  return finalize(p.ws, rows, cols, dbias, dbias_dtype, s);
}
