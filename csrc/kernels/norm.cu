// LayerNorm / RMSNorm forward and backward (C API and math: te_parallel/norm.h).
//
// Rows are split into chunks of 8 consecutive elements (one 16-byte load of a 2-byte dtype, two of
// fp32). A row is owned by `tpr` threads (a multiple of 32); thread t owns chunks t, t + tpr, ...
// Which thread owns which element, and so every sum's order, depends only on (rows, hidden): the
// aligned (vector) and unaligned (element-wise) paths load and store the same chunks differently,
// so the result bits do not depend on pointer alignment or on the output dtype.
//
// Forward, hidden <= 16384: a row stays in registers (kVecs = 1, 2 or 4 chunks per thread); rows of
//   fewer than 256 threads share a block (threadIdx.y = row slot). Statistics are two-pass over the
//   registers (mean, then mean of squared deviations): no E[x^2] - mu^2 cancellation. Wider rows
//   take a looped kernel that re-reads the row from L2 for each pass (one block per row).
// Backward: dx needs two row sums, mean(dy*g) and mean(dy*g * xhat), reduced together. For
//   hidden <= 8192 the dx kernel also accumulates dgamma/dbeta in registers over the rows of its
//   persistent block and writes one fp32 partial row per row slot; wider rows leave dgamma/dbeta to
//   a column kernel that re-reads x and dy (x and dy of one thread would not fit in registers next
//   to the accumulators). A fixed-order sum over the partials finishes both: deterministic.
// FP8 forward: the transposed copy is made from the FP8 output by a 64x64-tile byte transpose
//   (1 byte read + 1 written per element): a row-wise kernel cannot write columns coalesced, and a
//   tile of whole rows does not fit in shared memory for the hidden sizes that matter.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "te_parallel/norm.h"

namespace {

constexpr int kVec = 8;            // elements per chunk
constexpr int kMaxThreads = 512;   // threads per block of the row kernels
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kRowThreads = 256;   // rows narrower than this share a block up to this many threads
constexpr int64_t kMaxGrid = 1 << 22;  // row kernels stride over the rows beyond this many blocks
constexpr int kColRows = 8;        // row lanes of the dgamma/dbeta column kernel (blockDim.y)
constexpr int kTile = 64;          // byte transpose tile

// ------------------------------------------------------------------------------------------------
// Element access
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

// Elements col .. col+7 of `row` (zeros past `hidden`); the caller guarantees col < hidden. `vec`:
// the host checked hidden % 8 == 0 and 16-byte alignment, so the chunk is whole and aligned.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, int64_t col, int64_t hidden, bool vec,
                                           float (&v)[kVec]) {
  if (vec) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + col);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[k] = to_float(e[k]);
    } else {
      const float4 a = reinterpret_cast<const float4*>(row + col)[0];
      const float4 b = reinterpret_cast<const float4*>(row + col)[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = col + k < hidden ? to_float(row[col + k]) : 0.f;
  }
}

// gamma / beta, whose dtype is a runtime argument (uniform over the grid, so no divergence).
__device__ __forceinline__ void load_chunk_any(const void* p, int dtype, int64_t col, int64_t hidden, bool vec,
                                               float (&v)[kVec]) {
  switch (dtype) {
    case TEP_FLOAT16: load_chunk(static_cast<const __half*>(p), col, hidden, vec, v); break;
    case TEP_BFLOAT16: load_chunk(static_cast<const __nv_bfloat16*>(p), col, hidden, vec, v); break;
    default: load_chunk(static_cast<const float*>(p), col, hidden, vec, v); break;
  }
}

template <typename T>
__device__ __forceinline__ void store_chunk(T* __restrict__ row, int64_t col, int64_t hidden, bool vec,
                                            const float (&v)[kVec]) {
  if (vec) {
    if constexpr (sizeof(T) == 2) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) e[k] = from_float<T>(v[k]);
      *reinterpret_cast<uint4*>(row + col) = raw;
    } else {
      reinterpret_cast<float4*>(row + col)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(row + col)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      if (col + k < hidden) row[col + k] = from_float<T>(v[k]);
  }
}

