// Thread-tile building blocks of the elementwise kernels that emit FP8 with a transposed copy
// (cast_transpose.cu, activation*.cu). Internal: not part of the public C API.
//
// Layout. A block of 128 threads (4 warps) covers a 64-row x 128-column tile of the "iteration"
// matrix; warp w covers rows 32*(w/2).. and columns 64*(w%2)..; lane l covers the 8x8 sub-tile at rows
// 8*(l/8).., columns 8*(l%8).. of its warp. So one warp instruction
//   - reads 4 rows x 8 threads x 16 B = 4 full 128-byte lines of a 2-byte input (8 loads per thread
//     and input, 128 B in flight per thread),
//   - writes 4 rows x 64 B of the row-major FP8 output (8-byte stores),
//   - writes 8 rows x 32 B of the transposed FP8 output (8-byte stores of 8 consecutive rows of one
//     column: the 8x8 byte block is transposed in registers with byte permutes),
// so every 32-byte sector it touches is used whole, without staging through shared memory.
//
// Two paths per sub-tile. Full sub-tiles of a vector-aligned layout take the unrolled fast path
// (16-byte loads kept as raw vectors until used, packed FP8 words). Sub-tiles on the right / bottom
// edge, or layouts that are not 16-byte aligned, take a rolled element-by-element loop (small code,
// few registers); it computes every element with the same instructions, so the bytes never depend on
// which path ran.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common.h"
#include "convert.cuh"

namespace tep {
namespace tile {

constexpr int kSub = 8;           // a thread's sub-tile is kSub x kSub
constexpr int kThreads = 128;     // threads per block
constexpr int kBlockRows = 64;    // block tile
constexpr int kBlockCols = 128;
constexpr int kMaxGridY = 65535;  // blocks stride over row tiles beyond this
static_assert(kThreads == kBlockCols, "block_colsum gives each thread one column");
static_assert(kThreads == 128 && kBlockRows == 64 && kBlockCols == 128, "thread_pos assumes 2x2 warps of 4x8 lanes");

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

__device__ __forceinline__ bool full_tile(int64_t rows, int64_t r0, int64_t c0, int64_t c_end) {
  return r0 + kSub <= rows && c0 + kSub <= c_end;
}

// ------------------------------------------------------------------------------------------------
// Element conversions and the NaN-propagating max: convert.cuh (re-exported here).
using tep::from_float;
using tep::nan_max;
using tep::to_float;

// v rounded to T and back (round-to-nearest-even): the value an output of type T holds.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}


// fp8 byte of v: round-to-nearest-even, saturating to ±max finite, NaN stays NaN (the conversion
// instruction of sm_89+, the same one the packed fp8x4 below uses).
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint8_t fp8_byte(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFmt));
}
__device__ __forceinline__ uint8_t fp8_byte(float v, bool e5m2) {
  return e5m2 ? fp8_byte<__NV_E5M2>(v) : fp8_byte<__NV_E4M3>(v);
}

// fp8 bytes of (a, b, c, d), a in the lowest byte.
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFmt);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kFmt);
  return lo | (hi << 16);
}

// ------------------------------------------------------------------------------------------------
// Raw 16-byte vectors: 8 elements as loaded, converted to float only where used (keeps 2-byte
// inputs packed two per register).

template <typename T>
struct Raw8 {  // 2-byte types
  uint4 u;
  __device__ __forceinline__ float operator[](int k) const {
    const uint32_t w = (k >> 1) == 0 ? u.x : (k >> 1) == 1 ? u.y : (k >> 1) == 2 ? u.z : u.w;
    const uint16_t h = static_cast<uint16_t>((k & 1) ? (w >> 16) : (w & 0xffffu));
    if constexpr (std::is_same<T, __half>::value) {
      return __half2float(__ushort_as_half(h));
    } else {
      return __uint_as_float(static_cast<uint32_t>(h) << 16);  // bf16 -> fp32 is exact: the high half
    }
  }
};
template <>
struct Raw8<float> {
  float4 a, b;
  __device__ __forceinline__ float operator[](int k) const {
    switch (k) {
      case 0: return a.x;
      case 1: return a.y;
      case 2: return a.z;
      case 3: return a.w;
      case 4: return b.x;
      case 5: return b.y;
      case 6: return b.z;
      default: return b.w;
    }
  }
};

