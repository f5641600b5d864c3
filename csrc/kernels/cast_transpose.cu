// FP8 cast with fused transpose and amax: one read of the source, two FP8 writes (the FP8 transposes come
// from the casts, never from a separate pass: docs/architecture.md).
//
// Blocks of 128 threads over 64x128 tiles; each thread converts an 8x8 sub-tile (8 16-byte loads of
// a 2-byte input in flight), writes its 8 rows with 8-byte stores, transposes the 8x8 FP8 bytes in
// registers and writes 8 columns of the transposed output with 8-byte stores (layout and why every
// sector is written whole: fp8_tile.cuh). No shared-memory staging. Partial sub-tiles and unaligned
// layouts take element-wise paths inside the same kernel that produce the same bytes. |x| maxima are
// reduced per warp, per block, then folded into amax[0] with one atomicMax per block on the float's
// bits (valid for values >= 0; a NaN has larger bits than +inf, so NaN wins, as in torch.amax).
// Row tiles beyond 65535 are strided over by the grid, so any rows >= 1 works.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"
#include "fp8_tile.cuh"

namespace {

namespace tile = tep::tile;

// Edge sub-tiles and unaligned layouts: one element at a time (same conversion as the fast path).
// sums[k] receives the column sums of the sub-tile's in-bounds rows, in row order (as column_sums).
template <typename T, __nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ float cast_partial(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t r0,
                                              int64_t c0, float scale, uint8_t* __restrict__ out,
                                              uint8_t* __restrict__ out_t, float m, float (&sums)[tile::kSub]) {
#pragma unroll
  for (int k = 0; k < tile::kSub; ++k) sums[k] = 0.f;
#pragma unroll 1
  for (int64_t r = r0; r < r0 + tile::kSub && r < rows; ++r) {
#pragma unroll 1
    for (int64_t c = c0; c < c0 + tile::kSub && c < cols; ++c) {
      const float v = tile::to_float(x[r * cols + c]);
      const uint8_t q = tile::fp8_byte<kFmt>(v * scale);
      if (out != nullptr) out[r * cols + c] = q;
      if (out_t != nullptr) out_t[c * rows + r] = q;
      m = tile::nan_max(m, fabsf(v));
      sums[c - c0] = __fadd_rn(sums[c - c0], v);
    }
  }
  return m;
}

// kDbias: also the column sums of x (for the bias gradient when x is an output gradient dy): one fp32
// partial per (64-row tile, column) into ws [row tiles, cols], folded by tile::launch_colsum_finalize.
template <typename T, __nv_fp8_interpretation_t kFmt, bool kDbias>
__global__ void __launch_bounds__(tile::kThreads) cast_transpose_kernel(
    const T* __restrict__ x, int64_t rows, int64_t cols, const float* __restrict__ scale_ptr,
    uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, float* __restrict__ amax_out,
    float* __restrict__ scale_inv_out, float* __restrict__ scale_out, float* __restrict__ ws, bool vec_in,
    bool vec_out, bool vec_out_t) {
  const float scale = *scale_ptr;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    // IEEE division (no fast math): the bits of torch's 1.0 / scale
    if (scale_inv_out != nullptr) *scale_inv_out = 1.0f / scale;
    if (scale_out != nullptr) *scale_out = scale;
  }
  const int64_t row_tiles = (rows + tile::kBlockRows - 1) / tile::kBlockRows;
  float local_max = 0.f;
  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const tile::Pos p = tile::thread_pos(rt);
    float sums[tile::kSub];
    if (vec_in && tile::full_tile(rows, p.r0, p.c0, cols)) {
      tile::Raw8<T> raw[tile::kSub];
      tile::load_rows(x, cols, p.r0, p.c0, raw);
      float v[tile::kSub][tile::kSub];
#pragma unroll
      for (int i = 0; i < tile::kSub; ++i)
#pragma unroll
        for (int k = 0; k < tile::kSub; ++k) v[i][k] = raw[i][k];
      local_max = tile::abs_max(v, local_max);
      if constexpr (kDbias) tile::column_sums(v, sums);
      uint32_t w[tile::kSub][2];
      tile::pack_fp8<kFmt>(v, scale, w);
      tile::store_fp8_full(w, out, out_t, rows, cols, p.r0, p.c0, vec_out, vec_out_t);
    } else {
      local_max = cast_partial<T, kFmt>(x, rows, cols, p.r0, p.c0, scale, out, out_t, local_max, sums);
    }
    if constexpr (kDbias) {
      tile::block_colsum(sums, ws + rt * cols, static_cast<int64_t>(blockIdx.x) * tile::kBlockCols, cols);
    }
  }
  if (amax_out != nullptr) tile::block_amax_atomic(local_max, amax_out);
}

