// Thread-tile building blocks of the elementwise kernels that emit FP8 with a transposed copy
// (cast_transpose.cu, activation*.cu). Internal: not part of the public C API.
//
// Layout. A block of 128 threads (4 warps) covers a 64-row x 128-column tile of the "iteration"
// matrix; warp w covers rows 32*(w/2).. and columns 64*(w%2)..; lane l covers the 8x8 sub-tile at rows
// 8*(l/8).., columns 8*(l%8).. of its warp. So one warp instruction
//   - reads 4 rows x 8 threads x 16 B = 4 full 128-byte lines of a 2-byte input (8 loads per thread,
//     128 B in flight per thread),
//   - writes 4 rows x 64 B of the row-major FP8 output (8-byte stores),
//   - writes 8 rows x 32 B of the transposed FP8 output (8-byte stores of 8 consecutive rows of one
//     column: the 8x8 byte block is transposed in registers with byte permutes),
// so every 32-byte sector it touches is used whole, without staging through shared memory.
// Partial sub-tiles (right / bottom edges) and unaligned layouts take guarded element-wise paths that
// compute the same values, so the result never depends on which path ran.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tep {
namespace tile {

constexpr int kSub = 8;          // a thread's sub-tile is kSub x kSub
constexpr int kThreads = 128;    // threads per block
constexpr int kBlockRows = 64;   // block tile
constexpr int kBlockCols = 128;
constexpr int kMaxGridY = 65535;  // blocks stride over row tiles beyond this
static_assert(kThreads == kBlockCols, "block_colsum gives each thread one column");
static_assert(kThreads == 128 && kBlockRows == 64 && kBlockCols == 128, "thread_pos assumes 2x2 warps of 4x8 lanes");

using Tile = float[kSub][kSub];

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

inline unsigned grid_y(long long rows) {
  const long long tiles = (rows + kBlockRows - 1) / kBlockRows;
  return static_cast<unsigned>(tiles < kMaxGridY ? tiles : kMaxGridY);
}

// First row / column of this thread's sub-tile in row tile `row_tile` (column tile = blockIdx.x).
struct Pos {
  int64_t r0, c0;
};
__device__ __forceinline__ Pos thread_pos(int64_t row_tile) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  return {row_tile * kBlockRows + (warp >> 1) * 32 + (lane >> 3) * kSub,
          static_cast<int64_t>(blockIdx.x) * kBlockCols + (warp & 1) * 64 + (lane & 7) * kSub};
}

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

// v rounded to T and back (round-to-nearest-even): the value an output of type T holds.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

// 8 consecutive elements; p must be 16-byte aligned (checked by the launcher).
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, float (&v)[kSub]) {
  if constexpr (sizeof(T) == 2) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kSub; ++k) v[k] = to_float(e[k]);
  } else {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
}

// The first n (<= 0 allowed) of 8 consecutive elements; the rest read as 0.
template <typename T>
__device__ __forceinline__ void load8_guarded(const T* __restrict__ p, int64_t n, float (&v)[kSub]) {
#pragma unroll
  for (int k = 0; k < kSub; ++k) v[k] = k < n ? to_float(p[k]) : 0.f;
}

// 8 consecutive elements; p must be 16-byte aligned.
template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ p, const float (&v)[kSub]) {
  if constexpr (sizeof(T) == 2) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < kSub; ++k) e[k] = from_float<T>(v[k]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// Rows r0.. r0+7, columns c0.. c0+7 of a row-major matrix with leading dimension ld whose valid part
// is [rows, c_end); elements outside read as 0. vec: 16-byte loads allowed (ld % 8 == 0, aligned base).
template <typename T>
__device__ __forceinline__ void load_tile(const T* __restrict__ src, int64_t rows, int64_t ld, int64_t r0,
                                          int64_t c0, int64_t c_end, bool vec, Tile& v) {
  if (vec && r0 + kSub <= rows && c0 + kSub <= c_end) {
#pragma unroll
    for (int i = 0; i < kSub; ++i) load8(src + (r0 + i) * ld + c0, v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kSub; ++i) load8_guarded(src + (r0 + i) * ld + c0, r0 + i < rows ? c_end - c0 : 0, v[i]);
  }
}

// 8 entries of a vector (e.g. a bias) from c0, 0 beyond c_end or when p is NULL.
template <typename T>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, int64_t c0, int64_t c_end, bool vec,
                                         float (&v)[kSub]) {
  if (p == nullptr) {
#pragma unroll
    for (int k = 0; k < kSub; ++k) v[k] = 0.f;
  } else if (vec && c0 + kSub <= c_end) {
    load8(p + c0, v);
  } else {
    load8_guarded(p + c0, c_end - c0, v);
  }
}

