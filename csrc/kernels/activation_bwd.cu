// Bias + activation backward: dx = dy * act'(x + bias) fused with dbias (column sums of dx) and the FP8
// cast + transpose + amax of dx, in one read of dy and x. This is what feeds fc1's FP8 dgrad (dx) and
// wgrad (dx transposed) GEMMs. dbias is deterministic: the main kernel writes one fp32 partial sum per
// (64-row tile, column) into the workspace, a second small kernel adds the partials of each column in
// a fixed order.
#include "activation_bwd.cuh"

namespace tile = tep::tile;
namespace act = tep::act;

namespace tep {
namespace act {
template tep_status launch_bwd<__half>(int, const BwdParams&, dim3, cudaStream_t);
template tep_status launch_bwd<__nv_bfloat16>(int, const BwdParams&, dim3, cudaStream_t);
}  // namespace act
}  // namespace tep

namespace {

tep_status finalize(const float* ws, long long rows, long long cols, void* dbias, int dbias_dtype, cudaStream_t s) {
  tile::launch_colsum_finalize(ws, rows, cols, dbias, dbias_dtype, s);
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
  act::BwdParams p{};
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
  p.e5m2 = fp8 != nullptr && fp8->dtype == TEP_FLOAT8_E5M2;
  const bool n8 = p.n % tile::kSub == 0;
  p.vec_in = n8 && tile::aligned(dy, 16) && tile::aligned(x, 16) && (bias == nullptr || tile::aligned(bias, 16));
  p.vec_out = n8 && (dx == nullptr || tile::aligned(dx, 16));
  p.vec_fp8 = n8 && (p.fp8 == nullptr || tile::aligned(p.fp8, 8));
  p.vec_fp8_t = rows % tile::kSub == 0 && (p.fp8_t == nullptr || tile::aligned(p.fp8_t, 8));
  const dim3 grid(static_cast<unsigned>((p.n + tile::kBlockCols - 1) / tile::kBlockCols), tile::grid_y(rows));
  auto s = static_cast<cudaStream_t>(stream);
  tep_status status;
  switch (x_dtype) {
    case TEP_FLOAT32: status = act::launch_bwd<float>(a, p, grid, s); break;
    case TEP_FLOAT16: status = act::launch_bwd<__half>(a, p, grid, s); break;
    default: status = act::launch_bwd<__nv_bfloat16>(a, p, grid, s); break;
  }
  if (status != TEP_SUCCESS || dbias == nullptr) return status;
  return finalize(p.ws, rows, cols, dbias, dbias_dtype, s);
}
