// The IPC communicator of csrc/include/te_parallel/comm_gemm_overlap.h.
//
// Stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32 / cuStreamBatchMemOp) are
// driver API; they are fetched through cudaGetDriverEntryPointByVersion so the library links no
// libcuda.so (it must import on machines without a driver). All three are captured into CUDA graphs
// as memory-operation nodes, with the values given here.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <new>
#include <vector>

#include "../kernels/common.h"
#include "te_parallel/comm_gemm_overlap.h"
#include "te_parallel/gemm.h"

namespace {

using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

constexpr size_t kAlign = 256;

// What each rank publishes in the bootstrap exchange (fixed size, plain bytes).
struct PeerInfo {
  cudaIpcMemHandle_t handle;
  int device;
  int rank;
  unsigned long long data_bytes;  // so that every rank can check they all asked for the same sizes
  int num_flags;
  int pad;
};

bool cuda_ok(cudaError_t err, const char* what, int rank) {
  if (err == cudaSuccess) return true;
  cudaGetLastError();
  tep::set_error("comm_gemm_overlap (rank %d): %s failed: %s", rank, what, cudaGetErrorString(err));
  return false;
}

struct MemOps {
  WriteValue32 write = nullptr;
  WaitValue32 wait = nullptr;
  BatchMemOp batch = nullptr;
};

bool load_stream_memops(MemOps* ops, int rank) {
  static MemOps s_ops;
  if (!s_ops.write || !s_ops.wait || !s_ops.batch) {
    const char* names[3] = {"cuStreamWriteValue32", "cuStreamWaitValue32", "cuStreamBatchMemOp"};
    void* fns[3] = {nullptr, nullptr, nullptr};
    for (int i = 0; i < 3; ++i) {
      cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
      cudaError_t e = cudaGetDriverEntryPointByVersion(names[i], &fns[i], 12000, cudaEnableDefault, &q);
      if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fns[i]) {
        cudaGetLastError();
        tep::set_error("comm_gemm_overlap (rank %d): the driver has no %s (stream memory operations need CUDA "
                       "12+ drivers)", rank, names[i]);
        return false;
      }
    }
    s_ops.write = reinterpret_cast<WriteValue32>(fns[0]);
    s_ops.wait = reinterpret_cast<WaitValue32>(fns[1]);
    s_ops.batch = reinterpret_cast<BatchMemOp>(fns[2]);
  }
  *ops = s_ops;
  return true;
}

CUstreamBatchMemOpParams wait_op(uint32_t* flag, uint32_t value, unsigned int how) {
  CUstreamBatchMemOpParams p;
  std::memset(&p, 0, sizeof(p));
  p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
  p.waitValue.address = reinterpret_cast<CUdeviceptr>(flag);
  p.waitValue.value = value;
  p.waitValue.flags = how;
  return p;
}

// Default flags: a memory fence precedes the write, so the stream's earlier writes (copies into the
// peer's memory, earlier flag writes of the same batch) are visible before the value is.
CUstreamBatchMemOpParams write_op(uint32_t* flag, uint32_t value) {
  CUstreamBatchMemOpParams p;
  std::memset(&p, 0, sizeof(p));
  p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  p.writeValue.address = reinterpret_cast<CUdeviceptr>(flag);
  p.writeValue.value = value;
  p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return p;
}

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

struct tep_comm {
  int rank = 0;
  int world = 0;
  int device = -1;
  size_t data_bytes = 0;
  int num_flags = 0;
  char* local = nullptr;            // own allocation: [data | flags]
  std::vector<char*> bases;         // every rank's allocation as mapped here (own = local)
  MemOps ops;
  std::vector<cudaEvent_t> events;  // reused by the fused ops (tep_comm_gemm_rs), created on first use
};

