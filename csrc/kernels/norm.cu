// LayerNorm / RMSNorm forward (C API and math: te_parallel/norm.h; chunks: norm_common.cuh).
//
// Two kernels on the caller's stream:
//   1. statistics: one warp per row reads the row in chunks of 8 (lane l owns chunks l, l + 32, ...)
//      and writes mu (LayerNorm) and rsigma. Two passes over the row for LayerNorm (mean, then mean of
//      squared deviations: no E[x^2] - mu^2 cancellation); the second re-reads the row from L1/L2.
//   2. normalize: the 64x128 thread tiles of the FP8 cast (fp8_tile.cuh) read x again (mostly from L2)
//      and write y in the output dtype; an FP8 output also gets its transposed copy from the same
//      registers (no separate transpose pass) and its amax.
// Every element of y is computed by the same instructions for every output dtype and layout, so the
// FP8 bytes are the quantization of the fp32 output, and the bits depend only on (rows, hidden) and
// the data (the chunk ownership and the summation order do not depend on pointer alignment).
#include "fp8_tile.cuh"
#include "norm_common.cuh"

namespace {

using namespace tep::norm;  // NOLINT: this file's kernels are built from those pieces
namespace tile = tep::tile;

constexpr int kStatWarps = 8;  // rows per block of the statistics kernel
constexpr int kStatUnroll = 4;  // chunks a lane loads before it adds them (loads in flight)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);  // every lane: same bits
  return v;
}

// sum over the lane's chunks of f(element), in chunk order; padding past `hidden` is skipped.
template <typename T, typename F>
__device__ __forceinline__ float lane_sum(const T* __restrict__ xr, int64_t hidden, int64_t nchunks, bool vec,
                                          F f) {
  const int lane = threadIdx.x & 31;
  float s = 0.f;
  for (int64_t c0 = lane; c0 < nchunks; c0 += 32 * kStatUnroll) {
    float v[kStatUnroll][kVec];
#pragma unroll
    for (int j = 0; j < kStatUnroll; ++j) {
      const int64_t c = c0 + 32 * j;
      if (c < nchunks) {
        load_chunk(xr, c * kVec, hidden, vec, v[j]);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[j][k] = 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < kStatUnroll; ++j)
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        if ((c0 + 32 * j) * kVec + k < hidden) s += f(v[j][k]);
  }
  return s;
}

template <typename T, bool kRms>
__global__ void __launch_bounds__(32 * kStatWarps) norm_stats_kernel(const T* __restrict__ x, int64_t rows,
                                                                      int64_t hidden, float eps, bool vec,
                                                                      float* __restrict__ mu,
                                                                      float* __restrict__ rsigma) {
  const int64_t nchunks = (hidden + kVec - 1) / kVec;
  const float fh = static_cast<float>(hidden);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kStatWarps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kStatWarps + (threadIdx.x >> 5); row < rows; row += stride) {
    const T* xr = x + row * hidden;
    float m = 0.f, var;
    if constexpr (kRms) {
      var = warp_sum(lane_sum(xr, hidden, nchunks, vec, [](float v) { return v * v; })) / fh;
    } else {
      m = warp_sum(lane_sum(xr, hidden, nchunks, vec, [](float v) { return v; })) / fh;
      var = warp_sum(lane_sum(xr, hidden, nchunks, vec, [m](float v) {
              const float t = v - m;
              return t * t;
            })) / fh;
    }
    if ((threadIdx.x & 31) == 0) {
      if (!kRms) mu[row] = m;
      rsigma[row] = rsqrtf(var + eps);
    }
  }
}

struct TileArgs {
  const void* x;
  const void* gamma;
  const void* beta;  // NULL: no bias (always for RMSNorm)
  const float* mu;   // LayerNorm
  const float* rsigma;
  const float* scale;  // FP8 output
  void* out;
  uint8_t* out_t;  // FP8 output only; NULL: none
  float* amax;     // NULL: none
  int64_t rows, cols;
  int w_dtype;
  bool zero_centered, vec_in, vec_out, vec_out_t, vec_w;
};

// y of one element: explicit roundings (no FMA contraction that could differ between instantiations).
template <bool kRms>
__device__ __forceinline__ float norm_value(float v, float mu, float rs, float g, float b) {
  return kRms ? __fmul_rn(__fmul_rn(v, rs), g) : __fmaf_rn(__fmul_rn(__fsub_rn(v, mu), rs), g, b);
}

template <int kOut>
using OutT = typename std::conditional<kOut == TEP_FLOAT32, float,
             typename std::conditional<kOut == TEP_FLOAT16, __half, __nv_bfloat16>::type>::type;

__host__ __device__ constexpr bool out_is_fp8(int out) { return out == TEP_FLOAT8_E4M3 || out == TEP_FLOAT8_E5M2; }
__host__ __device__ constexpr __nv_fp8_interpretation_t fp8_fmt(int out) { return out == TEP_FLOAT8_E5M2 ? __NV_E5M2 : __NV_E4M3; }

