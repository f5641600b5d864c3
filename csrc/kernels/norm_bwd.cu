// LayerNorm / RMSNorm backward (C API and math: te_parallel/norm.h; chunks and thread ownership:
// norm_common.cuh).
//
// dx needs two row sums, mean(dy*g) and mean(dy*g * xhat), reduced together. For hidden <= 8192 the
// dx kernel also accumulates dgamma/dbeta in registers over the rows of its persistent block and
// writes one fp32 partial row per row slot; wider rows leave dgamma/dbeta to a column kernel that
// re-reads x and dy (x and dy of one thread would not fit in registers next to the accumulators).
// A fixed-order sum over the partials finishes both: deterministic.
#include "norm_common.cuh"

namespace {

using namespace tep::norm;  // NOLINT: this file's kernels are built from those pieces

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

// One chunk of x or dy as loaded: a 2-byte type keeps its 16 raw bytes (4 registers, converted where
// used), fp32 its 8 values. A row held raw takes half the registers of its fp32 values, which leaves
// room to load the next row while this one is reduced.
template <typename T>
struct RawChunk {
  uint4 bits;
  __device__ __forceinline__ float at(int k) const { return to_float(reinterpret_cast<const T*>(&bits)[k]); }
  __device__ __forceinline__ void zero() { bits = make_uint4(0u, 0u, 0u, 0u); }
  __device__ __forceinline__ void load(const T* __restrict__ row, int64_t col, int64_t hidden, bool vec) {
    if (vec) {
      bits = *reinterpret_cast<const uint4*>(row + col);
    } else {
      T* e = reinterpret_cast<T*>(&bits);
#pragma unroll
      for (int k = 0; k < kVec; ++k) e[k] = col + k < hidden ? row[col + k] : from_float<T>(0.f);
    }
  }
};

template <>
struct RawChunk<float> {
  float v[kVec];
  __device__ __forceinline__ float at(int k) const { return v[k]; }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = 0.f;
  }
  __device__ __forceinline__ void load(const float* __restrict__ row, int64_t col, int64_t hidden, bool vec) {
    load_chunk(row, col, hidden, vec, v);
  }
};

// The kVecs chunks of x and dy that this thread owns in `row` (zeros for a row past the end).
template <typename T, int kVecs>
__device__ __forceinline__ void load_row_chunks(const BwdArgs& a, int64_t row, int64_t nchunks, RawChunk<T> (&xr)[kVecs],
                                                RawChunk<T> (&dr)[kVecs]) {
  const bool valid = row < a.rows;
  const int64_t offset = (valid ? row : 0) * a.hidden;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (valid && c < nchunks) {
      xr[i].load(static_cast<const T*>(a.x) + offset, c * kVec, a.hidden, a.vec);
      dr[i].load(static_cast<const T*>(a.dy) + offset, c * kVec, a.hidden, a.vec);
    } else {
      xr[i].zero();
      dr[i].zero();
    }
  }
}