// fp8(y * scale): one fp32 multiplication (no contraction), then the saturating RNE conversion.
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ void store_fp8(uint8_t* __restrict__ row, int64_t col, int64_t hidden, bool vec,
                                          const float (&y)[kVec], float scale) {
  alignas(8) uint8_t q[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k)
    q[k] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(y[k], scale), __NV_SATFINITE, kFmt));
  if (vec) {
    *reinterpret_cast<uint2*>(row + col) = *reinterpret_cast<const uint2*>(q);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      if (col + k < hidden) row[col + k] = q[k];
  }
}

// Chunk of one output row (`offset` = row * hidden elements) in the runtime output dtype.
__device__ __forceinline__ void store_out(void* out, int out_dtype, int64_t offset, int64_t col, int64_t hidden,
                                          bool vec, const float (&y)[kVec], float scale) {
  switch (out_dtype) {
    case TEP_FLOAT32: store_chunk(static_cast<float*>(out) + offset, col, hidden, vec, y); break;
    case TEP_FLOAT16: store_chunk(static_cast<__half*>(out) + offset, col, hidden, vec, y); break;
    case TEP_BFLOAT16: store_chunk(static_cast<__nv_bfloat16*>(out) + offset, col, hidden, vec, y); break;
    case TEP_FLOAT8_E4M3: store_fp8<__NV_E4M3>(static_cast<uint8_t*>(out) + offset, col, hidden, vec, y, scale); break;
    default: store_fp8<__NV_E5M2>(static_cast<uint8_t*>(out) + offset, col, hidden, vec, y, scale); break;
  }
}

__device__ __forceinline__ void store_scalar_any(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case TEP_FLOAT16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case TEP_BFLOAT16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// ------------------------------------------------------------------------------------------------
// Reductions

// Sums of (v.x, v.y) over the blockDim.x threads of row slot threadIdx.y. Lanes combine by a xor
// butterfly (a + b == b + a, so every lane gets the same bits) and warps in a fixed order: all threads
// of a row agree, and reruns give the same bits. Every thread of the block must call it.
__device__ __forceinline__ float2 row_sum2(float2 v, float2* buf) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, off);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, off);
  }
  const int nw = blockDim.x >> 5;
  if (nw == 1) return v;  // uniform over the block: no barrier needed
  const int base = threadIdx.y * nw;
  if ((threadIdx.x & 31) == 0) buf[base + (threadIdx.x >> 5)] = v;
  __syncthreads();
  float2 s = buf[base];
  for (int w = 1; w < nw; ++w) {
    s.x += buf[base + w].x;
    s.y += buf[base + w].y;
  }
  __syncthreads();  // the next call overwrites buf
  return s;
}

// amax[0] = max(amax[0], block max of m): one atomicMax on the float's bits (valid for values >= 0;
// a NaN has larger bits than +inf, so NaN wins, as in torch.amax). Every thread must call it.
__device__ __forceinline__ void block_amax(float m, float* amax, float* buf) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, off));
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  if ((tid & 31) == 0) buf[tid >> 5] = m;
  __syncthreads();
  if (tid == 0) {
    float r = 0.f;
    const int nw = (blockDim.x * blockDim.y) >> 5;
    for (int w = 0; w < nw; ++w) r = nan_max(r, buf[w]);
    atomicMax(reinterpret_cast<int*>(amax), __float_as_int(r));
  }
}

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
// Backward

struct BwdArgs {
  const void* dy;
  const void* x;
  const float* mu;
  const float* rsigma;
  void* dx;
  const void* gamma;
  float* ws_dgamma;  // [partials, hidden] fp32
  float* ws_dbeta;   // [partials, hidden] fp32, or NULL: no dbeta
  int64_t rows, hidden;
  int64_t rows_per_split;  // column kernel only
  int w_dtype;
  bool zero_centered, vec;
};

