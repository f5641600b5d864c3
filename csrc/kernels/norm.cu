// LayerNorm / RMSNorm forward (C API and math: te_parallel/norm.h; chunks and thread ownership:
// norm_common.cuh).
//
// hidden <= 16384: a row stays in registers (kVecs = 1, 2 or 4 chunks per thread); rows of fewer than
//   256 threads share a block (threadIdx.y = row slot). Statistics are two-pass over the registers
//   (mean, then mean of squared deviations): no E[x^2] - mu^2 cancellation. Wider rows take a looped
//   kernel that re-reads the row from L2 for each pass (one block per row).
// FP8 output: the transposed copy is made from the FP8 output by a 64x64-tile byte transpose
//   (1 byte read + 1 written per element): a row-wise kernel cannot write columns coalesced, and a
//   tile of whole rows does not fit in shared memory for the hidden sizes that matter.
#include "norm_common.cuh"

namespace {

using namespace tep::norm;  // NOLINT: this file's kernels are built from those pieces

// ------------------------------------------------------------------------------------------------
// Forward

struct FwdArgs {
  const void* x;
  void* out;
  const void* gamma;
  const void* beta;  // NULL: no bias
  const float* scale;
  float* amax;
  float* mu;
  float* rsigma;
  int64_t rows, hidden;
  float eps;
  int w_dtype, out_dtype;
  bool zero_centered, vec;
};

// y of one chunk (the same instructions for every output dtype), and the running max |y|.
template <bool kRms>
__device__ __forceinline__ void normalize_chunk(const FwdArgs& a, const float (&v)[kVec], int64_t col, float mu,
                                                float rs, float (&y)[kVec], float& amax_local) {
  float g[kVec], b[kVec];
  load_chunk_any(a.gamma, a.w_dtype, col, a.hidden, a.vec, g);
  if (!kRms && a.beta != nullptr) {
    load_chunk_any(a.beta, a.w_dtype, col, a.hidden, a.vec, b);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) b[k] = 0.f;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const float gk = a.zero_centered ? __fadd_rn(g[k], 1.f) : g[k];
    // Explicit roundings: no FMA contraction that could differ between instantiations.
    y[k] = kRms ? __fmul_rn(__fmul_rn(v[k], rs), gk) : __fmaf_rn(__fmul_rn(__fsub_rn(v[k], mu), rs), gk, b[k]);
    if (col + k < a.hidden) amax_local = nan_max(amax_local, fabsf(y[k]));
  }
}

template <bool kRms>
__device__ __forceinline__ void write_stats(const FwdArgs& a, int64_t row, float mu, float rs) {
  if (!kRms && a.mu != nullptr) a.mu[row] = mu;
  if (a.rsigma != nullptr) a.rsigma[row] = rs;
}

// Row in registers: kVecs chunks per thread. blockDim = (tpr, rows per block).
template <typename T, bool kRms, int kVecs>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_kernel(FwdArgs a) {
  __shared__ float2 red[kMaxWarps];
  __shared__ float amax_buf[kMaxWarps];
  const T* x = static_cast<const T*>(a.x);
  const int64_t hidden = a.hidden, nchunks = (hidden + kVec - 1) / kVec;
  const float fh = static_cast<float>(hidden);
  const float scale = a.out_dtype >= TEP_FLOAT8_E4M3 ? *a.scale : 1.f;
  float amax_local = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < a.rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < a.rows;  // invalid slots still join the barriers
    const T* xr = x + (valid ? row : 0) * hidden;
    float v[kVecs][kVec];
    float2 s = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (valid && c < nchunks) {
        load_chunk(xr, c * kVec, hidden, a.vec, v[i]);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[i][k] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) s.x += kRms ? v[i][k] * v[i][k] : v[i][k];  // padding is 0
    }
    float mu = 0.f, rs;
    if constexpr (kRms) {
      rs = rsqrtf(row_sum2(s, red).x / fh + a.eps);
    } else {
      mu = row_sum2(s, red).x / fh;
      float2 d = make_float2(0.f, 0.f);
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float t = (valid && c * kVec + k < hidden) ? v[i][k] - mu : 0.f;
          d.x += t * t;
        }
      }
      rs = rsqrtf(row_sum2(d, red).x / fh + a.eps);
    }
    if (!valid) continue;
    if (threadIdx.x == 0) write_stats<kRms>(a, row, mu, rs);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (c >= nchunks) continue;
      float y[kVec];
      normalize_chunk<kRms>(a, v[i], c * kVec, mu, rs, y, amax_local);
      store_out(a.out, a.out_dtype, row * hidden, c * kVec, hidden, a.vec, y, scale);
    }
  }
  if (a.amax != nullptr) block_amax(amax_local, a.amax, amax_buf);
}

