// Bias + activation forward: y = act(x + bias), optionally straight to FP8 with a transposed copy and
// the amax, in one read of x (device code and dispatch: activation.cuh; tiles: fp8_tile.cuh).
#include "activation.cuh"

namespace {

namespace tile = tep::tile;
namespace act = tep::act;

struct FwdParams {
  const void* x;     // [rows, ld_x], ld_x = 2n if gated else n
  const void* bias;  // [ld_x] or NULL
  void* out;         // [rows, n] or NULL
  uint8_t* fp8;      // [rows, n] or NULL
  uint8_t* fp8_t;    // [n, rows] or NULL
  const float* scale;
  float* amax;
  int64_t rows, n;
  bool vec_in, vec_out, vec_fp8, vec_fp8_t;
};

template <class C>
__global__ void __launch_bounds__(tile::kThreads) bias_act_fwd_kernel(const FwdParams p) {
  using T = typename C::T;
  constexpr bool kAccurate = sizeof(T) == 4;
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  const int64_t rows = p.rows, n = p.n, ld_x = C::kGated ? 2 * n : n;
  const bool want_fp8 = p.fp8 != nullptr || p.fp8_t != nullptr;
  const float scale = want_fp8 ? *p.scale : 1.f;
  const int64_t c0 = tile::thread_pos(0).c0;  // the columns do not change with the row tile
  float bias_a[tile::kSub], bias_b[tile::kSub];
  tile::load_vec(bias, c0, n, p.vec_in, bias_a);
  if constexpr (C::kGated) tile::load_vec(bias == nullptr ? nullptr : bias + n, c0, n, p.vec_in, bias_b);
  const int64_t row_tiles = (rows + tile::kBlockRows - 1) / tile::kBlockRows;
  float local_max = 0.f;
  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int64_t r0 = tile::thread_pos(rt).r0;
    float v[tile::kSub][tile::kSub];
    tile::load_tile(x, rows, ld_x, r0, c0, n, p.vec_in, v);
    if constexpr (C::kGated) {
      float g[tile::kSub][tile::kSub];
      tile::load_tile(x + n, rows, ld_x, r0, c0, n, p.vec_in, g);
#pragma unroll
      for (int i = 0; i < tile::kSub; ++i)
#pragma unroll
        for (int k = 0; k < tile::kSub; ++k)
          v[i][k] = tile::round_to<T>(C::Base::template fwd<kAccurate>(v[i][k] + bias_a[k]) * (g[i][k] + bias_b[k]));
    } else {
#pragma unroll
      for (int i = 0; i < tile::kSub; ++i)
#pragma unroll
        for (int k = 0; k < tile::kSub; ++k) v[i][k] = tile::round_to<T>(C::Base::template fwd<kAccurate>(v[i][k] + bias_a[k]));
    }
    tile::zero_outside(v, rows, r0, c0, n);
    if (p.out != nullptr) tile::store_tile(static_cast<T*>(p.out), rows, n, r0, c0, n, p.vec_out, v);
    if (want_fp8) tile::store_fp8_tile<C::kFmt>(v, scale, p.fp8, p.fp8_t, rows, n, r0, c0, n, p.vec_fp8, p.vec_fp8_t);
    local_max = tile::abs_max(v, local_max);
  }
  if (p.amax != nullptr) tile::block_amax_atomic(local_max, p.amax);
}

}  // namespace

extern "C" int tep_activation_is_gated(int a) { return act::valid_act(a) ? (act::gated(a) ? 1 : 0) : -1; }

extern "C" tep_status tep_bias_activation_fwd(int a, const void* x, const void* bias, int x_dtype, long long rows,
                                              long long cols, void* out, const tep_fp8_output* fp8, void* stream) {
  constexpr const char* kWhere = "tep_bias_activation_fwd";
  if (!act::check_common(kWhere, a, x_dtype, rows, cols, fp8)) return TEP_ERROR_INVALID_ARGUMENT;
  const bool want_fp8 = fp8 != nullptr && (fp8->data != nullptr || fp8->data_t != nullptr);
  const bool want_amax = fp8 != nullptr && fp8->amax != nullptr;
  if (x == nullptr || (out == nullptr && !want_fp8 && !want_amax)) {
    tep::set_error("%s: x is NULL or no output was asked for; need x and at least one of out, fp8", kWhere);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  FwdParams p{};
  p.x = x;
  p.bias = bias;
  p.out = out;
  p.fp8 = fp8 == nullptr ? nullptr : static_cast<uint8_t*>(fp8->data);
  p.fp8_t = fp8 == nullptr ? nullptr : static_cast<uint8_t*>(fp8->data_t);
  p.scale = fp8 == nullptr ? nullptr : fp8->scale;
  p.amax = fp8 == nullptr ? nullptr : fp8->amax;
  p.rows = rows;
  p.n = act::gated(a) ? cols / 2 : cols;
  // 16-byte accesses need every row (and the gate half) to start 16-byte aligned: n % 8 == 0.
  const bool n8 = p.n % tile::kSub == 0;
  p.vec_in = n8 && tile::aligned(x, 16) && (bias == nullptr || tile::aligned(bias, 16));
  p.vec_out = n8 && (out == nullptr || tile::aligned(out, 16));
  p.vec_fp8 = n8 && (p.fp8 == nullptr || tile::aligned(p.fp8, 8));
  p.vec_fp8_t = rows % tile::kSub == 0 && (p.fp8_t == nullptr || tile::aligned(p.fp8_t, 8));
  const dim3 grid(static_cast<unsigned>((p.n + tile::kBlockCols - 1) / tile::kBlockCols), tile::grid_y(rows));
  auto s = static_cast<cudaStream_t>(stream);
  return act::dispatch(a, x_dtype, fp8 == nullptr ? TEP_FLOAT8_E4M3 : fp8->dtype, [&](auto config) {
    bias_act_fwd_kernel<decltype(config)><<<grid, tile::kThreads, 0, s>>>(p);
    return act::launch_status(kWhere, rows, cols);
  });
}

extern "C" long long tep_dbias_dactivation_workspace_size(long long rows, long long cols) {
  if (rows < 1 || cols < 1) return 0;
  return (rows + tile::kBlockRows - 1) / tile::kBlockRows * cols * static_cast<long long>(sizeof(float));
}