// dx of rows in registers (x and dy: kVecs chunks per thread); with kWgrad also this row slot's
// partial dgamma/dbeta over all the rows it visits, written to row blockIdx.x * blockDim.y +
// threadIdx.y of the workspace (every slot writes its row, zeros if it saw no row).
template <typename T, bool kRms, int kVecs, bool kWgrad>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_kernel(BwdArgs a) {
  __shared__ float2 red[kMaxWarps];
  constexpr int kAcc = kWgrad ? kVecs : 1;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const int64_t hidden = a.hidden, nchunks = (hidden + kVec - 1) / kVec;
  const float fh = static_cast<float>(hidden);
  float dg[kAcc][kVec], db[kAcc][kVec];
#pragma unroll
  for (int i = 0; i < kAcc; ++i)
#pragma unroll
    for (int k = 0; k < kVec; ++k) dg[i][k] = db[i][k] = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < a.rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < a.rows;
    const int64_t offset = (valid ? row : 0) * hidden;
    const float mu = (!kRms && valid) ? a.mu[row] : 0.f;
    const float rs = valid ? a.rsigma[row] : 0.f;
    float xhat[kVecs][kVec], dyg[kVecs][kVec];
    float2 s = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      float xv[kVec], dyv[kVec], g[kVec];
      const bool live = valid && c < nchunks;
      if (live) {
        load_chunk(x + offset, c * kVec, hidden, a.vec, xv);
        load_chunk(dy + offset, c * kVec, hidden, a.vec, dyv);
        load_chunk_any(a.gamma, a.w_dtype, c * kVec, hidden, a.vec, g);
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (!live || c * kVec + k >= hidden) {
          xhat[i][k] = dyg[i][k] = 0.f;
          continue;
        }
        const float gk = a.zero_centered ? __fadd_rn(g[k], 1.f) : g[k];
        xhat[i][k] = kRms ? xv[k] * rs : (xv[k] - mu) * rs;
        dyg[i][k] = dyv[k] * gk;
        s.x += dyg[i][k];
        s.y += dyg[i][k] * xhat[i][k];
        if constexpr (kWgrad) {
          dg[i][k] += dyv[k] * xhat[i][k];
          if (!kRms) db[i][k] += dyv[k];
        }
      }
    }
    s = row_sum2(s, red);
    const float m1 = s.x / fh, m2 = s.y / fh;
    if (!valid) continue;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (c >= nchunks) continue;
      float d[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        d[k] = kRms ? rs * (dyg[i][k] - xhat[i][k] * m2) : rs * (dyg[i][k] - m1 - xhat[i][k] * m2);
      store_chunk(dx + offset, c * kVec, hidden, a.vec, d);
    }
  }
  if constexpr (kWgrad) {
    const int64_t part = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (c >= nchunks) continue;
      store_chunk(a.ws_dgamma + part * hidden, c * kVec, hidden, a.vec, dg[i]);
      if (!kRms && a.ws_dbeta != nullptr) store_chunk(a.ws_dbeta + part * hidden, c * kVec, hidden, a.vec, db[i]);
    }
  }
}

// dx only, rows wider than the register kernels hold: one block per row, two passes over x and dy.
template <typename T, bool kRms>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_looped_kernel(BwdArgs a) {
  __shared__ float2 red[kMaxWarps];
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const int64_t hidden = a.hidden, nchunks = (hidden + kVec - 1) / kVec;
  const float fh = static_cast<float>(hidden);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {  // uniform over the block
    const int64_t offset = row * hidden;
    const float mu = kRms ? 0.f : a.mu[row], rs = a.rsigma[row];
    float2 s = make_float2(0.f, 0.f);
    for (int pass = 0; pass < 2; ++pass) {
      float m1 = 0.f, m2 = 0.f;
      if (pass == 1) {
        s = row_sum2(s, red);
        m1 = s.x / fh;
        m2 = s.y / fh;
      }
      for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) {
        float xv[kVec], dyv[kVec], g[kVec], d[kVec];
        load_chunk(x + offset, c * kVec, hidden, a.vec, xv);
        load_chunk(dy + offset, c * kVec, hidden, a.vec, dyv);
        load_chunk_any(a.gamma, a.w_dtype, c * kVec, hidden, a.vec, g);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const bool in = c * kVec + k < hidden;
          const float gk = a.zero_centered ? __fadd_rn(g[k], 1.f) : g[k];
          const float xh = in ? (kRms ? xv[k] * rs : (xv[k] - mu) * rs) : 0.f;
          const float dg = in ? dyv[k] * gk : 0.f;
          if (pass == 0) {
            s.x += dg;
            s.y += dg * xh;
          } else {
            d[k] = kRms ? rs * (dg - xh * m2) : rs * (dg - m1 - xh * m2);
          }
        }
        if (pass == 1) store_chunk(dx + offset, c * kVec, hidden, a.vec, d);
      }
    }
  }
}