// p must be 16-byte aligned (checked by the launcher).
template <typename T>
__device__ __forceinline__ Raw8<T> load_raw(const T* __restrict__ p) {
  Raw8<T> r;
  if constexpr (sizeof(T) == 2) {
    r.u = *reinterpret_cast<const uint4*>(p);
  } else {
    r.a = reinterpret_cast<const float4*>(p)[0];
    r.b = reinterpret_cast<const float4*>(p)[1];
  }
  return r;
}

// Rows r0..r0+7 at columns c0..c0+7 of a matrix with leading dimension ld (fast path: in bounds).
template <typename T>
__device__ __forceinline__ void load_rows(const T* __restrict__ src, int64_t ld, int64_t r0, int64_t c0,
                                          Raw8<T> (&raw)[kSub]) {
#pragma unroll
  for (int i = 0; i < kSub; ++i) raw[i] = load_raw(src + (r0 + i) * ld + c0);
}

// 8 entries of a vector (e.g. a bias) from c0: 0 beyond c_end or when p is NULL.
template <typename T>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, int64_t c0, int64_t c_end, bool vec,
                                         float (&v)[kSub]) {
  if (p != nullptr && vec && c0 + kSub <= c_end) {
    const Raw8<T> r = load_raw(p + c0);
#pragma unroll
    for (int k = 0; k < kSub; ++k) v[k] = r[k];
  } else {
#pragma unroll
    for (int k = 0; k < kSub; ++k) v[k] = (p != nullptr && c0 + k < c_end) ? to_float(p[c0 + k]) : 0.f;
  }
}

// ------------------------------------------------------------------------------------------------
// Fast-path stores of a full 8x8 sub-tile

// One row of 8 values (exact in T already) into p; vec: one 16-byte store (p 16-byte aligned).
template <typename T>
__device__ __forceinline__ void store_row(T* __restrict__ p, const float (&v)[kSub], bool vec) {
  if (vec) {
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
  } else {
#pragma unroll
    for (int k = 0; k < kSub; ++k) p[k] = from_float<T>(v[k]);
  }
}

// Rows of v (exact in T already) into dst [.., ld] at (r0, c0); vec: 16-byte stores (aligned layout).
template <typename T>
__device__ __forceinline__ void store_rows(T* __restrict__ dst, int64_t ld, int64_t r0, int64_t c0, bool vec,
                                           const float (&v)[kSub][kSub]) {
#pragma unroll
  for (int i = 0; i < kSub; ++i) store_row(dst + (r0 + i) * ld + c0, v[i], vec);
}

// w[h] = FP8 bytes of v[4h..4h+3] * scale: one row of 8.
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ void pack_fp8_row(const float (&v)[kSub], float scale, uint32_t (&w)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
    w[h] = fp8x4<kFmt>(v[4 * h] * scale, v[4 * h + 1] * scale, v[4 * h + 2] * scale, v[4 * h + 3] * scale);
}
__device__ __forceinline__ void pack_fp8_row(const float (&v)[kSub], float scale, bool e5m2, uint32_t (&w)[2]) {
  if (e5m2) {
    pack_fp8_row<__NV_E5M2>(v, scale, w);
  } else {
    pack_fp8_row<__NV_E4M3>(v, scale, w);
  }
}

