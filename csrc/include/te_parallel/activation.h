/*
 * te_parallel C API: bias + activation kernels (forward, and dact + dbias + FP8 cast-transpose backward).
 *
 * Matrices are row-major device arrays; x_dtype is one of TEP_FLOAT32 / FLOAT16 / BFLOAT16 and every
 * high-precision tensor of a call (x, bias, dy, out, dx) has that type. Everything is computed in fp32
 * and rounded once to x_dtype (round-to-nearest-even); the FP8 outputs and the amax are of that rounded
 * value, so a fused FP8 output equals tep_cast_transpose_amax applied to the high-precision output.
 *
 * Activations (TE's names): gelu is the tanh approximation 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)));
 * qgelu(v) = v sigmoid(1.702 v); srelu(v) = relu(v)^2; silu(v) = v sigmoid(v). A gated activation
 * splits each row of x [rows, cols] into halves a = x[:, :cols/2], b = x[:, cols/2:] and returns
 * act(a + bias_a) * (b + bias_b) of shape [rows, cols/2] (bias [cols] split the same way).
 * Errors as in te_parallel.h: a tep_status, and tep_last_error() says what is wrong.
 */
#ifndef TE_PARALLEL_ACTIVATION_H_
#define TE_PARALLEL_ACTIVATION_H_

#include "te_parallel/te_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TEP_ACT_GELU = 0,
  TEP_ACT_RELU = 1,
  TEP_ACT_SILU = 2,
  TEP_ACT_QGELU = 3,
  TEP_ACT_SRELU = 4,
  TEP_ACT_GEGLU = 5, /* gated: gelu(a) * b */
  TEP_ACT_REGLU = 6,
  TEP_ACT_SWIGLU = 7, /* silu(a) * b */
  TEP_ACT_QGEGLU = 8,
  TEP_ACT_SREGLU = 9
} tep_activation;

/* 1 for the gated activations (x has 2F columns, the output F), 0 for the others, -1 if unknown. */
TEP_API int tep_activation_is_gated(int act);

/*
 * Optional FP8 output of a kernel, of the value v it computes ([rows, n]):
 *   data[i, j]   = fp8(v[i, j] * scale[0])   if data != NULL    (as tep_cast_transpose_amax)
 *   data_t[j, i] = data[i, j]                if data_t != NULL  ([n, rows], the transposed copy)
 *   amax[0]      = max(amax[0], max |v|)     if amax != NULL    (NaN propagates; amax[0] >= 0)
 * data and data_t may both be NULL to get only the amax; scale is then not read.
 * dtype: TEP_FLOAT8_E4M3 or TEP_FLOAT8_E5M2.
 */
typedef struct {
  void* data;
  void* data_t;
  const float* scale;
  float* amax;
  int dtype;
} tep_fp8_output;

/*
 * y = act(x + bias), x [rows, cols], y [rows, cols] ([rows, cols / 2] for a gated act; cols even).
 *   bias: [cols] or NULL (no bias).   out: y in x_dtype, or NULL.   fp8: FP8 outputs of y, or NULL.
 * At least one of out, fp8 is needed. Any rows, cols >= 1. Asynchronous on `stream` (a cudaStream_t).
 */
TEP_API tep_status tep_bias_activation_fwd(int act, const void* x, const void* bias, int x_dtype, long long rows,
                                           long long cols, void* out, const tep_fp8_output* fp8, void* stream);

/* Bytes of fp32 workspace tep_dbias_dactivation needs to produce dbias for x [rows, cols]. */
TEP_API long long tep_dbias_dactivation_workspace_size(long long rows, long long cols);

/*
 * Backward of tep_bias_activation_fwd at the saved input x [rows, cols] (and the same bias, or NULL):
 *   dx = dy * act'(x + bias)                                     dy [rows, cols]
 *   gated: dx[:, :F] = dy * act'(a') * b',  dx[:, F:] = dy * act(a')   a' = a + bias_a, b' = b + bias_b,
 *          dy [rows, F], F = cols / 2
 *   dbias[j] = sum_i dx[i, j] (over the rounded dx, fp32 accumulation in a fixed order: deterministic)
 * Outputs, each optional (at least one of dx, fp8, dbias): dx [rows, cols] in x_dtype; fp8: FP8
 * outputs of dx ([rows, cols] and transposed [cols, rows]); dbias [cols] in dbias_dtype (TEP_FLOAT32 /
 * FLOAT16 / BFLOAT16), which needs `workspace` of tep_dbias_dactivation_workspace_size(rows, cols)
 * bytes (device memory, 4-byte aligned, no initial contents; a second launch folds it into dbias).
 */
TEP_API tep_status tep_dbias_dactivation(int act, const void* dy, const void* x, const void* bias, int x_dtype,
                                         long long rows, long long cols, void* dx, const tep_fp8_output* fp8,
                                         void* dbias, int dbias_dtype, void* workspace, long long workspace_bytes,
                                         void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TE_PARALLEL_ACTIVATION_H_ */