// Partial dgamma/dbeta of rows [split * rows_per_split, ...) (split = blockIdx.y) for the 32 chunks
// of blockIdx.x: blockDim = (32, kColRows); lane y visits every kColRows-th row, then the lanes are
// summed in a fixed order and written to workspace row `split`.
template <typename T, bool kRms>
__global__ void __launch_bounds__(32 * kColRows) norm_wgrad_partial_kernel(BwdArgs a) {
  __shared__ float sdg[kColRows][32][kVec + 1];
  __shared__ float sdb[kColRows][32][kVec + 1];
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const int64_t hidden = a.hidden, nchunks = (hidden + kVec - 1) / kVec;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * a.rows_per_split;
  const int64_t r1 = a.rows < r0 + a.rows_per_split ? a.rows : r0 + a.rows_per_split;
  float dg[kVec], db[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) dg[k] = db[k] = 0.f;
  if (c < nchunks) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      float xv[kVec], dyv[kVec];
      load_chunk(x + r * hidden, c * kVec, hidden, a.vec, xv);
      load_chunk(dy + r * hidden, c * kVec, hidden, a.vec, dyv);
      const float mu = kRms ? 0.f : a.mu[r], rs = a.rsigma[r];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        dg[k] += dyv[k] * (kRms ? xv[k] * rs : (xv[k] - mu) * rs);
        db[k] += dyv[k];
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    sdg[threadIdx.y][threadIdx.x][k] = dg[k];
    sdb[threadIdx.y][threadIdx.x][k] = db[k];
  }
  __syncthreads();
  // Thread (x, y) now finishes element k = y of chunk x.
  const int k = threadIdx.y;
  const int64_t j = c * kVec + k;
  if (c >= nchunks || j >= hidden) return;
  float tg = 0.f, tb = 0.f;
  for (int l = 0; l < kColRows; ++l) {
    tg += sdg[l][threadIdx.x][k];
    tb += sdb[l][threadIdx.x][k];
  }
  a.ws_dgamma[blockIdx.y * hidden + j] = tg;
  if (!kRms && a.ws_dbeta != nullptr) a.ws_dbeta[blockIdx.y * hidden + j] = tb;
}

// dgamma[j] = sum over partials p of ws[p, j] (blockIdx.y = 0), dbeta likewise (blockIdx.y = 1), in a
// fixed order; blockDim = (32 columns, 32 partial lanes).
__global__ void __launch_bounds__(1024) norm_wgrad_finalize_kernel(const float* __restrict__ ws_dgamma,
                                                                   const float* __restrict__ ws_dbeta,
                                                                   int64_t partials, int64_t hidden, void* dgamma,
                                                                   void* dbeta, int w_dtype) {
  __shared__ float buf[32][33];
  const float* src = blockIdx.y == 0 ? ws_dgamma : ws_dbeta;
  void* dst = blockIdx.y == 0 ? dgamma : dbeta;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (j < hidden)
    for (int64_t p = threadIdx.y; p < partials; p += 32) s += src[p * hidden + j];
  buf[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || j >= hidden) return;
  float t = 0.f;
  for (int l = 0; l < 32; ++l) t += buf[l][threadIdx.x];
  store_scalar_any(dst, w_dtype, j, t);
}

// ------------------------------------------------------------------------------------------------
// Host side: launch plans