// w[i][h] = FP8 bytes of v[i][4h..4h+3] * scale.
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ void pack_fp8(const float (&v)[kSub][kSub], float scale, uint32_t (&w)[kSub][2]) {
#pragma unroll
  for (int i = 0; i < kSub; ++i) pack_fp8_row<kFmt>(v[i], scale, w[i]);
}
__device__ __forceinline__ void pack_fp8(const float (&v)[kSub][kSub], float scale, bool e5m2,
                                         uint32_t (&w)[kSub][2]) {
  if (e5m2) {
    pack_fp8<__NV_E5M2>(v, scale, w);
  } else {
    pack_fp8<__NV_E4M3>(v, scale, w);
  }
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

// Packed FP8 rows w of a full sub-tile into out ([rows, ld] row-major) and, transposed, into out_t
// ([ld, rows]: out_t[c * rows + r] = out[r * ld + c]); either may be NULL. vec_out: 8-byte stores into
// out allowed (ld % 8 == 0, 8-aligned); vec_out_t: into out_t (rows % 8 == 0, 8-aligned).
__device__ __forceinline__ void store_fp8_full(const uint32_t (&w)[kSub][2], uint8_t* __restrict__ out,
                                               uint8_t* __restrict__ out_t, int64_t rows, int64_t ld, int64_t r0,
                                               int64_t c0, bool vec_out, bool vec_out_t) {
  if (out != nullptr) {
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      uint8_t* p = out + (r0 + i) * ld + c0;
      if (vec_out) {
        *reinterpret_cast<uint2*>(p) = make_uint2(w[i][0], w[i][1]);
      } else {
#pragma unroll
        for (int k = 0; k < kSub; ++k) p[k] = byte_of(w[i][k >> 2], k & 3);
      }
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
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      uint8_t* p = out_t + (c0 + j) * rows + r0;
      if (vec_out_t) {
        *reinterpret_cast<uint2*>(p) = make_uint2(t[j][0], t[j][1]);
      } else {
#pragma unroll
        for (int i = 0; i < kSub; ++i) p[i] = byte_of(t[j][i >> 2], i & 3);
      }
    }
  }
}

// max(m, max |v|), NaN-propagating (|NaN| is a NaN with the sign bit clear).
__device__ __forceinline__ float abs_max(const float (&v)[kSub][kSub], float m) {
#pragma unroll
  for (int i = 0; i < kSub; ++i)
#pragma unroll
    for (int k = 0; k < kSub; ++k) m = nan_max(m, fabsf(v[i][k]));
  return m;
}

// s[k] = v[0][k] + v[1][k] + ... + v[7][k], summed in that order from 0 (as the edge loops do).
__device__ __forceinline__ void column_sums(const float (&v)[kSub][kSub], float (&s)[kSub]) {
#pragma unroll
  for (int k = 0; k < kSub; ++k) {
    s[k] = 0.f;
#pragma unroll
    for (int i = 0; i < kSub; ++i) s[k] = __fadd_rn(s[k], v[i][k]);  // never contracted into an FMA
  }
}

// ------------------------------------------------------------------------------------------------
// Block reductions (every thread of the block must call them: they synchronise)

// amax[0] = max(amax[0], max over the block of m), one atomic per block. m >= 0 or a positive NaN, so
// comparing the float bits as ints orders them, and a NaN (bits above +inf) wins, as in torch.amax.
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

// s: this thread's column sums over its 8 rows (columns c0..c0+7 of thread_pos). Writes
// ws_row[col_base + t] = the block's sum over its 64 rows of block column t, for the 128 columns t with
// col_base + t < c_end. Fixed order (lanes 8 and 16 apart, then the two warp rows): deterministic.
__device__ __forceinline__ void block_colsum(float (&s)[kSub], float* __restrict__ ws_row, int64_t col_base,
                                             int64_t c_end) {
  __shared__ float part[2][kBlockCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < kSub; ++k) {
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

// dbias[c] = sum over row tiles of ws[rt, c] (the partials block_colsum wrote): 32 columns x 8 row-tile
// strides per block, then the 8 partials of a column in order. Deterministic.
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
    dbias[c] = from_float<TOut>(total);
  }
}

// Bytes of the fp32 workspace of column partial sums for a [rows, cols] iteration matrix.
inline long long colsum_workspace_bytes(long long rows, long long cols) {
  if (rows < 1 || cols < 1) return 0;
  return (rows + kBlockRows - 1) / kBlockRows * cols * static_cast<long long>(sizeof(float));
}

// Folds the workspace into dbias [cols] of dtype TEP_FLOAT32 / FLOAT16 / BFLOAT16 (launch errors are left
// for the caller's cudaGetLastError).
inline void launch_colsum_finalize(const float* ws, long long rows, long long cols, void* dbias, int dbias_dtype,
                                   cudaStream_t s) {
  const long long row_tiles = (rows + kBlockRows - 1) / kBlockRows;
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
}

}  // namespace tile
}  // namespace tep
