/*
 * te_parallel C API: dropout whose mask is a function of (seed, offset, element index), so that nothing
 * is stored for backward: the backward pass regenerates the forward's mask.
 *
 * For element i of n, with u_i the uniform 32-bit word i % 4 of Philox4x32-10 (key = seed, counter =
 * {i / 4 as two 32-bit words, offset as two 32-bit words}), element i is kept when u_i < keep_threshold
 * (keep probability keep_threshold / 2^32; tep_dropout_keep_threshold gives it for a drop probability p).
 * With s = 1 / (1 - p) and every element read as fp32:
 *   forward:  out[i] = residual[i] + (kept ? x[i] * s : 0)    (residual NULL: out[i] = kept ? x[i] * s : 0)
 *   backward: out[i] = kept ? x[i] * s : 0                    (x = dL/d(dropout output), residual NULL)
 * rounded once to the dtype (TEP_FLOAT32 / FLOAT16 / BFLOAT16; all three arrays contiguous, that
 * dtype). The mask depends only on (seed, offset, i, keep_threshold): not on the launch, the dtype or
 * the direction. out may alias x or residual. Errors as in te_parallel.h.
 */
#ifndef TE_PARALLEL_DROPOUT_H_
#define TE_PARALLEL_DROPOUT_H_

#include <stdint.h>

#include "te_parallel/te_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* x;
  const void* residual; /* NULL: no residual */
  void* out;
  int dtype;
  long long n;
  float p; /* drop probability, 0 <= p < 1 */
  uint64_t seed, offset;
} tep_dropout_params;

TEP_API tep_status tep_dropout_add(const tep_dropout_params* params, void* stream);

/* The Philox word below which an element is kept, for drop probability p in [0, 1). */
TEP_API uint32_t tep_dropout_keep_threshold(float p);

#ifdef __cplusplus
}
#endif

#endif  // TE_PARALLEL_DROPOUT_H_