// Rows wider than the register kernels hold: one block per row, each pass re-reads x (from L2).
template <typename T, bool kRms>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_looped_kernel(FwdArgs a) {
  __shared__ float2 red[kMaxWarps];
  __shared__ float amax_buf[kMaxWarps];
  const T* x = static_cast<const T*>(a.x);
  const int64_t hidden = a.hidden, nchunks = (hidden + kVec - 1) / kVec;
  const float fh = static_cast<float>(hidden);
  const float scale = a.out_dtype >= TEP_FLOAT8_E4M3 ? *a.scale : 1.f;
  float amax_local = 0.f;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {  // uniform over the block
    const T* xr = x + row * hidden;
    float2 s = make_float2(0.f, 0.f);
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
      float v[kVec];
      load_chunk(xr, c * kVec, hidden, a.vec, v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) s.x += kRms ? v[k] * v[k] : v[k];
    }
    float mu = 0.f, rs;
    if constexpr (kRms) {
      rs = rsqrtf(row_sum2(s, red).x / fh + a.eps);
    } else {
      mu = row_sum2(s, red).x / fh;
      float2 d = make_float2(0.f, 0.f);
      for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
        float v[kVec];
        load_chunk(xr, c * kVec, hidden, a.vec, v);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float t = c * kVec + k < hidden ? v[k] - mu : 0.f;
          d.x += t * t;
        }
      }
      rs = rsqrtf(row_sum2(d, red).x / fh + a.eps);
    }
    if (threadIdx.x == 0) write_stats<kRms>(a, row, mu, rs);
    for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
      float v[kVec], y[kVec];
      load_chunk(xr, c * kVec, hidden, a.vec, v);
      normalize_chunk<kRms>(a, v, c * kVec, mu, rs, y, amax_local);
      store_out(a.out, a.out_dtype, row * hidden, c * kVec, hidden, a.vec, y, scale);
    }
  }
  if (a.amax != nullptr) block_amax(amax_local, a.amax, amax_buf);
}

// out_t[j, i] = in[i, j] for bytes: 64x64 tiles through shared memory, 8-byte loads and stores where
// the layout allows (as in cast_transpose.cu).
__global__ void __launch_bounds__(256) transpose_bytes_kernel(const uint8_t* __restrict__ in, int64_t rows,
                                                              int64_t cols, uint8_t* __restrict__ out_t,
                                                              bool vec_in, bool vec_out) {
  __shared__ uint8_t tile[kTile][kTile + 8];
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  for (int64_t ty = blockIdx.y; ty < row_tiles; ty += gridDim.y) {  // uniform over the block
    const int64_t row0 = ty * kTile;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const int v = threadIdx.x + g * 256;  // 512 groups of 8 per tile
      const int r = v / (kTile / kVec), c = (v % (kTile / kVec)) * kVec;
      const int64_t gr = row0 + r, gc = col0 + c;
      alignas(8) uint8_t q[kVec];
      if (gr < rows && gc + kVec <= cols && vec_in) {
        *reinterpret_cast<uint2*>(q) = *reinterpret_cast<const uint2*>(in + gr * cols + gc);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) q[k] = (gr < rows && gc + k < cols) ? in[gr * cols + gc + k] : 0;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) tile[r][c + k] = q[k];
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const int v = threadIdx.x + g * 256;
      const int c = v / (kTile / kVec), r = (v % (kTile / kVec)) * kVec;  // column c, rows r..r+7
      const int64_t gc = col0 + c, gr = row0 + r;
      if (gc >= cols) continue;
      alignas(8) uint8_t q[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) q[k] = tile[r + k][c];
      if (gr + kVec <= rows && vec_out) {
        *reinterpret_cast<uint2*>(out_t + gc * rows + gr) = *reinterpret_cast<const uint2*>(q);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          if (gr + k < rows) out_t[gc * rows + gr + k] = q[k];
      }
    }
    __syncthreads();  // the next tile overwrites `tile`
  }
}

