/*
 * te_parallel C API: the framework-agnostic surface of the native kernels.
 *
 * Plain C so that any framework (the pybind11 module here, or a C/C++ host) can call it: device memory
 * is passed as raw pointers with shapes, streams as opaque `void*` (a cudaStream_t). No torch, no
 * pybind11, no CUDA headers are needed to include this file.
 *
 * Errors: every entry point that can fail returns a tep_status; on failure tep_last_error() returns a
 * one-line message (thread-local, valid until the next failure on the same thread).
 */
#ifndef TE_PARALLEL_TE_PARALLEL_H_
#define TE_PARALLEL_TE_PARALLEL_H_

#if defined(__GNUC__)
#define TEP_API __attribute__((visibility("default")))
#else
#define TEP_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TEP_SUCCESS = 0,
  TEP_ERROR_INVALID_ARGUMENT = 1,
  TEP_ERROR_CUDA = 2
} tep_status;

/* Library version, "MAJOR.MINOR.PATCH". */
TEP_API const char* tep_version(void);

/* Message of the last failure on the calling thread ("" if none yet). */
TEP_API const char* tep_last_error(void);

/* CUDA runtime version the library was built with, e.g. 13000 (cudart is linked statically). */
TEP_API int tep_cuda_runtime_version(void);

/* Number of visible CUDA devices; 0 (never a crash) when there is no driver or no GPU. */
TEP_API int tep_device_count(void);

/*
 * Delayed-scaling state of one group of FP8 tensors (e.g. one module's forward operands).
 *   amax_history: device fp32 [history_len, num_tensors], row-major; row 0 is the most recent step.
 *   scale, scale_inv: device fp32 [num_tensors].
 * Different states must not overlap in memory.
 */
typedef struct {
  float* amax_history;
  float* scale;
  float* scale_inv;
  int history_len;
  int num_tensors;
} tep_scaling_state;

/* amax_algo of tep_delayed_scaling_update: which amax of the history sets the scale. */
typedef enum {
  TEP_AMAX_MAX = 0,         /* the largest over the whole history */
  TEP_AMAX_MOST_RECENT = 1  /* row 0, the pass that just ended */
} tep_amax_algo;

/*
 * For every state and tensor column j (all states in one kernel launch, one CUDA block per state):
 *   amax_j = max over rows of amax_history[:, j] (NaN propagates)   if amax_algo == TEP_AMAX_MAX
 *   amax_j = amax_history[0, j]                                      if amax_algo == TEP_AMAX_MOST_RECENT
 *   if update_scale:
 *     new = (fp8_max / amax_j) / scale_divisor                       (two IEEE fp32 divisions)
 *     scale[j] = new if isfinite(amax_j) && amax_j > 0 && isfinite(new), else unchanged
 *     scale_inv[j] = 1 / scale[j]
 *   amax_history rolls down one row in place; row 0 becomes 0.
 * Asynchronous on `stream` (a cudaStream_t; NULL = legacy default stream). `states` is a host array,
 * read before the call returns. The calling thread's current CUDA device must own the stream.
 */
TEP_API tep_status tep_delayed_scaling_update(const tep_scaling_state* states, int num_states,
                                              float fp8_max, float scale_divisor, int amax_algo,
                                              int update_scale, void* stream);

/*
 * Current scaling of one tensor, on `stream`, without a host round trip:
 *   amax = max |x[i]| over the n elements of x (NaN propagates)     if x != NULL (x_dtype: TEP_FLOAT32 /
 *                                                                   FLOAT16 / BFLOAT16; any alignment)
 *   amax = amax_in[0]                                               if amax_in != NULL (exactly one of the two)
 *   amax_out[0] = amax                                              if amax_out != NULL
 *   scale_out[0] = fp8_max / amax (one IEEE fp32 division) if amax is finite and > 0 and the quotient is
 *                  finite, else 1                                   if scale_out != NULL
 *   scale_inv_out[0] = 1 / scale_out[0]                             if scale_inv_out != NULL too
 * partials: device fp32 scratch of tep_current_scale_partials(n) floats when x is given (no
 * initialisation needed). At least one of amax_out and scale_out must be given.
 */
TEP_API int tep_current_scale_partials(long long n);
TEP_API tep_status tep_current_scale(const void* x, int x_dtype, long long n, const float* amax_in,
                                     float fp8_max, float* partials, float* amax_out, float* scale_out,
                                     float* scale_inv_out, void* stream);

/* Element types of tensors passed to the kernels. */
typedef enum {
  TEP_FLOAT32 = 0,
  TEP_FLOAT16 = 1,
  TEP_BFLOAT16 = 2,
  TEP_FLOAT8_E4M3 = 3,
  TEP_FLOAT8_E5M2 = 4
} tep_dtype;

/*
 * Cast a row-major [rows, cols] matrix to FP8 in one read of the source:
 *   out[i, j]   = fp8(float(x[i, j]) * scale[0])   if out != NULL; round-to-nearest-even, saturating to
 *                                                   ±fp8_max, NaN stays NaN (same bits as torch's conversion)
 *   out_t[j, i] = out[i, j]                         if out_t != NULL (the transposed copy; at least one
 *                                                   of out and out_t must be given)
 *   amax[0]     = max(amax[0], max |x|)             if amax != NULL (NaN propagates; amax[0] >= 0)
 *   scale_inv[0] = 1 / scale[0]                      if scale_inv != NULL (IEEE division), so the
 *                                                   decoding scale is a copy that later scale updates
 *                                                   do not touch
 *   scale_out[0] = scale[0]                          if scale_out != NULL (a snapshot of the scale the
 *                                                   bytes were encoded with: re-encoding the same
 *                                                   source with it later gives the same bytes)
 * x_dtype: TEP_FLOAT32 / FLOAT16 / BFLOAT16; out_dtype: TEP_FLOAT8_E4M3 / E5M2. Any rows, cols >= 1.
 * Asynchronous on `stream`.
 */
TEP_API tep_status tep_cast_transpose_amax(const void* x, int x_dtype, long long rows, long long cols,
                                           const float* scale, void* out, void* out_t, float* amax,
                                           float* scale_inv, float* scale_out, int out_dtype, void* stream);

/* Bytes of fp32 workspace tep_cast_transpose_dbias needs for x [rows, cols]. */
TEP_API long long tep_cast_transpose_dbias_workspace_size(long long rows, long long cols);

/*
 * tep_cast_transpose_amax plus the column sums of x in the same read (x is an output gradient dy,
 * the sums its bias gradient):
 *   dbias[j] = sum_i x[i, j]   fp32 accumulation in a fixed order (deterministic), rounded once to
 *                              dbias_dtype (TEP_FLOAT32 / FLOAT16 / BFLOAT16)
 * `workspace`: device memory of tep_cast_transpose_dbias_workspace_size(rows, cols) bytes, 4-byte
 * aligned, no initial contents (a second launch folds it into dbias).
 */
TEP_API tep_status tep_cast_transpose_dbias(const void* x, int x_dtype, long long rows, long long cols,
                                            const float* scale, void* out, void* out_t, float* amax,
                                            float* scale_inv, int out_dtype, void* dbias, int dbias_dtype,
                                            void* workspace, long long workspace_bytes, void* stream);

/*
 * Transpose of a row-major [rows, cols] matrix of 1-byte elements (FP8 bytes):
 *   out_t[j, i] = x[i, j]. Any rows, cols >= 1. Asynchronous on `stream`.
 */
TEP_API tep_status tep_transpose_fp8(const void* x, long long rows, long long cols, void* out_t, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TE_PARALLEL_TE_PARALLEL_H_ */
