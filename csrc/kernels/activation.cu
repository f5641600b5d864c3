// Bias + activation forward: y = act(x + bias), optionally straight to FP8 with a transposed copy and
// the amax, in one read of x (device code and dispatch: activation.cuh; tiles: fp8_tile.cuh).
#include "activation.cuh"

namespace tile = tep::tile;
namespace act = tep::act;

namespace tep {
namespace act {
template tep_status launch_fwd<__half>(int, const FwdParams&, dim3, cudaStream_t);
template tep_status launch_fwd<__nv_bfloat16>(int, const FwdParams&, dim3, cudaStream_t);
}  // namespace act
}  // namespace tep

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
  act::FwdParams p{};
  p.x = x;
  p.bias = bias;
  p.out = out;
  p.fp8 = fp8 == nullptr ? nullptr : static_cast<uint8_t*>(fp8->data);
  p.fp8_t = fp8 == nullptr ? nullptr : static_cast<uint8_t*>(fp8->data_t);
  p.scale = fp8 == nullptr ? nullptr : fp8->scale;
  p.amax = fp8 == nullptr ? nullptr : fp8->amax;
  p.rows = rows;
  p.n = act::gated(a) ? cols / 2 : cols;
  p.e5m2 = fp8 != nullptr && fp8->dtype == TEP_FLOAT8_E5M2;
  // 16-byte accesses need every row (and the gate half) to start 16-byte aligned: n % 8 == 0.
  const bool n8 = p.n % tile::kSub == 0;
  p.vec_in = n8 && tile::aligned(x, 16) && (bias == nullptr || tile::aligned(bias, 16));
  p.vec_out = n8 && (out == nullptr || tile::aligned(out, 16));
  p.vec_fp8 = n8 && (p.fp8 == nullptr || tile::aligned(p.fp8, 8));
  p.vec_fp8_t = rows % tile::kSub == 0 && (p.fp8_t == nullptr || tile::aligned(p.fp8_t, 8));
  const dim3 grid(static_cast<unsigned>((p.n + tile::kBlockCols - 1) / tile::kBlockCols), tile::grid_y(rows));
  auto s = static_cast<cudaStream_t>(stream);
  switch (x_dtype) {
    case TEP_FLOAT32: return act::launch_fwd<float>(a, p, grid, s);
    case TEP_FLOAT16: return act::launch_fwd<__half>(a, p, grid, s);
    default: return act::launch_fwd<__nv_bfloat16>(a, p, grid, s);
  }
}

extern "C" long long tep_dbias_dactivation_workspace_size(long long rows, long long cols) {
  return tile::colsum_workspace_bytes(rows, cols);
}