// y = norm(x) with the row statistics of norm_stats_kernel, written in out's dtype (kOut, a tep_dtype);
// FP8: fp8(y * scale) row-major and, when out_t is given, transposed; amax of y.
template <typename T, bool kRms, int kOut>
__global__ void __launch_bounds__(tile::kThreads) norm_tile_kernel(TileArgs a) {
  const T* x = static_cast<const T*>(a.x);
  const int64_t rows = a.rows, cols = a.cols;
  float scale = 1.f;
  if constexpr (out_is_fp8(kOut)) scale = *a.scale;
  float local_max = 0.f;
  // this thread's 8 columns: the same in every row tile
  const int64_t c0 = tile::thread_pos(0).c0;
  float g[kVec], b[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) g[k] = b[k] = 0.f;
  if (c0 < cols) {
    load_chunk_any(a.gamma, a.w_dtype, c0, cols, a.vec_w, g);
    if (!kRms && a.beta != nullptr) load_chunk_any(a.beta, a.w_dtype, c0, cols, a.vec_w, b);
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) g[k] = a.zero_centered ? __fadd_rn(g[k], 1.f) : g[k];
  const int64_t row_tiles = (rows + tile::kBlockRows - 1) / tile::kBlockRows;
  for (int64_t rt = blockIdx.y; rt < row_tiles && c0 < cols; rt += gridDim.y) {
    const int64_t r0 = tile::thread_pos(rt).r0;
    if (r0 >= rows) continue;
    float mu[kVec], rs[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const bool in = r0 + i < rows;
      rs[i] = in ? a.rsigma[r0 + i] : 0.f;
      mu[i] = (!kRms && in) ? a.mu[r0 + i] : 0.f;
    }
    if (a.vec_in && tile::full_tile(rows, r0, c0, cols)) {
      tile::Raw8<T> raw[tile::kSub];
      tile::load_rows(x, cols, r0, c0, raw);
      float v[tile::kSub][tile::kSub];
#pragma unroll
      for (int i = 0; i < tile::kSub; ++i)
#pragma unroll
        for (int k = 0; k < tile::kSub; ++k) v[i][k] = norm_value<kRms>(raw[i][k], mu[i], rs[i], g[k], b[k]);
      if constexpr (out_is_fp8(kOut)) {
        local_max = tile::abs_max(v, local_max);
        uint32_t w[tile::kSub][2];
        tile::pack_fp8<fp8_fmt(kOut)>(v, scale, w);
        tile::store_fp8_full(w, static_cast<uint8_t*>(a.out), a.out_t, rows, cols, r0, c0, a.vec_out, a.vec_out_t);
      } else {
        tile::store_rows(static_cast<OutT<kOut>*>(a.out), cols, r0, c0, a.vec_out, v);
      }
    } else {  // edge sub-tiles and unaligned layouts: one element at a time, the same instructions
#pragma unroll 1
      for (int i = 0; i < tile::kSub && r0 + i < rows; ++i) {
#pragma unroll 1
        for (int k = 0; k < tile::kSub && c0 + k < cols; ++k) {
          const int64_t r = r0 + i, c = c0 + k;
          const float y = norm_value<kRms>(to_float(x[r * cols + c]), mu[i], rs[i], g[k], b[k]);
          if constexpr (out_is_fp8(kOut)) {
            local_max = nan_max(local_max, fabsf(y));
            const uint8_t q = tile::fp8_byte<fp8_fmt(kOut)>(y * scale);
            static_cast<uint8_t*>(a.out)[r * cols + c] = q;
            if (a.out_t != nullptr) a.out_t[c * rows + r] = q;
          } else {
            static_cast<OutT<kOut>*>(a.out)[r * cols + c] = from_float<OutT<kOut>>(y);
          }
        }
      }
    }
  }
  if (out_is_fp8(kOut) && a.amax != nullptr) tile::block_amax_atomic(local_max, a.amax);
}

// ------------------------------------------------------------------------------------------------
// Host side

template <typename T, bool kRms>
void launch_stats(const T* x, int64_t rows, int64_t hidden, float eps, float* mu, float* rsigma, cudaStream_t s) {
  const bool vec = hidden % kVec == 0 && aligned(x, 16);
  const unsigned grid = grid_for(rows, kStatWarps);
  norm_stats_kernel<T, kRms><<<grid, 32 * kStatWarps, 0, s>>>(x, rows, hidden, eps, vec, mu, rsigma);
}