// How a row is spread over a block: `vecs` chunks per thread (0: the looped kernel), `tpr` threads
// per row, `rpc` rows per block. caps[i]: the most threads per row allowed with 1, 2, 4 chunks.
struct RowShape {
  int vecs, tpr, rpc;
};

RowShape row_shape(int64_t hidden, const int (&caps)[3]) {
  const int64_t nchunks = (hidden + kVec - 1) / kVec;
  const int vecs[3] = {1, 2, 4};
  for (int i = 0; i < 3; ++i) {
    const int64_t tpr = ((nchunks + vecs[i] - 1) / vecs[i] + 31) / 32 * 32;
    if (tpr <= caps[i]) {
      const int t = static_cast<int>(tpr);
      return {vecs[i], t, std::max(1, kRowThreads / t)};
    }
  }
  return {0, kMaxThreads, 1};
}

constexpr int kFwdCaps[3] = {128, 256, 512};  // hidden <= 16384 in registers
// Backward: 1 or 2 chunks per thread keep x, dy and the dgamma/dbeta accumulators in registers
// (hidden <= 8192); 4 chunks keep x and dy only (the column kernel does dgamma/dbeta).
constexpr int kBwdCaps[3] = {128, 512, 512};

bool aligned(const void* p, int bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

unsigned grid_for(int64_t rows, int rpc) {
  return static_cast<unsigned>(std::min<int64_t>((rows + rpc - 1) / rpc, kMaxGrid));
}

tep_status cuda_failed(const char* what, cudaError_t err) {
  tep::set_error("%s: %s", what, cudaGetErrorString(err));
  return TEP_ERROR_CUDA;
}

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

// Everything the backward launches depend on; the same for the workspace query and the launch.
struct BwdPlan {
  RowShape shape;
  bool fused;         // dgamma/dbeta partials from the dx kernel
  unsigned grid;      // dx kernel blocks
  int64_t partials;   // workspace rows per gradient
  int64_t rows_per_split;  // column kernel (not fused)
  unsigned col_blocks;     // column kernel (not fused)
};

template <typename T, bool kRms>
tep_status plan_bwd(int64_t rows, int64_t hidden, BwdPlan* plan) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return cuda_failed("tep_norm_bwd: cannot query the current device", err);
  const RowShape sh = row_shape(hidden, kBwdCaps);
  plan->shape = sh;
  plan->fused = sh.vecs == 1 || sh.vecs == 2;
  plan->grid = grid_for(rows, sh.rpc);
  if (plan->fused) {
    // Persistent blocks: as many as fit on the device at once, so the partials are few.
    int per_sm = 0;
    const void* kernel = sh.vecs == 1 ? reinterpret_cast<const void*>(norm_bwd_kernel<T, kRms, 1, true>)
                                      : reinterpret_cast<const void*>(norm_bwd_kernel<T, kRms, 2, true>);
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, sh.tpr * sh.rpc, 0);
    if (err != cudaSuccess) return cuda_failed("tep_norm_bwd: occupancy query failed", err);
    plan->grid = static_cast<unsigned>(std::min<int64_t>(plan->grid, static_cast<int64_t>(std::max(per_sm, 1)) * sms));
    plan->partials = static_cast<int64_t>(plan->grid) * sh.rpc;
    plan->rows_per_split = 0;
    plan->col_blocks = 0;
  } else {
    const int64_t nchunks = (hidden + kVec - 1) / kVec;
    const int64_t col_blocks = (nchunks + 31) / 32;
    // About 4 blocks per SM over all splits; at least 32 rows per split.
    const int64_t max_splits = std::max<int64_t>(1, (rows + 31) / 32);
    const int64_t splits = std::min(max_splits, std::max<int64_t>(1, (4LL * sms + col_blocks - 1) / col_blocks));
    plan->rows_per_split = (rows + splits - 1) / splits;
    plan->partials = (rows + plan->rows_per_split - 1) / plan->rows_per_split;
    plan->col_blocks = static_cast<unsigned>(col_blocks);
  }
  return TEP_SUCCESS;
}