// Sets the elements of the sub-tile outside [rows, c_end) to 0 (so they add nothing to amax / sums).
__device__ __forceinline__ void zero_outside(Tile& v, int64_t rows, int64_t r0, int64_t c0, int64_t c_end) {
  if (r0 + kSub <= rows && c0 + kSub <= c_end) return;
#pragma unroll
  for (int i = 0; i < kSub; ++i)
#pragma unroll
    for (int k = 0; k < kSub; ++k)
      if (r0 + i >= rows || c0 + k >= c_end) v[i][k] = 0.f;
}

template <typename T>
__device__ __forceinline__ void store_tile(T* __restrict__ dst, int64_t rows, int64_t ld, int64_t r0, int64_t c0,
                                           int64_t c_end, bool vec, const Tile& v) {
  if (vec && r0 + kSub <= rows && c0 + kSub <= c_end) {
#pragma unroll
    for (int i = 0; i < kSub; ++i) store8(dst + (r0 + i) * ld + c0, v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kSub; ++i)
#pragma unroll
      for (int k = 0; k < kSub; ++k)
        if (r0 + i < rows && c0 + k < c_end) dst[(r0 + i) * ld + c0 + k] = from_float<T>(v[i][k]);
  }
}

// fp8 bytes of (a, b, c, d), a in the lowest byte; round-to-nearest-even, saturating to ±max finite,
// NaN stays NaN (the one conversion instruction of sm_89+; identical to __nv_cvt_float_to_fp8).
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFmt);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kFmt);
  return lo | (hi << 16);
}

__device__ __forceinline__ uint8_t byte_of(uint32_t w, int k) { return static_cast<uint8_t>(w >> (8 * k)); }

// 4x4 byte transpose: inputs are rows (byte k = column k), outputs are columns (byte k = row k).
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t& c0,
                                             uint32_t& c1, uint32_t& c2, uint32_t& c3) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140);  // a0 b0 a1 b1
  const uint32_t ab_hi = __byte_perm(a, b, 0x7362);  // a2 b2 a3 b3
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140);
  const uint32_t cd_hi = __byte_perm(c, d, 0x7362);
  c0 = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
  c1 = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
  c2 = __byte_perm(ab_hi, cd_hi, 0x5410);
  c3 = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// Writes fp8(v * scale) of the sub-tile to out ([rows, ld] row-major, valid columns < c_end) and its
