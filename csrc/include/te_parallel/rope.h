/*
 * te_parallel C API: rotary position embedding (RoPE) on q or k, forward and backward, in one pass.
 *
 * x is a [S][B][H][D] view of device memory (any strides for S, B and H; D contiguous), of dtype
 * TEP_FLOAT32 / FLOAT16 / BFLOAT16; out has the same logical shape and dtype, with its own strides.
 * freqs are the angles, fp32, [S][rot] with row stride freqs_stride_s (rot <= D, even). With
 * half = rot / 2, c_j = cos(freqs[s][j]), s_j = sin(freqs[s][j]), and every element read as fp32:
 *   forward:  out[j]        = x[j] c_j - x[j + half] s_j                     (j < half)
 *             out[j + half] = x[j + half] c_{j+half} + x[j] s_{j+half}
 *   backward (x = dL/dout, out = dL/dx): the transpose of that map,
 *             out[j]        = x[j] c_j + x[j + half] s_{j+half}
 *             out[j + half] = x[j + half] c_{j+half} - x[j] s_j
 *   out[j] = x[j] for rot <= j < D (both directions),
 * each output rounded once to the dtype. This is out = x cos(f) + rotate_half(x) sin(f) with
 * rotate_half(x) = [-x2, x1], computed in fp32 (TE's fused RoPE computes the same).
 * Errors as in te_parallel.h.
 */
#ifndef TE_PARALLEL_ROPE_H_
#define TE_PARALLEL_ROPE_H_

#include "te_parallel/te_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const void* x;
  void* out;
  const float* freqs;
  int dtype;
  long long s, b, h, d;
  long long x_stride_s, x_stride_b, x_stride_h;
  long long out_stride_s, out_stride_b, out_stride_h;
  long long freqs_stride_s;
  int rot;
  int backward;
} tep_rope_params;

TEP_API tep_status tep_rope(const tep_rope_params* p, void* stream);

#ifdef __cplusplus
}
#endif

#endif  // TE_PARALLEL_ROPE_H_