template <typename T, bool kRms>
tep_status launch_bwd(const BwdPlan& plan, BwdArgs a, void* dgamma, void* dbeta, cudaStream_t stream) {
  const RowShape& sh = plan.shape;
  const dim3 block(sh.tpr, sh.rpc);
  switch (sh.vecs) {
    case 1: norm_bwd_kernel<T, kRms, 1, true><<<plan.grid, block, 0, stream>>>(a); break;
    case 2: norm_bwd_kernel<T, kRms, 2, true><<<plan.grid, block, 0, stream>>>(a); break;
    case 4: norm_bwd_kernel<T, kRms, 4, false><<<plan.grid, block, 0, stream>>>(a); break;
    default: norm_bwd_looped_kernel<T, kRms><<<plan.grid, block, 0, stream>>>(a); break;
  }
  if (!plan.fused) {
    a.rows_per_split = plan.rows_per_split;
    const dim3 grid(plan.col_blocks, static_cast<unsigned>(plan.partials));
    norm_wgrad_partial_kernel<T, kRms><<<grid, dim3(32, kColRows), 0, stream>>>(a);
  }
  const dim3 fgrid(static_cast<unsigned>((a.hidden + 31) / 32), a.ws_dbeta != nullptr ? 2 : 1);
  norm_wgrad_finalize_kernel<<<fgrid, dim3(32, 32), 0, stream>>>(a.ws_dgamma, a.ws_dbeta, plan.partials, a.hidden,
                                                                 dgamma, dbeta, a.w_dtype);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? TEP_SUCCESS : cuda_failed("tep_norm_bwd: launch failed", err);
}

template <typename T>
tep_status plan_bwd_for(bool rms, int64_t rows, int64_t hidden, BwdPlan* plan) {
  return rms ? plan_bwd<T, true>(rows, hidden, plan) : plan_bwd<T, false>(rows, hidden, plan);
}

tep_status plan_bwd_any(int x_dtype, bool rms, int64_t rows, int64_t hidden, BwdPlan* plan) {
  switch (x_dtype) {
    case TEP_FLOAT16: return plan_bwd_for<__half>(rms, rows, hidden, plan);
    case TEP_BFLOAT16: return plan_bwd_for<__nv_bfloat16>(rms, rows, hidden, plan);
    default: return plan_bwd_for<float>(rms, rows, hidden, plan);
  }
}

size_t workspace_bytes(const BwdPlan& plan, bool rms, int64_t hidden) {
  return static_cast<size_t>(rms ? 1 : 2) * static_cast<size_t>(plan.partials) * static_cast<size_t>(hidden) *
         sizeof(float);
}

// ------------------------------------------------------------------------------------------------
// Argument checks (one line each: what was given, what is needed)

bool is_hp(int dtype) { return dtype == TEP_FLOAT32 || dtype == TEP_FLOAT16 || dtype == TEP_BFLOAT16; }
bool is_fp8(int dtype) { return dtype == TEP_FLOAT8_E4M3 || dtype == TEP_FLOAT8_E5M2; }