extern "C" {

tep_status tep_comm_create(int rank, int world_size, size_t buffer_bytes, int num_flags,
                           tep_bootstrap_allgather allgather, void* ctx, tep_comm** out) {
  if (out == nullptr || allgather == nullptr || world_size < 1 || rank < 0 || rank >= world_size ||
      num_flags < 1 || buffer_bytes == 0) {
    tep::set_error("tep_comm_create: got rank=%d world_size=%d buffer_bytes=%zu num_flags=%d%s; need "
                   "0 <= rank < world_size, buffer_bytes > 0, num_flags >= 1, an allgather and an output",
                   rank, world_size, buffer_bytes, num_flags, allgather ? "" : " and no allgather");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  *out = nullptr;
  tep_comm* comm = new (std::nothrow) tep_comm;
  if (!comm) {
    tep::set_error("tep_comm_create: out of host memory");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  comm->rank = rank;
  comm->world = world_size;
  comm->data_bytes = round_up(buffer_bytes);
  comm->num_flags = num_flags;
  auto fail = [&](tep_status status) {
    tep_comm_destroy(comm);
    return status;
  };
  if (!load_stream_memops(&comm->ops, rank)) return fail(TEP_ERROR_CUDA);
  if (!cuda_ok(cudaGetDevice(&comm->device), "cudaGetDevice", rank)) return fail(TEP_ERROR_CUDA);
  const size_t total = comm->data_bytes + round_up(sizeof(uint32_t) * num_flags);
  if (!cuda_ok(cudaMalloc(&comm->local, total), "cudaMalloc of the shared buffer", rank)) return fail(TEP_ERROR_CUDA);
  // Zero the flags (and the data, so a bug reads zeros, not stale bytes) before anyone can see them.
  if (!cuda_ok(cudaMemset(comm->local, 0, total), "cudaMemset", rank) ||
      !cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize", rank)) {
    return fail(TEP_ERROR_CUDA);
  }
  PeerInfo mine;
  std::memset(&mine, 0, sizeof(mine));
  if (!cuda_ok(cudaIpcGetMemHandle(&mine.handle, comm->local), "cudaIpcGetMemHandle", rank)) return fail(TEP_ERROR_CUDA);
  mine.device = comm->device;
  mine.rank = rank;
  mine.data_bytes = comm->data_bytes;
  mine.num_flags = num_flags;
  std::vector<PeerInfo> all(world_size);
  if (allgather(ctx, &mine, all.data(), sizeof(PeerInfo)) != 0) {
    tep::set_error("tep_comm_create (rank %d): the bootstrap all-gather of IPC handles failed", rank);
    return fail(TEP_ERROR_INVALID_ARGUMENT);
  }
  comm->bases.assign(world_size, nullptr);
  for (int peer = 0; peer < world_size; ++peer) {
    const PeerInfo& info = all[peer];
    if (info.rank != peer || info.data_bytes != comm->data_bytes || info.num_flags != num_flags) {
      tep::set_error("tep_comm_create (rank %d): rank %d published rank=%d, %llu bytes, %d flags; this rank "
                     "has %zu bytes, %d flags (every rank must ask for the same sizes)", rank, peer, info.rank,
                     info.data_bytes, info.num_flags, comm->data_bytes, num_flags);
      return fail(TEP_ERROR_INVALID_ARGUMENT);
    }
    if (peer == rank) {
      comm->bases[peer] = comm->local;
      continue;
    }
    void* mapped = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&mapped, info.handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      tep::set_error("comm_gemm_overlap (rank %d): cannot map rank %d's buffer (its device %d, ours %d): %s; "
                     "peer access over NVLink/PCIe within one node is needed", rank, peer, info.device,
                     comm->device, cudaGetErrorString(err));
      return fail(TEP_ERROR_CUDA);
    }
    comm->bases[peer] = static_cast<char*>(mapped);
  }
  *out = comm;
  return TEP_SUCCESS;
}

tep_status tep_comm_destroy(tep_comm* comm) {
  if (comm == nullptr) return TEP_SUCCESS;
  tep_status status = TEP_SUCCESS;
  if (comm->local != nullptr) {
    int current = -1;
    cudaGetDevice(&current);
    if (comm->device >= 0 && current != comm->device) cudaSetDevice(comm->device);
    if (cudaDeviceSynchronize() != cudaSuccess) status = TEP_ERROR_CUDA;
    for (int peer = 0; peer < static_cast<int>(comm->bases.size()); ++peer) {
      if (peer != comm->rank && comm->bases[peer] != nullptr) cudaIpcCloseMemHandle(comm->bases[peer]);
    }
    cudaFree(comm->local);
    for (cudaEvent_t ev : comm->events) cudaEventDestroy(ev);
    cudaGetLastError();
    if (current >= 0 && current != comm->device) cudaSetDevice(current);
    if (status != TEP_SUCCESS) tep::set_error("tep_comm_destroy: device synchronisation failed");
  }
  delete comm;
  return status;
}

void* tep_comm_buffer(const tep_comm* comm, int peer) {
  if (comm == nullptr || peer < 0 || peer >= comm->world) return nullptr;
  return comm->bases[peer];
}

uint32_t* tep_comm_flags(const tep_comm* comm, int peer) {
  if (comm == nullptr || peer < 0 || peer >= comm->world) return nullptr;
  return reinterpret_cast<uint32_t*>(comm->bases[peer] + comm->data_bytes);
}

tep_status tep_comm_copy(tep_comm* comm, void* dst, const void* src, size_t bytes, void* stream) {
  if (comm == nullptr || (bytes > 0 && (dst == nullptr || src == nullptr))) {
    tep::set_error("tep_comm_copy: got a null communicator or pointer");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (bytes == 0) return TEP_SUCCESS;
  // Peer-mapped addresses are in the unified address space: cudaMemcpyDefault lets the runtime route
  // the copy through the copy engines over the peer link.
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  return cuda_ok(err, "cudaMemcpyAsync (peer copy)", comm->rank) ? TEP_SUCCESS : TEP_ERROR_CUDA;
}

tep_status tep_comm_signal(tep_comm* comm, int peer, int flag, uint32_t value, void* stream) {
  if (comm == nullptr || peer < 0 || peer >= comm->world || flag < 0 || flag >= comm->num_flags) {
    tep::set_error("tep_comm_signal: peer=%d flag=%d out of range (world %d, %d flags)", peer, flag,
                   comm ? comm->world : 0, comm ? comm->num_flags : 0);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  // Default flags: the write is preceded by a fence, so this stream's earlier copies into the peer's
  // memory are visible to the peer before it sees the flag.
  CUresult res = comm->ops.write(static_cast<CUstream>(stream),
                                   reinterpret_cast<CUdeviceptr>(tep_comm_flags(comm, peer) + flag), value, 0);
  if (res != CUDA_SUCCESS) {
    tep::set_error("comm_gemm_overlap (rank %d): cuStreamWriteValue32 to rank %d flag %d failed (CUresult %d)",
                   comm->rank, peer, flag, static_cast<int>(res));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}

tep_status tep_comm_wait(tep_comm* comm, int flag, uint32_t value, void* stream) {
  if (comm == nullptr || flag < 0 || flag >= comm->num_flags) {
    tep::set_error("tep_comm_wait: flag=%d out of range (%d flags)", flag, comm ? comm->num_flags : 0);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  CUresult res = comm->ops.wait(static_cast<CUstream>(stream),
                                  reinterpret_cast<CUdeviceptr>(tep_comm_flags(comm, comm->rank) + flag), value,
                                  CU_STREAM_WAIT_VALUE_GEQ);
  if (res != CUDA_SUCCESS) {
    tep::set_error("comm_gemm_overlap (rank %d): cuStreamWaitValue32 on flag %d failed (CUresult %d)", comm->rank,
                   flag, static_cast<int>(res));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}

tep_status tep_comm_claim(tep_comm* comm, const int* flags, int count, void* stream) {
  if (comm == nullptr || flags == nullptr || count < 1 || count > 64) {
    tep::set_error("tep_comm_claim: got %d flags%s; need 1..64 flags and a communicator", count,
                   comm ? "" : " (no communicator)");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  CUstreamBatchMemOpParams ops[128];
  uint32_t* own = tep_comm_flags(comm, comm->rank);
  for (int i = 0; i < count; ++i) {
    if (flags[i] < 0 || flags[i] >= comm->num_flags) {
      tep::set_error("tep_comm_claim: flag %d out of range (%d flags)", flags[i], comm->num_flags);
      return TEP_ERROR_INVALID_ARGUMENT;
    }
    ops[2 * i] = wait_op(own + flags[i], 0, CU_STREAM_WAIT_VALUE_EQ);
    ops[2 * i + 1] = write_op(own + flags[i], 1);
  }
  CUresult res = comm->ops.batch(static_cast<CUstream>(stream), 2 * count, ops, 0);
  if (res != CUDA_SUCCESS) {
    tep::set_error("comm_gemm_overlap (rank %d): cuStreamBatchMemOp (claim of %d flags) failed (CUresult %d)",
                   comm->rank, count, static_cast<int>(res));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}

tep_status tep_comm_release(tep_comm* comm, int flag, int peer, int peer_flag, void* stream) {
  if (comm == nullptr || flag < 0 || flag >= comm->num_flags || peer < 0 || peer >= comm->world || peer_flag < 0 ||
      peer_flag >= comm->num_flags) {
    tep::set_error("tep_comm_release: flag=%d peer=%d peer_flag=%d out of range (world %d, %d flags)", flag, peer,
                   peer_flag, comm ? comm->world : 0, comm ? comm->num_flags : 0);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  // The own clear comes first and the peer's write is fenced after it: the peer sets this flag again
  // only after it has seen its flag cleared, so the clear can never land on top of the next value.
  CUstreamBatchMemOpParams ops[2] = {write_op(tep_comm_flags(comm, comm->rank) + flag, 0),
                                     write_op(tep_comm_flags(comm, peer) + peer_flag, 0)};
  CUresult res = comm->ops.batch(static_cast<CUstream>(stream), 2, ops, 0);
  if (res != CUDA_SUCCESS) {
    tep::set_error("comm_gemm_overlap (rank %d): cuStreamBatchMemOp (release of flag %d, rank %d's flag %d) failed "
                   "(CUresult %d)", comm->rank, flag, peer, peer_flag, static_cast<int>(res));
    return TEP_ERROR_CUDA;
  }
  return TEP_SUCCESS;
}

}  // extern "C"

namespace {

size_t elem_size(int dtype) {
  switch (dtype) {
    case TEP_FLOAT32: return 4;
    case TEP_FLOAT16:
    case TEP_BFLOAT16: return 2;
    default: return 1;  // FP8
  }
}

// Rows [row0, row0 + rows) of A times Bᵀ into d (+ c), on `stream`.
tep_status gemm_rows(const tep_gemm_args* g, long long row0, long long rows, const void* c, void* d, int out_dtype,
                     void* stream) {
  const char* a = static_cast<const char*>(g->a) + row0 * g->k * static_cast<long long>(elem_size(g->a_dtype));
  return tep_gemm(a, g->a_dtype, g->b, g->b_dtype, rows, g->n, g->k, g->scale_a, g->scale_b, c, d, out_dtype,
                  g->bias, g->fast_accum, g->workspace, g->workspace_bytes, stream);
}

bool ensure_events(tep_comm* comm, int count) {
  while (static_cast<int>(comm->events.size()) < count) {
    cudaEvent_t ev;
    if (!cuda_ok(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate", comm->rank)) return false;
    comm->events.push_back(ev);
  }
  return true;
}

}  // namespace

extern "C" {

tep_status tep_comm_gemm_rs(tep_comm* comm, const tep_gemm_args* g, long long m, int out_dtype, void* out,
                            void* received, size_t send_offset, size_t slot_stride, const long long* piece_starts,
                            int num_pieces, int own_group, int ready_flag, int busy_flag, void* stream,
                            void* side_stream) {
  if (comm == nullptr || g == nullptr || out == nullptr || m < 1 || num_pieces < 1 || num_pieces > 64 ||
      own_group < 1 || (num_pieces > 1 && (comm->world != 2 || piece_starts == nullptr)) ||
      (comm->world > 1 && received == nullptr) || g->bias != nullptr) {
    tep::set_error("tep_comm_gemm_rs: got m=%lld num_pieces=%d own_group=%d world=%d%s; need m >= 1, 1..64 pieces "
                   "(more than 1 only at world size 2, with piece_starts), own_group >= 1, out, received and no bias",
                   m, num_pieces, own_group, comm ? comm->world : 0, comm ? "" : " (no communicator)");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (comm->world > 8 && num_pieces == 1) {
    tep::set_error("tep_comm_gemm_rs: world size %d; the fp32 sum takes at most 8 partials", comm->world);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  const size_t part_bytes = static_cast<size_t>(m) * static_cast<size_t>(g->n) * elem_size(out_dtype);
  if (part_bytes > slot_stride || send_offset + comm->world * slot_stride > comm->data_bytes) {
    tep::set_error("tep_comm_gemm_rs: %d partials of %zu bytes at stride %zu from offset %zu do not fit the %zu-byte "
                   "buffer", comm->world, part_bytes, slot_stride, send_offset, comm->data_bytes);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (num_pieces > 1) {
    for (int j = 0; j < num_pieces; ++j) {
      if (piece_starts[j] >= piece_starts[j + 1] || piece_starts[0] != 0 || piece_starts[num_pieces] != m) {
        tep::set_error("tep_comm_gemm_rs: piece_starts must rise strictly from 0 to m=%lld", m);
        return TEP_ERROR_INVALID_ARGUMENT;
      }
    }
  }
  const int me = comm->rank, tp = comm->world;
  const size_t row_bytes = static_cast<size_t>(g->n) * elem_size(out_dtype);
  const size_t nbytes = static_cast<size_t>(m) * row_bytes;
  char* own = comm->local + send_offset;
  char* recv = static_cast<char*>(received);
  cudaStream_t s = static_cast<cudaStream_t>(stream), side = static_cast<cudaStream_t>(side_stream);
  // events[0 .. num_pieces-1]: pulls done (pieces); events[num_pieces]: the side stream's fork from
  // `stream`, then its join back into it (a captured fork must be joined before the capture ends).
  if (!ensure_events(comm, num_pieces + 1)) return TEP_ERROR_CUDA;
  cudaEvent_t fork_join = comm->events[num_pieces];
  tep_status st = TEP_SUCCESS;
#define TEP_TRY(call)              \
  do {                             \
    st = (call);                   \
    if (st != TEP_SUCCESS) return st; \
  } while (0)
  // The side stream writes `received` (fresh memory of the caller's stream): start after its work.
  if (!cuda_ok(cudaEventRecord(fork_join, s), "cudaEventRecord", me) ||
      !cuda_ok(cudaStreamWaitEvent(side, fork_join, 0), "cudaStreamWaitEvent", me))
    return TEP_ERROR_CUDA;
  if (tp > 1) {  // every consumer finished pulling the previous op's partials out of my slots
    int busy[64];
    for (int k = 1; k < tp; ++k) busy[k - 1] = busy_flag + (me + k) % tp;
    TEP_TRY(tep_comm_claim(comm, busy, tp - 1, stream));
  }
  // Issue order (CUDA_DEVICE_MAX_CONNECTIONS=1: all streams feed one hardware queue, where a wait
  // that is not yet satisfied, or a kernel behind a copy, holds back everything issued after it):
  // each pull is issued one step late, after the next GEMM, so a late peer never delays a GEMM that
  // does not need its data; and every signal a peer waits for is issued before any wait of mine.
  auto pull_whole = [&](int k) -> tep_status {  // what rank me-k computed for me at its step k
    const int src = (me - k + tp) % tp;
    tep_status r = tep_comm_wait(comm, ready_flag + src, 1, side_stream);
    if (r == TEP_SUCCESS)
      r = tep_comm_copy(comm, recv + (k - 1) * nbytes, comm->bases[src] + send_offset + me * slot_stride, nbytes,
                        side_stream);
    if (r == TEP_SUCCESS) r = tep_comm_release(comm, ready_flag + src, src, busy_flag + me, side_stream);
    return r;
  };
  if (num_pieces == 1) {
    for (int k = 1; k <= tp; ++k) {
      const int d = (me + k) % tp;
      TEP_TRY(gemm_rows(g, static_cast<long long>(d) * m, m, nullptr, own + d * slot_stride, out_dtype, stream));
      if (d != me) TEP_TRY(tep_comm_signal(comm, d, ready_flag + me, 1, stream));
      if (k > 1) TEP_TRY(pull_whole(k - 1));
    }
    if (!cuda_ok(cudaEventRecord(fork_join, side), "cudaEventRecord", me) ||
        !cuda_ok(cudaStreamWaitEvent(s, fork_join, 0), "cudaStreamWaitEvent", me))
      return TEP_ERROR_CUDA;
    const void* parts[8];
    for (int r = 0; r < tp; ++r) parts[r] = r == me ? own + me * slot_stride : recv + ((me - r + tp) % tp - 1) * nbytes;
    return tep_reduce_sum(parts, tp, out_dtype, out, out_dtype, static_cast<size_t>(m) * g->n, stream);
  }
  const int peer = 1 - me;
  // The peer's pieces first, each signalled as written (piece j: ready value j+1); then the pulls,
  // each once the peer signals that piece (issued after all my GEMMs for the peer: see the issue
  // order above).
  for (int j = 0; j < num_pieces; ++j) {
    const long long a = piece_starts[j], rows = piece_starts[j + 1] - a;
    TEP_TRY(gemm_rows(g, peer * m + a, rows, nullptr, own + peer * slot_stride + a * row_bytes, out_dtype, stream));
    TEP_TRY(tep_comm_signal(comm, peer, ready_flag + me, static_cast<uint32_t>(j + 1), stream));
  }
  for (int j = 0; j < num_pieces; ++j) {
    const long long a = piece_starts[j], rows = piece_starts[j + 1] - a;
    TEP_TRY(tep_comm_wait(comm, ready_flag + peer, static_cast<uint32_t>(j + 1), side_stream));
    TEP_TRY(tep_comm_copy(comm, recv + a * row_bytes, comm->bases[peer] + send_offset + me * slot_stride + a * row_bytes,
                          rows * row_bytes, side_stream));
    if (!cuda_ok(cudaEventRecord(comm->events[j], side), "cudaEventRecord", me)) return TEP_ERROR_CUDA;
  }
  TEP_TRY(tep_comm_release(comm, ready_flag + peer, peer, busy_flag + me, side_stream));
  if (!cuda_ok(cudaEventRecord(fork_join, side), "cudaEventRecord", me)) return TEP_ERROR_CUDA;
  for (int j = 0; j < num_pieces; j += own_group) {  // own rows of pieces j .. j+own_group-1, once pulled
    const int last_piece = j + own_group < num_pieces ? j + own_group - 1 : num_pieces - 1;
    const long long a = piece_starts[j], rows = piece_starts[last_piece + 1] - a;
    if (!cuda_ok(cudaStreamWaitEvent(s, comm->events[last_piece], 0), "cudaStreamWaitEvent", me)) return TEP_ERROR_CUDA;
    TEP_TRY(gemm_rows(g, me * m + a, rows, recv + a * row_bytes, static_cast<char*>(out) + a * row_bytes, out_dtype,
                      stream));
  }
  // The join, after the last GEMM was issued: only work after this op waits for the release.
  return cuda_ok(cudaStreamWaitEvent(s, fork_join, 0), "cudaStreamWaitEvent", me) ? TEP_SUCCESS : TEP_ERROR_CUDA;
}

tep_status tep_comm_ag_gemm(tep_comm* comm, const tep_gemm_args* g, long long m, int out_dtype, void* out,
                            void* gathered, size_t recv_offset, size_t slot_bytes, int ready_flag, int busy_flag,
                            void* stream, void* side_stream) {
  if (comm == nullptr || g == nullptr || out == nullptr || m < 1) {
    tep::set_error("tep_comm_ag_gemm: got m=%lld%s%s; need m >= 1, out and a communicator", m, out ? "" : ", no out",
                   comm ? "" : " (no communicator)");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  const int me = comm->rank, tp = comm->world;
  const size_t a_row = static_cast<size_t>(g->k) * elem_size(g->a_dtype);
  const size_t chunk = static_cast<size_t>(m) * a_row;
  const size_t out_rows = static_cast<size_t>(m) * g->n * elem_size(out_dtype);
  if (chunk > slot_bytes || recv_offset + tp * slot_bytes > comm->data_bytes) {
    tep::set_error("tep_comm_ag_gemm: %d chunks of %zu bytes in %zu-byte slots from offset %zu do not fit the "
                   "%zu-byte buffer", tp, chunk, slot_bytes, recv_offset, comm->data_bytes);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream), side = static_cast<cudaStream_t>(side_stream);
  if (!ensure_events(comm, 2)) return TEP_ERROR_CUDA;
  tep_status st = TEP_SUCCESS;
  // The pushes start once A is ready (the work on `stream` so far), beside the own chunk's GEMM.
  if (!cuda_ok(cudaEventRecord(comm->events[0], s), "cudaEventRecord", me)) return TEP_ERROR_CUDA;
  TEP_TRY(gemm_rows(g, 0, m, nullptr, static_cast<char*>(out) + me * out_rows, out_dtype, stream));
  if (!cuda_ok(cudaStreamWaitEvent(side, comm->events[0], 0), "cudaStreamWaitEvent", me)) return TEP_ERROR_CUDA;
  for (int k = 1; k < tp; ++k) {  // rank me-k multiplies my chunk at its step k: push to it k-th
    const int p = (me - k + tp) % tp;
    const int busy = busy_flag + p;
    TEP_TRY(tep_comm_claim(comm, &busy, 1, side_stream));  // p finished reading my slot of the last gather
    TEP_TRY(tep_comm_copy(comm, comm->bases[p] + recv_offset + me * slot_bytes, g->a, chunk, side_stream));
    TEP_TRY(tep_comm_signal(comm, p, ready_flag + me, 1, side_stream));
  }
  // A (the caller's memory) is read by the side stream: later work on `stream` waits for the pushes
  // (this join also closes the side stream's branch of a captured graph).
  if (!cuda_ok(cudaEventRecord(comm->events[1], side), "cudaEventRecord", me)) return TEP_ERROR_CUDA;
  if (gathered != nullptr)
    TEP_TRY(tep_comm_copy(comm, static_cast<char*>(gathered) + me * chunk, g->a, chunk, stream));
  tep_gemm_args chunk_args = *g;
  for (int k = 1; k < tp; ++k) {
    const int src = (me + k) % tp;
    char* slot = comm->local + recv_offset + src * slot_bytes;
    TEP_TRY(tep_comm_wait(comm, ready_flag + src, 1, stream));
    chunk_args.a = slot;
    TEP_TRY(gemm_rows(&chunk_args, 0, m, nullptr, static_cast<char*>(out) + src * out_rows, out_dtype, stream));
    if (gathered != nullptr)
      TEP_TRY(tep_comm_copy(comm, static_cast<char*>(gathered) + src * chunk, slot, chunk, stream));
    TEP_TRY(tep_comm_release(comm, ready_flag + src, src, busy_flag + me, stream));
  }
  if (!cuda_ok(cudaStreamWaitEvent(s, comm->events[1], 0), "cudaStreamWaitEvent", me)) return TEP_ERROR_CUDA;
#undef TEP_TRY
  return TEP_SUCCESS;
}

}  // extern "C"
