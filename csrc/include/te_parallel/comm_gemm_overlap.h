/*
 * te_parallel comm-GEMM overlap core: a communicator for one tensor-parallel group on one node.
 *
 * Every rank allocates one device buffer (data + 32-bit flags) and maps every peer's buffer through
 * CUDA IPC handles, exchanged by a caller-supplied all-gather (the "bootstrap": torch.distributed's
 * store, MPI, ...). After that the steady state needs no host round trip and no SM:
 *   - data moves with the copy engines (cudaMemcpyAsync between peer-mapped pointers);
 *   - ordering across GPUs uses stream memory operations on the flags: a rank writes a value into a
 *     peer's flag on its stream (after a memory fence, so data written before it is visible first),
 *     and a stream waits until one of its own flags is >= (or ==) a value.
 * Flags are one-slot mailboxes whose values never depend on how many operations came before: a
 * writer sets a flag, and the rank that owns it clears it once it has acted on it (tep_comm_claim,
 * tep_comm_release). Every value a call passes is therefore the same on every call, so the work
 * these functions enqueue can be captured in a CUDA graph and replayed any number of times, mixed
 * with eager calls (the protocol and why replays cannot race: te_parallel/parallel/ub_transport.py).
 * No CUDA multicast objects are created (NCCL_NVLS_ENABLE=0 machines).
 * The primitives launch no GEMM (the caller runs its own between them); the fused calls
 * (tep_comm_gemm_rs, tep_comm_ag_gemm) launch te_parallel's cuBLASLt GEMM (te_parallel/gemm.h).
 */
#ifndef TE_PARALLEL_COMM_GEMM_OVERLAP_H_
#define TE_PARALLEL_COMM_GEMM_OVERLAP_H_

#include <stddef.h>
#include <stdint.h>

#include "te_parallel/te_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tep_comm tep_comm;

/*
 * Bootstrap all-gather: every rank of the group passes `bytes` bytes in `send`; on return `recv`
 * holds world_size * bytes bytes, rank r's at offset r * bytes. Returns 0 on success; non-zero makes
 * tep_comm_create fail (the callback should bound its wait and say why in its own error reporting).
 */
typedef int (*tep_bootstrap_allgather)(void* ctx, const void* send, void* recv, size_t bytes);

/*
 * Collective over the group: allocates `buffer_bytes` of data and `num_flags` zeroed uint32 flags on
 * the calling thread's current device, exchanges IPC handles through `allgather`, and maps every
 * peer's buffer. Fails (TEP_ERROR_CUDA, with the peer rank in the message) if a peer's memory cannot
 * be mapped, e.g. GPUs without peer access or on another node.
 */
TEP_API tep_status tep_comm_create(int rank, int world_size, size_t buffer_bytes, int num_flags,
                                   tep_bootstrap_allgather allgather, void* ctx, tep_comm** comm);

/* Unmaps the peers and frees the buffer after synchronising the device. Collective in spirit: call
 * it on every rank once no peer can still be reading this rank's buffer. NULL is a no-op. */
TEP_API tep_status tep_comm_destroy(tep_comm* comm);

/* Device address of `peer`'s data buffer / flags as mapped in this process (peer == rank: own). */
TEP_API void* tep_comm_buffer(const tep_comm* comm, int peer);
TEP_API uint32_t* tep_comm_flags(const tep_comm* comm, int peer);

/* Copy-engine copy of `bytes` from `src` to `dst` (any mix of local and peer-mapped addresses). */
TEP_API tep_status tep_comm_copy(tep_comm* comm, void* dst, const void* src, size_t bytes, void* stream);

/* On `stream`: fence prior writes of this stream, then set peer's flags[flag] = value. */
TEP_API tep_status tep_comm_signal(tep_comm* comm, int peer, int flag, uint32_t value, void* stream);

/* On `stream`: later work waits until this rank's flags[flag] >= value (no host involvement). */
TEP_API tep_status tep_comm_wait(tep_comm* comm, int flag, uint32_t value, void* stream);

/*
 * On `stream`, as one batch of stream memory operations, for each of the `count` (1..64) own flags
 * in `flags`, in order: wait until flags[f] == 0, then set flags[f] = 1. A producer claims the
 * region it shares with a consumer this way; the consumer's tep_comm_release clears the flag.
 */
TEP_API tep_status tep_comm_claim(tep_comm* comm, const int* flags, int count, void* stream);

/*
 * On `stream`, as one batch: set this rank's flags[flag] = 0, then (fenced, so the clear lands first)
 * set peer's flags[peer_flag] = 0. A consumer that has finished with what `peer` shared clears the
 * ready flag `peer` set and hands the region back to it.
 */