tep_status check_params(const char* fn, const tep_norm_params* p, int x_dtype) {
  if (p == nullptr) {
    tep::set_error("%s: params is NULL", fn);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (p->norm_type != TEP_LAYERNORM && p->norm_type != TEP_RMSNORM) {
    tep::set_error("%s: norm_type = %d; need TEP_LAYERNORM (0) or TEP_RMSNORM (1)", fn, p->norm_type);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (p->rows < 1 || p->hidden < 1) {
    tep::set_error("%s: rows = %lld, hidden = %lld; need both >= 1", fn, p->rows, p->hidden);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (!is_hp(x_dtype) || !is_hp(p->w_dtype)) {
    tep::set_error("%s: x_dtype = %d, w_dtype = %d; need TEP_FLOAT32 (0), TEP_FLOAT16 (1) or TEP_BFLOAT16 (2)", fn,
                   x_dtype, p->w_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (p->gamma == nullptr || (p->norm_type == TEP_RMSNORM && p->beta != nullptr)) {
    tep::set_error("%s: gamma must be non-NULL, and beta NULL for RMSNorm", fn);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  return TEP_SUCCESS;
}

template <typename T>
void launch_fwd_for(bool rms, const FwdArgs& a, cudaStream_t s) {
  if (rms) {
    launch_fwd<T, true>(a, s);
  } else {
    launch_fwd<T, false>(a, s);
  }
}

template <typename T>
tep_status launch_bwd_for(bool rms, const BwdPlan& plan, const BwdArgs& a, void* dg, void* db, cudaStream_t s) {
  return rms ? launch_bwd<T, true>(plan, a, dg, db, s) : launch_bwd<T, false>(plan, a, dg, db, s);
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

extern "C" tep_status tep_norm_bwd_workspace_size(const tep_norm_params* p, int x_dtype, size_t* bytes) {
  tep_status status = check_params("tep_norm_bwd_workspace_size", p, x_dtype);
  if (status != TEP_SUCCESS) return status;
  if (bytes == nullptr) {
    tep::set_error("tep_norm_bwd_workspace_size: bytes is NULL");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  const bool rms = p->norm_type == TEP_RMSNORM;
  BwdPlan plan;
  status = plan_bwd_any(x_dtype, rms, p->rows, p->hidden, &plan);
  if (status != TEP_SUCCESS) return status;
  *bytes = workspace_bytes(plan, rms, p->hidden);
  return TEP_SUCCESS;
}

extern "C" tep_status tep_norm_bwd(const tep_norm_params* p, const void* dy, const void* x, int x_dtype,
                                   const float* mu, const float* rsigma, void* dx, void* dgamma, void* dbeta,
                                   void* workspace, size_t workspace_size, void* stream) {
  const char* fn = "tep_norm_bwd";
  tep_status status = check_params(fn, p, x_dtype);
  if (status != TEP_SUCCESS) return status;
  const bool rms = p->norm_type == TEP_RMSNORM;
  if (dy == nullptr || x == nullptr || rsigma == nullptr || dx == nullptr || dgamma == nullptr ||
      workspace == nullptr || (!rms && mu == nullptr) || (rms && (mu != nullptr || dbeta != nullptr))) {
    tep::set_error("%s: dy, x, rsigma, dx, dgamma, workspace (and mu for LayerNorm) must be non-NULL; mu and dbeta "
                   "NULL for RMSNorm", fn);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (!aligned(workspace, 16)) {
    tep::set_error("%s: workspace is not 16-byte aligned", fn);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  BwdPlan plan;
  status = plan_bwd_any(x_dtype, rms, p->rows, p->hidden, &plan);
  if (status != TEP_SUCCESS) return status;
  const size_t need = workspace_bytes(plan, rms, p->hidden);
  if (workspace_size < need) {
    tep::set_error("%s: workspace has %zu bytes; need %zu (tep_norm_bwd_workspace_size)", fn, workspace_size, need);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  BwdArgs a;
  a.dy = dy;
  a.x = x;
  a.mu = mu;
  a.rsigma = rsigma;
  a.dx = dx;
  a.gamma = p->gamma;
  a.ws_dgamma = static_cast<float*>(workspace);
  a.ws_dbeta = dbeta != nullptr ? a.ws_dgamma + plan.partials * p->hidden : nullptr;
  a.rows = p->rows;
  a.hidden = p->hidden;
  a.rows_per_split = 0;
  a.w_dtype = p->w_dtype;
  a.zero_centered = p->zero_centered_gamma != 0;
  a.vec = p->hidden % kVec == 0 && aligned(dy, 16) && aligned(x, 16) && aligned(dx, 16) && aligned(p->gamma, 16);
  auto s = static_cast<cudaStream_t>(stream);
  switch (x_dtype) {
    case TEP_FLOAT16: return launch_bwd_for<__half>(rms, plan, a, dgamma, dbeta, s);
    case TEP_BFLOAT16: return launch_bwd_for<__nv_bfloat16>(rms, plan, a, dgamma, dbeta, s);
    default: return launch_bwd_for<float>(rms, plan, a, dgamma, dbeta, s);
  }
}
