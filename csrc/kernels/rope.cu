// Rotary position embedding in one pass (csrc/include/te_parallel/rope.h). A block per position s and run
// of batch rows: the block's sin/cos of the rot angles of position s go to shared memory once (sincosf,
// full precision), then its threads walk the rows x H x half channel pairs, each thread reading a run of
// x[j..] and x[j + half..] (16 bytes each where aligned) and writing both outputs, in fp32, rounded once. Pass-through channels (rot <= j < D) are
// copied. A block takes as many batch rows as give it about kPairsPerBlock pairs, so that few heads per
// row (a KV group's query heads, one key head) still fill its threads and the angles are not recomputed
// for every row.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "convert.cuh"
#include "te_parallel/rope.h"

namespace {

constexpr int kThreads = 256;
constexpr long long kPairsPerBlock = 2048;

// Batch rows per block (see the file comment).
long long rows_per_block(const tep_rope_params& p) {
  const long long per_row = p.h * (p.rot / 2);  // (rot >= 2: tep_rope checks)
  const long long rows = (kPairsPerBlock + per_row - 1) / per_row;
  return rows > p.b ? p.b : rows;
}

// V consecutive channel pairs per thread (16-byte loads and stores where the layout allows, else V = 1);
// the block's index math is 32-bit (a block covers a few thousand pairs).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) rope_kernel(const tep_rope_params p, int rows_per_blk) {
  extern __shared__ float trig[];  // [rot] cos, then [rot] sin
  const int blocks_per_s = static_cast<int>((p.b + rows_per_blk - 1) / rows_per_blk);
  const long long s = blockIdx.x / blocks_per_s;
  const int b0 = static_cast<int>(blockIdx.x % blocks_per_s) * rows_per_blk;
  const int rows = (p.b - b0 < rows_per_blk) ? static_cast<int>(p.b - b0) : rows_per_blk;
  const int rot = p.rot, half = rot / 2;
  for (int j = threadIdx.x; j < rot; j += kThreads) {
    float sn, cs;
    sincosf(p.freqs[s * p.freqs_stride_s + j], &sn, &cs);
    trig[j] = cs;
    trig[rot + j] = sn;
  }
  __syncthreads();
  const T* x = static_cast<const T*>(p.x) + s * p.x_stride_s + b0 * p.x_stride_b;
  T* out = static_cast<T*>(p.out) + s * p.out_stride_s + b0 * p.out_stride_b;
  const float* cs = trig;
  const float* sn = trig + rot;
  const int vecs = half / V, heads = static_cast<int>(p.h), per_row = heads * vecs;
  for (int i = threadIdx.x; i < rows * per_row; i += kThreads) {
    const int row = i / per_row, k = i - row * per_row;
    const int head = k / vecs, j = (k - head * vecs) * V;
    const T* xh = x + row * p.x_stride_b + head * p.x_stride_h;
    T* oh = out + row * p.out_stride_b + head * p.out_stride_h;
    const Pack<T, V> a = *reinterpret_cast<const Pack<T, V>*>(xh + j);
    const Pack<T, V> b = *reinterpret_cast<const Pack<T, V>*>(xh + j + half);
    Pack<T, V> o1, o2;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float x1 = tep::to_float(a.v[e]), x2 = tep::to_float(b.v[e]);
      const int c = j + e;
      float r1, r2;
      if (p.backward) {
        r1 = x1 * cs[c] + x2 * sn[c + half];
        r2 = x2 * cs[c + half] - x1 * sn[c];
      } else {
        r1 = x1 * cs[c] - x2 * sn[c];
        r2 = x2 * cs[c + half] + x1 * sn[c + half];
      }
      o1.v[e] = tep::from_float<T>(r1);
      o2.v[e] = tep::from_float<T>(r2);
    }
    *reinterpret_cast<Pack<T, V>*>(oh + j) = o1;
    *reinterpret_cast<Pack<T, V>*>(oh + j + half) = o2;
  }
  const long long rest = p.d - rot, rest_per_row = p.h * rest;  // pass-through channels
  for (long long i = threadIdx.x; rest > 0 && i < rows * rest_per_row; i += kThreads) {
    const long long row = i / rest_per_row, k = i % rest_per_row;
    const long long head = k / rest, j = rot + k % rest;
    out[row * p.out_stride_b + head * p.out_stride_h + j] = x[row * p.x_stride_b + head * p.x_stride_h + j];
  }
}

// Whether every pair run of V elements is 16-byte aligned in x and out.
template <typename T>
bool vectorizable(const tep_rope_params& p) {
  constexpr long long V = 16 / sizeof(T);
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return (p.rot / 2) % V == 0 && aligned(p.x) && aligned(p.out) && p.x_stride_s % V == 0 && p.x_stride_b % V == 0 &&
         p.x_stride_h % V == 0 && p.out_stride_s % V == 0 && p.out_stride_b % V == 0 && p.out_stride_h % V == 0;
}

template <typename T>
tep_status launch(const tep_rope_params& p, cudaStream_t stream) {
  const size_t smem = 2 * sizeof(float) * static_cast<size_t>(p.rot);
  const long long rows = rows_per_block(p);
  const long long blocks = p.s * ((p.b + rows - 1) / rows);
  auto run = [&](auto kernel) {
    if (smem > 48 * 1024)  // (rot > 6144: the angles take more than the default 48 KB)
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, static_cast<int>(rows));
  };
  if (vectorizable<T>(p)) {
    run(rope_kernel<T, 16 / sizeof(T)>);
  } else {
    run(rope_kernel<T, 1>);
  }
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return TEP_SUCCESS;
  tep::set_error("tep_rope: launch failed: %s: %s", cudaGetErrorName(err), cudaGetErrorString(err));
  return TEP_ERROR_CUDA;
}

}  // namespace

extern "C" tep_status tep_rope(const tep_rope_params* p, void* stream) {
  if (p == nullptr || p->x == nullptr || p->out == nullptr || p->freqs == nullptr) {
    tep::set_error("tep_rope: params, x, out and freqs must not be NULL");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (p->s < 1 || p->b < 1 || p->h < 1 || p->d < 1 || p->rot < 2 || p->rot % 2 || p->rot > p->d ||
      p->rot > 8192 || p->s * p->b > 0x7fffffffLL || p->h * p->d > (1LL << 30)) {
    tep::set_error("tep_rope: shape [%lld, %lld, %lld, %lld] with rot = %d; need sizes >= 1, an even rot in "
                   "[2, min(D, 8192)], S*B < 2^31 and H*D <= 2^30", p->s, p->b, p->h, p->d, p->rot);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  cudaGetLastError();  // drop a stale error of an earlier call so the check is about ours
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->dtype) {
    case TEP_FLOAT32: return launch<float>(*p, s);
    case TEP_FLOAT16: return launch<__half>(*p, s);
    case TEP_BFLOAT16: return launch<__nv_bfloat16>(*p, s);
    default:
      tep::set_error("tep_rope: dtype = %d; need TEP_FLOAT32, TEP_FLOAT16 or TEP_BFLOAT16", p->dtype);
      return TEP_ERROR_INVALID_ARGUMENT;
  }
}
