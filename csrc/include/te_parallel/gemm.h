/*
 * te_parallel GEMM: one cuBLASLt matmul (FP8, or bf16/fp16) with the epilogue torch._scaled_mm lacks.
 *
 * Row-major, the layout of a linear layer (A = activations, B = weight):
 *   D[m, n] = scale_a[0] * scale_b[0] * (A[m, k] · B[n, k]ᵀ)  (+ bias[n])  (+ C[m, n])
 * accumulated in fp32; C is added in the fp32 epilogue and D rounded once. The C term is what
 * comm-GEMM overlap needs: the owner of a reduce-scatter chunk adds the partial it received while
 * its own partial is computed, so no separate pass sums them (tep_comm_gemm_rs). The scales are
 * FP8's only.
 *
 * cuBLASLt is not linked: it is opened at run time from the process (torch has loaded it) or by name
 * (libcublasLt.so.13, .so.12, .so; TE_PARALLEL_CUBLASLT=<path> overrides), so the library still
 * imports on machines without CUDA libraries. Descriptors and the heuristic's algorithms (its first 8
 * candidates; the first runs unless tep_gemm_tune / tep_gemm_choose picked another) are cached per
 * shape / dtypes / epilogue / pointer alignment, so a call after the first costs no heuristic query.
 */
#ifndef TE_PARALLEL_GEMM_H_
#define TE_PARALLEL_GEMM_H_

#include <stddef.h>

#include "te_parallel/te_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 if cuBLASLt could be opened (loads it on first call), else 0 with the reason in tep_last_error(). */
TEP_API int tep_gemm_available(void);

/*
 * a: [m, k], b: [n, k], both row-major contiguous: FP8 (a_dtype/b_dtype TEP_FLOAT8_E4M3/E5M2, not both
 * E5M2; m, n, k multiples of 16; scale_a, scale_b device fp32 scalars, the operands' scale_inv) or
 * both bf16 / both fp16 (scales NULL; d of the same dtype or fp32). d: [m, n] row-major of d_dtype
 * (TEP_FLOAT32/FLOAT16/BFLOAT16). c: NULL or [m, n] of d_dtype (may equal d). bias: NULL or [n] of
 * d_dtype, fp16/bf16 d only. fast_accum: 1 for cuBLASLt's FAST_ACCUM (FP8). workspace: device memory
 * of workspace_bytes (4 MiB or more recommended), used by no other work in flight. Asynchronous on
 * `stream` (the caller's current device).
 */
TEP_API tep_status tep_gemm(const void* a, int a_dtype, const void* b, int b_dtype, long long m, long long n,
                                long long k, const float* scale_a, const float* scale_b, const void* c, void* d,
                                int d_dtype, const void* bias, int fast_accum, void* workspace,
                                size_t workspace_bytes, void* stream);

/*
 * Times the plan's candidate algorithms (cuBLASLt's heuristic ranks up to 8) on these arguments and
 * makes the fastest the one tep_gemm runs for them from now on. The arguments are tep_gemm's (d is
 * written, with c added, by every candidate: pass scratch or a c that is not d); `rounds` (1..16)
 * passes over the candidates in turn, each timing `reps` calls back to back with CUDA events (a GPU at
 * its power cap runs a sustained GEMM slower than a lone one); a candidate's time is its median.
 * ms_out[kMax = 8] receives the times (-1 for a candidate that failed to launch), num_out how many
 * candidates there are, chosen_out the index now chosen (0 is the heuristic's own pick).
 * Synchronizes with `stream`. Tuning changes which kernel computes D, so D's last bits can differ
 * from the untuned call's (a different accumulation order or split).
 */
TEP_API tep_status tep_gemm_tune(const void* a, int a_dtype, const void* b, int b_dtype, long long m, long long n,
                                 long long k, const float* scale_a, const float* scale_b, const void* c, void* d,
                                 int d_dtype, const void* bias, int fast_accum, void* workspace,
                                 size_t workspace_bytes, void* stream, int rounds, int reps, float* ms_out,
                                 int* num_out, int* chosen_out);

/* Makes candidate `index` the one tep_gemm runs for these arguments (the plan is made if missing): to
 * compare candidates, or to restore the heuristic's pick (0). No GPU work. */
TEP_API tep_status tep_gemm_choose(const void* a, int a_dtype, const void* b, int b_dtype, long long m, long long n,
                                   long long k, const void* c, const void* d, int d_dtype, const void* bias,
                                   int fast_accum, size_t workspace_bytes, int index);

/*
 * *workspace = the workspace of GEMMs issued on `stream` of `device` (workspace_bytes of device memory):
 * made with cudaMalloc on first use and kept for the process, one per (device, stream), since two GEMMs
 * in flight on different streams must not share one. It is allocated outside any caching allocator, so no
 * memory pool that a CUDA graph routes allocations to (torch's graph pools) ever holds it. *workspace = NULL
 * while `stream` is being captured into a CUDA graph and has none yet (a capture may not cudaMalloc): the
 * caller passes a temporary of its own to that GEMM.
 */
TEP_API tep_status tep_gemm_workspace(int device, void* stream, size_t workspace_bytes, void** workspace);

/* Number of cached plans (descriptors + algorithm), for tests. */
TEP_API long long tep_gemm_cached_plans(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TE_PARALLEL_GEMM_H_ */