// dx of rows in registers (x and dy: kVecs chunks per thread, held raw); gamma sits in registers for
// the whole kernel. With kWgrad the grid is persistent (every block visits many rows): with 2-byte x
// the next row of this row slot is loaded before this one's row sums, so its loads are in flight
// during the block's reduction, and this row slot's partial dgamma/dbeta over all the rows it visits
// is written to row blockIdx.x * blockDim.y + threadIdx.y of the workspace (every slot writes its
// row, zeros if it saw no row). dy*gamma is rounded to fp32 once (no fused multiply-add) in both of
// its uses, so that dx is exactly zero where dy*gamma equals its row mean and xhat is zero.
template <typename T, bool kRms, int kVecs, bool kWgrad>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_kernel(BwdArgs a) {
  __shared__ float2 red[kMaxWarps];
  constexpr int kAcc = kWgrad ? kVecs : 1;
  constexpr bool kPrefetch = kWgrad && sizeof(T) == 2;  // (fp32 rows would not fit twice in registers)
  T* dx = static_cast<T*>(a.dx);
  const int64_t hidden = a.hidden, nchunks = (hidden + kVec - 1) / kVec;
  const float fh = static_cast<float>(hidden);
  float dg[kAcc][kVec], db[kAcc][kVec], g[kVecs][kVec];
#pragma unroll
  for (int i = 0; i < kAcc; ++i)
#pragma unroll
    for (int k = 0; k < kVec; ++k) dg[i][k] = db[i][k] = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (c < nchunks) {
      load_chunk_any(a.gamma, a.w_dtype, c * kVec, hidden, a.vec, g[i]);
#pragma unroll
      for (int k = 0; k < kVec; ++k) g[i][k] = a.zero_centered ? __fadd_rn(g[i][k], 1.f) : g[i][k];
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) g[i][k] = 0.f;
    }
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  RawChunk<T> xr[kVecs], dr[kVecs];
  load_row_chunks<T, kVecs>(a, static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y, nchunks, xr, dr);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < a.rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < a.rows;
    const int64_t offset = (valid ? row : 0) * hidden;
    const float mu = (!kRms && valid) ? a.mu[row] : 0.f;
    const float rs = valid ? a.rsigma[row] : 0.f;
    RawChunk<T> xn[kVecs], dn[kVecs];
    if constexpr (kPrefetch) load_row_chunks<T, kVecs>(a, row + stride, nchunks, xn, dn);
    float2 s = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {  // (elements past the row: x, dy and gamma are zeros)
        const float xhat = kRms ? xr[i].at(k) * rs : (xr[i].at(k) - mu) * rs;
        const float dyv = dr[i].at(k);
        const float dyg = __fmul_rn(dyv, g[i][k]);
        s.x += dyg;
        s.y += dyg * xhat;
        if constexpr (kWgrad) {
          dg[i][k] += dyv * xhat;
          if (!kRms) db[i][k] += dyv;
        }
      }
    }
    s = row_sum2(s, red);
    const float m1 = s.x / fh, m2 = s.y / fh;
    if (valid) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int64_t c = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
        if (c >= nchunks) continue;
        float d[kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float xhat = kRms ? xr[i].at(k) * rs : (xr[i].at(k) - mu) * rs;
          const float dyg = __fmul_rn(dr[i].at(k), g[i][k]);
          d[k] = kRms ? rs * (dyg - xhat * m2) : rs * (dyg - m1 - xhat * m2);
        }
        store_chunk(dx + offset, c * kVec, hidden, a.vec, d);
      }
    }
    if constexpr (kPrefetch) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        xr[i] = xn[i];
        dr[i] = dn[i];
      }
    } else {
      load_row_chunks<T, kVecs>(a, row + stride, nchunks, xr, dr);
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
// Host side

// Backward: 1 or 2 chunks per thread keep x, dy and the dgamma/dbeta accumulators in registers
// (hidden <= 8192); 4 chunks keep x and dy only (the column kernel does dgamma/dbeta).
constexpr int kBwdCaps[3] = {128, 512, 512};

// The register kernel for a row shape with 1, 2 or 4 chunks per thread.
template <typename T, bool kRms>
const void* bwd_kernel(const RowShape& sh) {
  switch (sh.vecs) {
    case 1: return reinterpret_cast<const void*>(norm_bwd_kernel<T, kRms, 1, true>);
    case 2: return reinterpret_cast<const void*>(norm_bwd_kernel<T, kRms, 2, true>);
    default: return reinterpret_cast<const void*>(norm_bwd_kernel<T, kRms, 4, false>);
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
    const void* kernel = bwd_kernel<T, kRms>(sh);
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
  if (sh.vecs == 0) {
    norm_bwd_looped_kernel<T, kRms><<<plan.grid, block, 0, stream>>>(a);
  } else {
    auto kernel = reinterpret_cast<void (*)(BwdArgs)>(bwd_kernel<T, kRms>(sh));
    kernel<<<plan.grid, block, 0, stream>>>(a);
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

template <typename T>
tep_status launch_bwd_for(bool rms, const BwdPlan& plan, const BwdArgs& a, void* dg, void* db, cudaStream_t s) {
  return rms ? launch_bwd<T, true>(plan, a, dg, db, s) : launch_bwd<T, false>(plan, a, dg, db, s);
}

}  // namespace

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