template <typename T, bool kRms>
void launch_tile(const TileArgs& a, int out_dtype, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((a.cols + tile::kBlockCols - 1) / tile::kBlockCols), tile::grid_y(a.rows));
  switch (out_dtype) {
    case TEP_FLOAT32: norm_tile_kernel<T, kRms, TEP_FLOAT32><<<grid, tile::kThreads, 0, s>>>(a); break;
    case TEP_FLOAT16: norm_tile_kernel<T, kRms, TEP_FLOAT16><<<grid, tile::kThreads, 0, s>>>(a); break;
    case TEP_BFLOAT16: norm_tile_kernel<T, kRms, TEP_BFLOAT16><<<grid, tile::kThreads, 0, s>>>(a); break;
    case TEP_FLOAT8_E4M3: norm_tile_kernel<T, kRms, TEP_FLOAT8_E4M3><<<grid, tile::kThreads, 0, s>>>(a); break;
    default: norm_tile_kernel<T, kRms, TEP_FLOAT8_E5M2><<<grid, tile::kThreads, 0, s>>>(a); break;
  }
}

template <typename T>
void launch_fwd(bool rms, const TileArgs& a, float eps, int out_dtype, float* mu, float* rsigma, cudaStream_t s) {
  const T* x = static_cast<const T*>(a.x);
  if (rms) {
    launch_stats<T, true>(x, a.rows, a.cols, eps, mu, rsigma, s);
    launch_tile<T, true>(a, out_dtype, s);
  } else {
    launch_stats<T, false>(x, a.rows, a.cols, eps, mu, rsigma, s);
    launch_tile<T, false>(a, out_dtype, s);
  }
}

}  // namespace

extern "C" tep_status tep_norm_fwd(const tep_norm_params* p, const void* x, int x_dtype, void* out, int out_dtype,
                                   const float* scale, void* out_t, float* amax, float* mu, float* rsigma,
                                   void* stream) {
  const char* fn = "tep_norm_fwd";
  tep_status status = check_params(fn, p, x_dtype);
  if (status != TEP_SUCCESS) return status;
  const bool rms = p->norm_type == TEP_RMSNORM;
  if (x == nullptr || out == nullptr || (rms && mu != nullptr)) {
    tep::set_error("%s: x and out must be non-NULL, and mu NULL for RMSNorm", fn);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (!is_hp(out_dtype) && !is_fp8(out_dtype)) {
    tep::set_error("%s: out_dtype = %d; need a tep_dtype (0 to 4)", fn, out_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (is_fp8(out_dtype) ? scale == nullptr : (scale != nullptr || out_t != nullptr)) {
    tep::set_error("%s: out_dtype = %d; an FP8 output needs scale, a high-precision one takes neither scale nor out_t",
                   fn, out_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  auto s = static_cast<cudaStream_t>(stream);
  // The statistics pass hands mu / rsigma to the normalize pass: stream-ordered scratch where the
  // caller does not want them.
  float* scratch = nullptr;
  if (rsigma == nullptr || (!rms && mu == nullptr)) {
    const size_t bytes = static_cast<size_t>(p->rows) * sizeof(float) * (rms ? 1 : 2);
    const cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&scratch), bytes, s);
    if (err != cudaSuccess) return cuda_failed("tep_norm_fwd: stream-ordered scratch for the row statistics", err);
    if (rsigma == nullptr) rsigma = scratch;
    if (!rms && mu == nullptr) mu = scratch + p->rows;
  }
  TileArgs a;
  a.x = x;
  a.gamma = p->gamma;
  a.beta = rms ? nullptr : p->beta;
  a.mu = mu;
  a.rsigma = rsigma;
  a.scale = scale;
  a.out = out;
  a.out_t = static_cast<uint8_t*>(out_t);
  a.amax = is_fp8(out_dtype) ? amax : nullptr;
  a.rows = p->rows;
  a.cols = p->hidden;
  a.w_dtype = p->w_dtype;
  a.zero_centered = p->zero_centered_gamma != 0;
  a.vec_in = p->hidden % kVec == 0 && aligned(x, 16);
  a.vec_out = p->hidden % kVec == 0 && aligned(out, is_fp8(out_dtype) ? 8 : 16);
  a.vec_out_t = p->rows % kVec == 0 && (out_t == nullptr || aligned(out_t, 8));
  a.vec_w = p->hidden % kVec == 0 && aligned(p->gamma, 16) && (a.beta == nullptr || aligned(a.beta, 16));
  switch (x_dtype) {
    case TEP_FLOAT16: launch_fwd<__half>(rms, a, p->eps, out_dtype, mu, rsigma, s); break;
    case TEP_BFLOAT16: launch_fwd<__nv_bfloat16>(rms, a, p->eps, out_dtype, mu, rsigma, s); break;
    default: launch_fwd<float>(rms, a, p->eps, out_dtype, mu, rsigma, s); break;
  }
  if (scratch != nullptr) {
    const cudaError_t err = cudaFreeAsync(scratch, s);
    if (err != cudaSuccess) return cuda_failed("tep_norm_fwd: freeing the statistics scratch", err);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    tep::set_error("%s: launch for [%lld, %lld] failed: %s", fn, p->rows, p->hidden, cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}