// transpose to out_t ([ld, rows] row-major: out_t[c * rows + r] = out[r * ld + c]); either may be
// NULL. vec_out: 8-byte stores into out allowed (ld % 8 == 0, 8-aligned); vec_out_t: into out_t
// (rows % 8 == 0, 8-aligned).
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ void store_fp8_tile(const Tile& v, float scale, uint8_t* __restrict__ out,
                                               uint8_t* __restrict__ out_t, int64_t rows, int64_t ld, int64_t r0,
                                               int64_t c0, int64_t c_end, bool vec_out, bool vec_out_t) {
  uint32_t w[kSub][2];  // w[i][h]: row i, columns 4h..4h+3
#pragma unroll
  for (int i = 0; i < kSub; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      w[i][h] = fp8x4<kFmt>(v[i][4 * h] * scale, v[i][4 * h + 1] * scale, v[i][4 * h + 2] * scale,
                            v[i][4 * h + 3] * scale);
  const bool full = r0 + kSub <= rows && c0 + kSub <= c_end;
  if (out != nullptr) {
    if (full && vec_out) {
#pragma unroll
      for (int i = 0; i < kSub; ++i) *reinterpret_cast<uint2*>(out + (r0 + i) * ld + c0) = make_uint2(w[i][0], w[i][1]);
    } else {
#pragma unroll
      for (int i = 0; i < kSub; ++i)
#pragma unroll
        for (int k = 0; k < kSub; ++k)
          if (r0 + i < rows && c0 + k < c_end) out[(r0 + i) * ld + c0 + k] = byte_of(w[i][k >> 2], k & 3);
    }
  }
  if (out_t != nullptr) {
    uint32_t t[kSub][2];  // t[j][g]: column j, rows 4g..4g+3
#pragma unroll
    for (int g = 0; g < 2; ++g)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        transpose4x4(w[4 * g][h], w[4 * g + 1][h], w[4 * g + 2][h], w[4 * g + 3][h], t[4 * h][g], t[4 * h + 1][g],
                     t[4 * h + 2][g], t[4 * h + 3][g]);
    if (full && vec_out_t) {
#pragma unroll
      for (int j = 0; j < kSub; ++j) *reinterpret_cast<uint2*>(out_t + (c0 + j) * rows + r0) = make_uint2(t[j][0], t[j][1]);
    } else {
#pragma unroll
      for (int j = 0; j < kSub; ++j)
#pragma unroll
        for (int i = 0; i < kSub; ++i)
          if (r0 + i < rows && c0 + j < c_end) out_t[(c0 + j) * rows + r0 + i] = byte_of(t[j][i >> 2], i & 3);
    }
  }
}

// max(m, max |v|), NaN-propagating (|NaN| is a NaN with the sign bit clear).
__device__ __forceinline__ float abs_max(const Tile& v, float m) {
#pragma unroll
  for (int i = 0; i < kSub; ++i)
#pragma unroll
    for (int k = 0; k < kSub; ++k) m = nan_max(m, fabsf(v[i][k]));
  return m;
}

// amax[0] = max(amax[0], max over the block of m), one atomic per block. m >= 0 or a positive NaN, so
// comparing the float bits as ints orders them, and a NaN (bits above +inf) wins, as in torch.amax.
// Every thread of the block must call it (it synchronises).
__device__ __forceinline__ void block_amax_atomic(float m, float* amax) {
  __shared__ float warp_max[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = warp_max[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) b = nan_max(b, warp_max[w]);
    atomicMax(reinterpret_cast<int*>(amax), __float_as_int(b));
  }
}

// ws_row[col_base + t] = sum over the block's 64 rows of column t of the block tile, for the 128
// columns t with col_base + t < c_end. Fixed summation order (8 rows in a thread, then lanes 8 and 16
// apart, then the two warp rows): deterministic. Every thread must call it (it synchronises).
__device__ __forceinline__ void block_colsum(const Tile& v, float* __restrict__ ws_row, int64_t col_base,
                                             int64_t c_end) {
  __shared__ float part[2][kBlockCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float s[kSub];
#pragma unroll
  for (int k = 0; k < kSub; ++k) {
    s[k] = v[0][k];
#pragma unroll
    for (int i = 1; i < kSub; ++i) s[k] += v[i][k];
    s[k] += __shfl_xor_sync(0xffffffffu, s[k], 8);
    s[k] += __shfl_xor_sync(0xffffffffu, s[k], 16);
  }
  if (lane < 8) {
#pragma unroll
    for (int k = 0; k < kSub; ++k) part[warp >> 1][(warp & 1) * 64 + lane * kSub + k] = s[k];
  }
  __syncthreads();
  const int t = threadIdx.x;  // kThreads == kBlockCols: one column per thread
  if (col_base + t < c_end) ws_row[col_base + t] = part[0][t] + part[1][t];
  __syncthreads();  // `part` is reused by the next call
}

}  // namespace tile
}  // namespace tep