template <typename T, bool kDbias>
tep_status launch(const void* x, int64_t rows, int64_t cols, const float* scale, void* out, void* out_t,
                  float* amax, float* scale_inv, float* scale_out, float* ws, int out_dtype, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((cols + tile::kBlockCols - 1) / tile::kBlockCols), tile::grid_y(rows));
  const bool vec_in = cols % tile::kSub == 0 && tile::aligned(x, 16);
  const bool vec_out = cols % tile::kSub == 0 && (out == nullptr || tile::aligned(out, 8));
  const bool vec_out_t = rows % tile::kSub == 0 && (out_t == nullptr || tile::aligned(out_t, 8));
  auto* xo = static_cast<uint8_t*>(out);
  auto* xt = static_cast<uint8_t*>(out_t);
  if (out_dtype == TEP_FLOAT8_E4M3) {
    cast_transpose_kernel<T, __NV_E4M3, kDbias><<<grid, tile::kThreads, 0, stream>>>(
        static_cast<const T*>(x), rows, cols, scale, xo, xt, amax, scale_inv, scale_out, ws, vec_in, vec_out, vec_out_t);
  } else {
    cast_transpose_kernel<T, __NV_E5M2, kDbias><<<grid, tile::kThreads, 0, stream>>>(
        static_cast<const T*>(x), rows, cols, scale, xo, xt, amax, scale_inv, scale_out, ws, vec_in, vec_out, vec_out_t);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    tep::set_error("tep_cast_transpose_amax: launch of [%lld, %lld] failed: %s", static_cast<long long>(rows),
                   static_cast<long long>(cols), cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}

// Transpose of an FP8 (byte) matrix: the same tiles and register transpose as the cast, reading
// 8-byte rows instead of converting (for operands that arrive already quantized, e.g. gathered FP8).
__global__ void __launch_bounds__(tile::kThreads) transpose_bytes_kernel(const uint8_t* __restrict__ x, int64_t rows,
                                                                         int64_t cols, uint8_t* __restrict__ out_t,
                                                                         bool vec_in, bool vec_out_t) {
  const int64_t row_tiles = (rows + tile::kBlockRows - 1) / tile::kBlockRows;
  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const tile::Pos p = tile::thread_pos(rt);
    if (vec_in && tile::full_tile(rows, p.r0, p.c0, cols)) {
      uint32_t w[tile::kSub][2];
#pragma unroll
      for (int i = 0; i < tile::kSub; ++i) {
        const uint2 v = *reinterpret_cast<const uint2*>(x + (p.r0 + i) * cols + p.c0);
        w[i][0] = v.x;
        w[i][1] = v.y;
      }
      tile::store_fp8_full(w, nullptr, out_t, rows, cols, p.r0, p.c0, false, vec_out_t);
    } else {
#pragma unroll 1
      for (int64_t r = p.r0; r < p.r0 + tile::kSub && r < rows; ++r) {
#pragma unroll 1
        for (int64_t c = p.c0; c < p.c0 + tile::kSub && c < cols; ++c) out_t[c * rows + r] = x[r * cols + c];
      }
    }
  }
}

}  // namespace

namespace {

// Checks shared by both cast entry points; `fn` names the entry point in the message.
bool check_cast(const char* fn, const void* x, long long rows, long long cols, const float* scale, void* out,
                void* out_t, int out_dtype) {
  if (x == nullptr || scale == nullptr || (out == nullptr && out_t == nullptr)) {
    tep::set_error("%s: x, scale and at least one of out / out_t must be non-NULL", fn);
    return false;
  }
  if (rows < 1 || cols < 1 || (cols + tep::tile::kBlockCols - 1) / tep::tile::kBlockCols > 0x7fffffffLL) {
    tep::set_error("%s: rows = %lld, cols = %lld; need rows, cols >= 1 and cols < 2^38", fn, rows, cols);
    return false;
  }
  if (out_dtype != TEP_FLOAT8_E4M3 && out_dtype != TEP_FLOAT8_E5M2) {
    tep::set_error("%s: out_dtype = %d; need TEP_FLOAT8_E4M3 (3) or TEP_FLOAT8_E5M2 (4)", fn, out_dtype);
    return false;
  }
  return true;
}

template <bool kDbias>
tep_status dispatch(const char* fn, const void* x, int x_dtype, long long rows, long long cols, const float* scale,
                    void* out, void* out_t, float* amax, float* scale_inv, float* scale_out, float* ws, int out_dtype,
                    cudaStream_t s) {
  switch (x_dtype) {
    case TEP_FLOAT32:
      return launch<float, kDbias>(x, rows, cols, scale, out, out_t, amax, scale_inv, scale_out, ws, out_dtype, s);
    case TEP_FLOAT16:
      return launch<__half, kDbias>(x, rows, cols, scale, out, out_t, amax, scale_inv, scale_out, ws, out_dtype, s);
    case TEP_BFLOAT16:
      return launch<__nv_bfloat16, kDbias>(x, rows, cols, scale, out, out_t, amax, scale_inv, scale_out, ws,
                                           out_dtype, s);
    default:
      tep::set_error("%s: x_dtype = %d; need TEP_FLOAT32 (0), TEP_FLOAT16 (1) or TEP_BFLOAT16 (2)", fn, x_dtype);
      return TEP_ERROR_INVALID_ARGUMENT;
  }
}

}  // namespace