// ------------------------------------------------------------------------------------------------
// Host side

constexpr int kFwdCaps[3] = {128, 256, 512};  // hidden <= 16384 in registers

template <typename T, bool kRms>
void launch_fwd(const FwdArgs& a, cudaStream_t stream) {
  const RowShape sh = row_shape(a.hidden, kFwdCaps);
  const dim3 block(sh.tpr, sh.rpc);
  const unsigned grid = grid_for(a.rows, sh.rpc);
  switch (sh.vecs) {
    case 1: norm_fwd_kernel<T, kRms, 1><<<grid, block, 0, stream>>>(a); break;
    case 2: norm_fwd_kernel<T, kRms, 2><<<grid, block, 0, stream>>>(a); break;
    case 4: norm_fwd_kernel<T, kRms, 4><<<grid, block, 0, stream>>>(a); break;
    default: norm_fwd_looped_kernel<T, kRms><<<grid, block, 0, stream>>>(a); break;
  }
}

template <typename T>
void launch_fwd_for(bool rms, const FwdArgs& a, cudaStream_t s) {
  if (rms) {
    launch_fwd<T, true>(a, s);
  } else {
    launch_fwd<T, false>(a, s);
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
  FwdArgs a;
  a.x = x;
  a.out = out;
  a.gamma = p->gamma;
  a.beta = rms ? nullptr : p->beta;
  a.scale = scale;
  a.amax = amax;
  a.mu = mu;
  a.rsigma = rsigma;
  a.rows = p->rows;
  a.hidden = p->hidden;
  a.eps = p->eps;
  a.w_dtype = p->w_dtype;
  a.out_dtype = out_dtype;
  a.zero_centered = p->zero_centered_gamma != 0;
  a.vec = p->hidden % kVec == 0 && aligned(x, 16) && aligned(p->gamma, 16) &&
          (a.beta == nullptr || aligned(a.beta, 16)) && aligned(out, is_fp8(out_dtype) ? 8 : 16);
  auto s = static_cast<cudaStream_t>(stream);
  switch (x_dtype) {
    case TEP_FLOAT16: launch_fwd_for<__half>(rms, a, s); break;
    case TEP_BFLOAT16: launch_fwd_for<__nv_bfloat16>(rms, a, s); break;
    default: launch_fwd_for<float>(rms, a, s); break;
  }
  if (out_t != nullptr) {
    const int64_t rows = p->rows, cols = p->hidden;
    const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                    static_cast<unsigned>(std::min<int64_t>((rows + kTile - 1) / kTile, 65535)));
    transpose_bytes_kernel<<<grid, 256, 0, s>>>(static_cast<const uint8_t*>(out), rows, cols,
                                                static_cast<uint8_t*>(out_t), cols % kVec == 0 && aligned(out, 8),
                                                rows % kVec == 0 && aligned(out_t, 8));
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    tep::set_error("%s: launch for [%lld, %lld] failed: %s", fn, p->rows, p->hidden, cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}