TEP_API tep_status tep_comm_release(tep_comm* comm, int flag, int peer, int peer_flag, void* stream);

/*
 * out[i] = sum_k inputs[k][i], accumulated in fp32 in the order k = 0 .. num_inputs-1, rounded once
 * to out_dtype. inputs: host array of num_inputs (1..8) device pointers, all of in_dtype
 * (fp32/fp16/bf16); out may alias inputs[0]. Asynchronous on `stream`.
 */
TEP_API tep_status tep_reduce_sum(const void* const* inputs, int num_inputs, int in_dtype, void* out,
                                  int out_dtype, size_t numel, void* stream);

/* The GEMM of an overlapped op, as tep_gemm takes it (te_parallel/gemm.h): A [rows, k] holds every
 * chunk's rows, row-major; B [n, k] is the weight. scale_a / scale_b for FP8 operands only. */
typedef struct {
  const void* a;
  int a_dtype;
  const void* b;
  int b_dtype;
  const float* scale_a;
  const float* scale_b;
  long long k;
  long long n;
  const void* bias; /* NULL or [n] of the output dtype (bf16/fp16 output): added by every chunk's GEMM */
  int fast_accum;
  void* workspace;
  size_t workspace_bytes;
} tep_gemm_args;

/*
 * Row-parallel GEMM + reduce-scatter in one call (the whole schedule is enqueued without returning to
 * the caller between steps, which a host-bound layer needs):
 *   out [m, n] = sum over ranks r of rank r's A[me*m : (me+1)*m] · Bᵀ
 * side_stream first waits for the work already on `stream`; `stream` then claims busy_flag + p for
 * every peer p (p finished pulling this rank's previous partials). This rank computes the partial for
 * destination d = me+1, me+2, ..., me (own last) into its shared buffer at send_offset + d*slot_stride
 * and sets d's ready flag ready_flag + me; it pulls what each peer computed for it with the copy
 * engine on side_stream and, after its last pull from src, releases src (clears ready_flag + src and
 * src's busy_flag + me). `stream` waits for side_stream before returning.
 *   num_pieces == 1: whole partials (ready value 1); the tp partials are summed in fp32, in rank
 *     order, into out.
 *   num_pieces > 1 (world_size 2 only): the peer's partial is written and pulled in row pieces
 *     [piece_starts[j], piece_starts[j+1]) (num_pieces+1 entries from 0 to m), piece j signalled with
 *     ready value j+1 and pulled while the next is computed; the own partial is computed `own_group`
 *     pieces per GEMM, each GEMM adding the pulled rows as its C input (one rounding), so there is no
 *     separate sum.
 * g->bias must be NULL (a reduce-scatter adds the bias once, after the sum).
 * received: [world_size-1, m, n] of out_dtype, written on side_stream.
 */
TEP_API tep_status tep_comm_gemm_rs(tep_comm* comm, const tep_gemm_args* g, long long m, int out_dtype, void* out,
                                    void* received, size_t send_offset, size_t slot_stride,
                                    const long long* piece_starts, int num_pieces, int own_group, int ready_flag,
                                    int busy_flag, void* stream, void* side_stream);

/*
 * Column-parallel all-gather + GEMM in one call (ring order, each chunk's GEMM as soon as it lands):
 *   out [world·m, n] rows of rank r = (rank r's A [m, k]) · Bᵀ (+ bias)
 * g->a is this rank's chunk A [m, k]. Its GEMM runs first; meanwhile side_stream claims each peer's
 * busy flag busy_flag + p (p finished reading the previous gather), pushes the chunk with the copy
 * engine into p's buffer at recv_offset + me*slot_bytes and sets p's ready flag ready_flag + me to 1.
 * Then `stream` waits for each peer's chunk (ready_flag + src >= 1) in the order me+1, me+2, ...,
 * multiplies it in place, copies it into gathered (if not NULL: [world·m, k] of A's dtype, the whole
 * gathered A) and releases src (clears ready_flag + src and src's busy_flag + me). `stream` waits for
 * side_stream before returning.
 */
TEP_API tep_status tep_comm_ag_gemm(tep_comm* comm, const tep_gemm_args* g, long long m, int out_dtype, void* out,
                                    void* gathered, size_t recv_offset, size_t slot_bytes, int ready_flag,
                                    int busy_flag, void* stream, void* side_stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TE_PARALLEL_COMM_GEMM_OVERLAP_H_ */