extern "C" tep_status tep_cast_transpose_amax(const void* x, int x_dtype, long long rows, long long cols,
                                              const float* scale, void* out, void* out_t, float* amax,
                                              float* scale_inv, float* scale_out, int out_dtype, void* stream) {
  constexpr const char* kFn = "tep_cast_transpose_amax";
  if (!check_cast(kFn, x, rows, cols, scale, out, out_t, out_dtype)) return TEP_ERROR_INVALID_ARGUMENT;
  return dispatch<false>(kFn, x, x_dtype, rows, cols, scale, out, out_t, amax, scale_inv, scale_out, nullptr, out_dtype,
                         static_cast<cudaStream_t>(stream));
}

extern "C" long long tep_cast_transpose_dbias_workspace_size(long long rows, long long cols) {
  return tep::tile::colsum_workspace_bytes(rows, cols);
}

extern "C" tep_status tep_cast_transpose_dbias(const void* x, int x_dtype, long long rows, long long cols,
                                               const float* scale, void* out, void* out_t, float* amax,
                                               float* scale_inv, int out_dtype, void* dbias, int dbias_dtype,
                                               void* workspace, long long workspace_bytes, void* stream) {
  constexpr const char* kFn = "tep_cast_transpose_dbias";
  if (!check_cast(kFn, x, rows, cols, scale, out, out_t, out_dtype)) return TEP_ERROR_INVALID_ARGUMENT;
  const long long need = tep::tile::colsum_workspace_bytes(rows, cols);
  const bool dtype_ok = dbias_dtype == TEP_FLOAT32 || dbias_dtype == TEP_FLOAT16 || dbias_dtype == TEP_BFLOAT16;
  if (dbias == nullptr || !dtype_ok || workspace == nullptr || workspace_bytes < need ||
      !tep::tile::aligned(workspace, 4)) {
    tep::set_error("%s: dbias %p of dtype %d, workspace %p of %lld bytes; need dbias, a float dtype code (0, 1, 2) "
                   "and a 4-byte aligned workspace of >= %lld bytes",
                   kFn, dbias, dbias_dtype, workspace, workspace_bytes, need);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  auto s = static_cast<cudaStream_t>(stream);
  auto* ws = static_cast<float*>(workspace);
  const tep_status status =
      dispatch<true>(kFn, x, x_dtype, rows, cols, scale, out, out_t, amax, scale_inv, nullptr, ws, out_dtype, s);
  if (status != TEP_SUCCESS) return status;
  tep::tile::launch_colsum_finalize(ws, rows, cols, dbias, dbias_dtype, s);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    tep::set_error("%s: launch of the dbias reduction of [%lld, %lld] failed: %s", kFn, rows, cols,
                   cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}

extern "C" tep_status tep_transpose_fp8(const void* x, long long rows, long long cols, void* out_t, void* stream) {
  if (x == nullptr || out_t == nullptr) {
    tep::set_error("tep_transpose_fp8: x and out_t must be non-NULL");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (rows < 1 || cols < 1 || (cols + tep::tile::kBlockCols - 1) / tep::tile::kBlockCols > 0x7fffffffLL) {
    tep::set_error("tep_transpose_fp8: rows = %lld, cols = %lld; need rows, cols >= 1 and cols < 2^38", rows, cols);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  namespace tile = tep::tile;
  const dim3 grid(static_cast<unsigned>((cols + tile::kBlockCols - 1) / tile::kBlockCols), tile::grid_y(rows));
  const bool vec_in = cols % tile::kSub == 0 && tile::aligned(x, 8);
  const bool vec_out_t = rows % tile::kSub == 0 && tile::aligned(out_t, 8);
  transpose_bytes_kernel<<<grid, tile::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(x), rows, cols, static_cast<uint8_t*>(out_t), vec_in, vec_out_t);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    tep::set_error("tep_transpose_fp8: launch of [%lld, %lld] failed: %s", rows, cols, cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}
