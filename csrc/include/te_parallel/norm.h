/*
 * te_parallel C API: LayerNorm and RMSNorm over the rows of a row-major [rows, hidden] matrix.
 *
 * Plain C, like te_parallel.h (whose tep_status / tep_dtype / tep_last_error it uses): device memory
 * as raw pointers, streams as `void*` (a cudaStream_t). All math is fp32 whatever the storage dtypes.
 *
 *   LayerNorm: mu = mean(x), rsigma = 1 / sqrt(mean((x - mu)^2) + eps), y = (x - mu) * rsigma * g + b
 *   RMSNorm:   rsigma = 1 / sqrt(mean(x^2) + eps),                       y = x * rsigma * g
 *   g = 1 + gamma if zero_centered_gamma else gamma (the sum taken in fp32); b = beta, or 0 if NULL.
 *
 * Tensors passed to one call must not overlap (except gamma/beta, which are only read).
 */
#ifndef TE_PARALLEL_NORM_H_
#define TE_PARALLEL_NORM_H_

#include <stddef.h>

#include "te_parallel/te_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TEP_LAYERNORM = 0, TEP_RMSNORM = 1 } tep_norm_type;

/* What a forward and its backward share: the shape and the affine parameters. */
typedef struct {
  int norm_type;           /* tep_norm_type */
  long long rows, hidden;  /* >= 1 each */
  float eps;
  int zero_centered_gamma; /* nonzero: the math uses 1 + gamma */
  const void* gamma;       /* device [hidden], w_dtype */
  const void* beta;        /* device [hidden], w_dtype; LayerNorm only (NULL = no bias); NULL for RMSNorm */
  int w_dtype;             /* TEP_FLOAT32 / FLOAT16 / BFLOAT16: gamma, beta, and dgamma, dbeta in backward */
} tep_norm_params;

/*
 * Forward (x_dtype TEP_FLOAT32 / FLOAT16 / BFLOAT16), two kernels on `stream`: the row statistics
 * (one read of x), then y from x and the statistics (a second read of x, mostly from L2):
 *   out_dtype TEP_FLOAT32 / FLOAT16 / BFLOAT16: out[i, j] = y[i, j] rounded to nearest even;
 *     scale and out_t must be NULL.
 *   out_dtype TEP_FLOAT8_E4M3 / E5M2: out[i, j] = fp8(y[i, j] * scale[0]) (one fp32 multiplication,
 *     round-to-nearest-even, saturating to +-fp8_max, NaN stays NaN: the bytes of
 *     te_parallel.ops.cast.quantize_reference of the fp32 y); out_t (NULL = none) receives the
 *     transposed copy [hidden, rows] from the same pass.
 *   amax (NULL = none): amax[0] = max(amax[0], max |y|) of the pre-scale y (NaN propagates).
 *   mu (LayerNorm; NULL = not written; must be NULL for RMSNorm), rsigma (NULL = not written):
 *     fp32 [rows], the statistics the backward takes (stream-ordered scratch, cudaMallocAsync, holds
 *     them between the two kernels when they are not wanted).
 * y is computed by the same instructions for every out_dtype, so the FP8 bytes equal the
 * quantization of the fp32 output of a TEP_FLOAT32 call. Asynchronous on `stream`.
 */
TEP_API tep_status tep_norm_fwd(const tep_norm_params* params, const void* x, int x_dtype, void* out,
                                int out_dtype, const float* scale, void* out_t, float* amax, float* mu,
                                float* rsigma, void* stream);

/*
 * Bytes of fp32 workspace tep_norm_bwd needs for `params` and x_dtype on the calling thread's current
 * device (it depends on the device's SM count and the kernels' occupancy there, not on the data).
 */
TEP_API tep_status tep_norm_bwd_workspace_size(const tep_norm_params* params, int x_dtype, size_t* bytes);

/*
 * Backward of tep_norm_fwd (high-precision output), given dy = dL/dy [rows, hidden] in x_dtype and
 * the forward's mu (LayerNorm) and rsigma:
 *   dx (x_dtype, [rows, hidden]) = rsigma * (dy*g - mean(dy*g) - xhat * mean(dy*g * xhat))   (LayerNorm)
 *                                = rsigma * (dy*g - xhat * mean(dy*g * xhat))                 (RMSNorm)
 *   dgamma[j] = sum_i dy[i, j] * xhat[i, j],  dbeta[j] = sum_i dy[i, j]   (w_dtype, [hidden])
 * with xhat = (x - mu) * rsigma (LayerNorm) or x * rsigma (RMSNorm). dgamma/dbeta are reduced in
 * fp32 in two deterministic stages (per-block partials in `workspace`, then a fixed-order sum), so
 * the same inputs on the same device give the same bits. dbeta: NULL = not computed (must be NULL
 * for RMSNorm). workspace: at least tep_norm_bwd_workspace_size bytes, 16-byte aligned, no initial
 * contents needed. Asynchronous on `stream`.
 */
TEP_API tep_status tep_norm_bwd(const tep_norm_params* params, const void* dy, const void* x, int x_dtype,
                                const float* mu, const float* rsigma, void* dx, void* dgamma, void* dbeta,
                                void* workspace, size_t workspace_bytes, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TE_PARALLEL_NORM_H_ */
