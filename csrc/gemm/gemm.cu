// tep_gemm: a cuBLASLt matmul (FP8, or bf16/fp16) with cached plans (csrc/include/te_parallel/gemm.h).
//
// Row-major D[m, n] = A[m, k] · B[n, k]ᵀ is column-major Dᵀ[n, m] = Bᵀ · A, so cuBLASLt's first operand
// is our B (stored [k, n] column-major, used transposed) and its second our A ([k, m], not transposed):
// the "TN" form that cuBLASLt's FP8 kernels require. Its A-scale is therefore our scale_b.
#include <dlfcn.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "../kernels/common.h"
#include "cublaslt_api.h"
#include "te_parallel/gemm.h"

namespace {

struct Api {
  tep_lt::CreateFn create = nullptr;
  tep_lt::DescCreateFn desc_create = nullptr;
  tep_lt::DescDestroyFn desc_destroy = nullptr;
  tep_lt::DescSetFn desc_set = nullptr;
  tep_lt::LayoutCreateFn layout_create = nullptr;
  tep_lt::LayoutDestroyFn layout_destroy = nullptr;
  tep_lt::PrefCreateFn pref_create = nullptr;
  tep_lt::PrefDestroyFn pref_destroy = nullptr;
  tep_lt::PrefSetFn pref_set = nullptr;
  tep_lt::HeuristicFn heuristic = nullptr;
  tep_lt::MatmulFn matmul = nullptr;
  tep_lt::StatusStringFn status_string = nullptr;
};

std::mutex g_mutex;  // guards everything below (the handles and the plan cache)
Api g_api;
bool g_load_tried = false;
bool g_loaded = false;
char g_load_error[512] = "";

template <typename Fn>
bool sym(void* lib, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr) {
    std::snprintf(g_load_error, sizeof(g_load_error), "cuBLASLt has no symbol %s", name);
    return false;
  }
  return true;
}

// Prefers the copy already in the process (torch's), so both use one cuBLASLt; then the library path.
bool load_locked() {
  if (g_load_tried) return g_loaded;
  g_load_tried = true;
  const char* names[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"};
  void* lib = nullptr;
  const char* override_path = std::getenv("TE_PARALLEL_CUBLASLT");
  if (override_path && *override_path) {
    lib = dlopen(override_path, RTLD_NOW | RTLD_LOCAL);
  } else {
    for (const char* name : names) {
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD))) break;
    }
    for (const char* name : names) {
      if (lib) break;
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    }
  }
  if (!lib) {
    const char* why = dlerror();
    std::snprintf(g_load_error, sizeof(g_load_error), "cannot open cuBLASLt (%s%s): %s",
                  override_path && *override_path ? "TE_PARALLEL_CUBLASLT=" : "libcublasLt.so.13/.12/.so",
                  override_path && *override_path ? override_path : "", why ? why : "not found");
    return false;
  }
  Api api;
  bool ok = sym(lib, "cublasLtCreate", &api.create) && sym(lib, "cublasLtMatmulDescCreate", &api.desc_create) &&
            sym(lib, "cublasLtMatmulDescDestroy", &api.desc_destroy) &&
            sym(lib, "cublasLtMatmulDescSetAttribute", &api.desc_set) &&
            sym(lib, "cublasLtMatrixLayoutCreate", &api.layout_create) &&
            sym(lib, "cublasLtMatrixLayoutDestroy", &api.layout_destroy) &&
            sym(lib, "cublasLtMatmulPreferenceCreate", &api.pref_create) &&
            sym(lib, "cublasLtMatmulPreferenceDestroy", &api.pref_destroy) &&
            sym(lib, "cublasLtMatmulPreferenceSetAttribute", &api.pref_set) &&
            sym(lib, "cublasLtMatmulAlgoGetHeuristic", &api.heuristic) && sym(lib, "cublasLtMatmul", &api.matmul) &&
            sym(lib, "cublasLtGetStatusString", &api.status_string);
  if (!ok) return false;  // (the library stays open: harmless, and torch may hold it anyway)
  g_api = api;
  g_loaded = true;
  return true;
}

const char* status_text(tep_lt::Status s) {
  const char* text = g_api.status_string ? g_api.status_string(s) : nullptr;
  return text ? text : "unknown cuBLASLt status";
}

bool lt_ok(tep_lt::Status s, const char* what) {
  if (s == tep_lt::kSuccess) return true;
  tep::set_error("tep_gemm: %s failed: %s (%d)", what, status_text(s), s);
  return false;
}

bool to_cuda_type(int dtype, cudaDataType_t* out) {
  switch (dtype) {
    case TEP_FLOAT32: *out = CUDA_R_32F; return true;
    case TEP_FLOAT16: *out = CUDA_R_16F; return true;
    case TEP_BFLOAT16: *out = CUDA_R_16BF; return true;
    case TEP_FLOAT8_E4M3: *out = CUDA_R_8F_E4M3; return true;
    case TEP_FLOAT8_E5M2: *out = CUDA_R_8F_E5M2; return true;
    default: return false;
  }
}

int alignment(const void* p) {  // largest power of two <= 256 dividing the address
  auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

// Everything that changes the descriptors or the heuristic's answer.
using Key = std::tuple<int, long long, long long, long long, int, int, int, bool, bool, bool, int, int, int, int, size_t>;

// cuBLASLt's heuristic ranks algorithms; the plan keeps its first kMaxCandidates and runs `chosen`
// (0, the heuristic's pick, until tep_gemm_tune has timed them).
constexpr int kMaxCandidates = 8;

struct Plan {
  tep_lt::MatmulDesc desc = nullptr;
  tep_lt::MatrixLayout a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A (our B), B (our A), C = D
  tep_lt::Algo algos[kMaxCandidates]{};
  int num_algos = 0;
  int chosen = 0;
};

std::map<Key, Plan> g_plans;
tep_lt::Handle g_handles[64] = {};

void destroy_plan(Plan& p) {
  if (p.desc) g_api.desc_destroy(p.desc);
  if (p.a) g_api.layout_destroy(p.a);
  if (p.b) g_api.layout_destroy(p.b);
  if (p.d) g_api.layout_destroy(p.d);
}

// Descriptors + algorithm for `key`; false (error set) if cuBLASLt has no algorithm for it.
bool make_plan(tep_lt::Handle handle, long long m, long long n, long long k, cudaDataType_t a_t, cudaDataType_t b_t,
               cudaDataType_t d_t, bool has_c, bool has_bias, bool fast_accum, const int align[4],
               size_t workspace_bytes, Plan* plan) {
  Plan p;
  const bool fp8 = a_t == CUDA_R_8F_E4M3 || a_t == CUDA_R_8F_E5M2;
  int32_t op_t = tep_lt::kOpT, op_n = tep_lt::kOpN;
  int8_t fast = fast_accum ? 1 : 0;
  uint32_t epilogue = has_bias ? tep_lt::kEpilogueBias : tep_lt::kEpilogueDefault;
  bool ok = lt_ok(g_api.desc_create(&p.desc, tep_lt::kCompute32F, CUDA_R_32F), "cublasLtMatmulDescCreate") &&
            lt_ok(g_api.desc_set(p.desc, tep_lt::kDescTransA, &op_t, sizeof(op_t)), "set TRANSA") &&
            lt_ok(g_api.desc_set(p.desc, tep_lt::kDescTransB, &op_n, sizeof(op_n)), "set TRANSB") &&
            (!fp8 || lt_ok(g_api.desc_set(p.desc, tep_lt::kDescFastAccum, &fast, sizeof(fast)), "set FAST_ACCUM")) &&
            lt_ok(g_api.desc_set(p.desc, tep_lt::kDescEpilogue, &epilogue, sizeof(epilogue)), "set EPILOGUE");
  if (ok && has_bias) {
    int32_t bias_t = static_cast<int32_t>(d_t);
    ok = lt_ok(g_api.desc_set(p.desc, tep_lt::kDescBiasDataType, &bias_t, sizeof(bias_t)), "set BIAS_DATA_TYPE");
  }
  ok = ok && lt_ok(g_api.layout_create(&p.a, b_t, k, n, k), "layout of B") &&
       lt_ok(g_api.layout_create(&p.b, a_t, k, m, k), "layout of A") &&
       lt_ok(g_api.layout_create(&p.d, d_t, n, m, n), "layout of D");
  tep_lt::Preference pref = nullptr;
  ok = ok && lt_ok(g_api.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
  if (ok) {
    uint64_t ws = workspace_bytes;
    uint32_t al_a = align[1], al_b = align[0], al_c = align[2], al_d = align[3];  // cuBLASLt's A is our B
    ok = lt_ok(g_api.pref_set(pref, tep_lt::kPrefMaxWorkspaceBytes, &ws, sizeof(ws)), "set MAX_WORKSPACE_BYTES") &&
         lt_ok(g_api.pref_set(pref, tep_lt::kPrefMinAlignmentA, &al_a, sizeof(al_a)), "set MIN_ALIGNMENT_A") &&
         lt_ok(g_api.pref_set(pref, tep_lt::kPrefMinAlignmentB, &al_b, sizeof(al_b)), "set MIN_ALIGNMENT_B") &&
         lt_ok(g_api.pref_set(pref, tep_lt::kPrefMinAlignmentC, &al_c, sizeof(al_c)), "set MIN_ALIGNMENT_C") &&
         lt_ok(g_api.pref_set(pref, tep_lt::kPrefMinAlignmentD, &al_d, sizeof(al_d)), "set MIN_ALIGNMENT_D");
  }
  if (ok) {
    tep_lt::HeuristicResult results[kMaxCandidates]{};
    int returned = 0;
    ok = lt_ok(g_api.heuristic(handle, p.desc, p.a, p.b, p.d, p.d, pref, kMaxCandidates, results, &returned),
               "cublasLtMatmulAlgoGetHeuristic");
    for (int i = 0; ok && i < returned && i < kMaxCandidates; ++i) {
      if (results[i].state == tep_lt::kSuccess) p.algos[p.num_algos++] = results[i].algo;
    }
    if (ok && p.num_algos < 1) {
      tep::set_error("tep_gemm: cuBLASLt has no algorithm for m=%lld n=%lld k=%lld (A %d, B %d, D %d, C %s, "
                     "bias %s)", m, n, k, static_cast<int>(a_t), static_cast<int>(b_t), static_cast<int>(d_t),
                     has_c ? "yes" : "no", has_bias ? "yes" : "no");
      ok = false;
    }
  }
  if (pref) g_api.pref_destroy(pref);
  if (!ok) {
    destroy_plan(p);
    return false;
  }
  *plan = p;
  return true;
}

// The plan of these arguments (made on first use) and the device's handle. Holds g_mutex.
tep_status plan_locked(const void* a, const void* b, const void* c, const void* d, long long m, long long n,
                       long long k, int a_dtype, int b_dtype, int d_dtype, const void* bias, int fast_accum,
                       size_t workspace_bytes, tep_lt::Handle* handle_out, Plan** plan_out) {
  cudaDataType_t a_t, b_t, d_t;
  if (!to_cuda_type(a_dtype, &a_t) || !to_cuda_type(b_dtype, &b_t) || !to_cuda_type(d_dtype, &d_t)) {
    tep::set_error("tep_gemm: unknown dtype code (a %d, b %d, d %d)", a_dtype, b_dtype, d_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
    cudaGetLastError();
    tep::set_error("tep_gemm: no current CUDA device");
    return TEP_ERROR_CUDA;
  }
  if (!load_locked()) {
    tep::set_error("tep_gemm: %s", g_load_error);
    return TEP_ERROR_CUDA;
  }
  tep_lt::Handle& handle = g_handles[device];
  if (!handle && !lt_ok(g_api.create(&handle), "cublasLtCreate")) return TEP_ERROR_CUDA;
  int align_cd = alignment(d);  // C and D share one layout, so one alignment
  if (c && alignment(c) < align_cd) align_cd = alignment(c);
  int align[4] = {alignment(a), alignment(b), align_cd, align_cd};
  Key key{device, m, n, k, a_dtype, b_dtype, d_dtype, c != nullptr, bias != nullptr, fast_accum != 0,
          align[0], align[1], align[2], align[3], workspace_bytes};
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    Plan plan;
    if (!make_plan(handle, m, n, k, a_t, b_t, d_t, c != nullptr, bias != nullptr, fast_accum != 0, align,
                   workspace_bytes, &plan))
      return TEP_ERROR_CUDA;
    it = g_plans.emplace(key, plan).first;
  }
  *handle_out = handle;
  *plan_out = &it->second;
  return TEP_SUCCESS;
}

// The per-call pointers live in the descriptor; g_mutex keeps another thread from changing them
// between these calls and the launch.
bool set_pointers_locked(Plan& p, bool fp8, const float* scale_a, const float* scale_b, const void* bias) {
  if (fp8 && (!lt_ok(g_api.desc_set(p.desc, tep_lt::kDescAScalePointer, &scale_b, sizeof(scale_b)), "set A_SCALE_POINTER") ||
              !lt_ok(g_api.desc_set(p.desc, tep_lt::kDescBScalePointer, &scale_a, sizeof(scale_a)), "set B_SCALE_POINTER")))
    return false;
  return !bias || lt_ok(g_api.desc_set(p.desc, tep_lt::kDescBiasPointer, &bias, sizeof(bias)), "set BIAS_POINTER");
}

bool matmul_locked(tep_lt::Handle handle, const Plan& p, int algo, const void* a, const void* b, const void* c,
                   void* d, void* workspace, size_t workspace_bytes, void* stream) {
  const float alpha = 1.0f, beta = c ? 1.0f : 0.0f;
  return lt_ok(g_api.matmul(handle, p.desc, &alpha, b, p.a, a, p.b, &beta, c ? c : d, p.d, d, p.d, &p.algos[algo],
                            workspace, workspace_bytes, stream),
               "cublasLtMatmul");
}

}  // namespace

extern "C" {

int tep_gemm_available(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!load_locked()) {
    tep::set_error("tep_gemm: %s", g_load_error);
    return 0;
  }
  return 1;
}

tep_status tep_gemm_workspace(int device, void* stream, size_t workspace_bytes, void** workspace) {
  static std::mutex mutex;
  static auto* cache = new std::map<std::pair<int, void*>, std::pair<void*, size_t>>();  // never freed (exit)
  std::lock_guard<std::mutex> lock(mutex);
  *workspace = nullptr;
  auto key = std::make_pair(device, stream);
  auto it = cache->find(key);
  if (it != cache->end()) {
    if (it->second.second != workspace_bytes) {
      tep::set_error("tep_gemm_workspace: asked for %zu bytes, the stream's workspace has %zu", workspace_bytes,
                     it->second.second);
      return TEP_ERROR_INVALID_ARGUMENT;
    }
    *workspace = it->second.first;
    return TEP_SUCCESS;
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture);
  if (err == cudaSuccess && capture != cudaStreamCaptureStatusNone) return TEP_SUCCESS;  // the caller's temporary
  int current = -1;
  if (err == cudaSuccess) err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  void* ptr = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&ptr, workspace_bytes);
  if (current >= 0 && current != device) cudaSetDevice(current);
  if (err != cudaSuccess) {
    cudaGetLastError();
    tep::set_error("tep_gemm_workspace: %zu bytes on device %d: %s", workspace_bytes, device, cudaGetErrorString(err));
    return TEP_ERROR_CUDA;
  }
  cache->emplace(key, std::make_pair(ptr, workspace_bytes));
  *workspace = ptr;
  return TEP_SUCCESS;
}

long long tep_gemm_cached_plans(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<long long>(g_plans.size());
}

tep_status tep_gemm(const void* a, int a_dtype, const void* b, int b_dtype, long long m, long long n, long long k,
                        const float* scale_a, const float* scale_b, const void* c, void* d, int d_dtype,
                        const void* bias, int fast_accum, void* workspace, size_t workspace_bytes, void* stream) {
  bool a_fp8 = a_dtype == TEP_FLOAT8_E4M3 || a_dtype == TEP_FLOAT8_E5M2;
  bool b_fp8 = b_dtype == TEP_FLOAT8_E4M3 || b_dtype == TEP_FLOAT8_E5M2;
  bool fp8 = a_fp8 && b_fp8 && !(a_dtype == TEP_FLOAT8_E5M2 && b_dtype == TEP_FLOAT8_E5M2);
  bool high = !a_fp8 && a_dtype == b_dtype && (a_dtype == TEP_BFLOAT16 || a_dtype == TEP_FLOAT16);
  if (!fp8 && !high) {
    tep::set_error("tep_gemm: a_dtype=%d, b_dtype=%d; need FP8 E4M3/E5M2 operands (not both E5M2), or both "
                   "bf16 / both fp16", a_dtype, b_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (high && d_dtype != TEP_FLOAT32 && d_dtype != a_dtype) {
    tep::set_error("tep_gemm: %s operands give a %s or fp32 D; got d_dtype=%d", a_dtype == TEP_BFLOAT16 ? "bf16" : "fp16",
                   a_dtype == TEP_BFLOAT16 ? "bf16" : "fp16", d_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (d_dtype != TEP_FLOAT32 && d_dtype != TEP_FLOAT16 && d_dtype != TEP_BFLOAT16) {
    tep::set_error("tep_gemm: d_dtype=%d; need TEP_FLOAT32, TEP_FLOAT16 or TEP_BFLOAT16", d_dtype);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (fp8 ? (m < 16 || n < 16 || k < 16 || m % 16 || n % 16 || k % 16) : (m < 1 || n < 1 || k < 1)) {
    tep::set_error("tep_gemm: m=%lld n=%lld k=%lld; need each %s", m, n, k,
                   fp8 ? ">= 16 and a multiple of 16 (FP8)" : ">= 1");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (!a || !b || !d || (fp8 && (!scale_a || !scale_b)) || (!fp8 && (scale_a || scale_b)) ||
      (workspace_bytes && !workspace)) {
    tep::set_error("tep_gemm: a, b, d (and workspace when workspace_bytes > 0) must be set, and scale_a, scale_b "
                   "for FP8 operands only");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  if (bias && d_dtype == TEP_FLOAT32) {
    tep::set_error("tep_gemm: a bias needs an fp16/bf16 D (cuBLASLt's FP8 kernels take no bias with fp32 D)");
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  tep_lt::Handle handle = nullptr;
  Plan* p = nullptr;
  tep_status status = plan_locked(a, b, c, d, m, n, k, a_dtype, b_dtype, d_dtype, bias, fast_accum, workspace_bytes,
                                  &handle, &p);
  if (status != TEP_SUCCESS) return status;
  if (!set_pointers_locked(*p, fp8, scale_a, scale_b, bias)) return TEP_ERROR_CUDA;
  return matmul_locked(handle, *p, p->chosen, a, b, c, d, workspace, workspace_bytes, stream) ? TEP_SUCCESS
                                                                                                : TEP_ERROR_CUDA;
}

tep_status tep_gemm_tune(const void* a, int a_dtype, const void* b, int b_dtype, long long m, long long n,
                         long long k, const float* scale_a, const float* scale_b, const void* c, void* d,
                         int d_dtype, const void* bias, int fast_accum, void* workspace, size_t workspace_bytes,
                         void* stream, int rounds, int reps, float* ms_out, int* num_out, int* chosen_out) {
  // The same checks as tep_gemm, by running it once: it makes the plan, and warms the first candidate.
  tep_status status = tep_gemm(a, a_dtype, b, b_dtype, m, n, k, scale_a, scale_b, c, d, d_dtype, bias, fast_accum,
                               workspace, workspace_bytes, stream);
  if (status != TEP_SUCCESS) return status;
  if (rounds < 1 || reps < 1 || !ms_out || !num_out || !chosen_out) {
    tep::set_error("tep_gemm_tune: rounds=%d, reps=%d (need >= 1 each) and ms_out, num_out, chosen_out must be set",
                   rounds, reps);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  tep_lt::Handle handle = nullptr;
  Plan* p = nullptr;
  status = plan_locked(a, b, c, d, m, n, k, a_dtype, b_dtype, d_dtype, bias, fast_accum, workspace_bytes, &handle, &p);
  if (status != TEP_SUCCESS) return status;
  const bool fp8 = a_dtype == TEP_FLOAT8_E4M3 || a_dtype == TEP_FLOAT8_E5M2;
  if (!set_pointers_locked(*p, fp8, scale_a, scale_b, bias)) return TEP_ERROR_CUDA;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaEvent_t marks[kMaxCandidates][2];
  for (int i = 0; i < p->num_algos; ++i) {
    cudaEventCreate(&marks[i][0]);
    cudaEventCreate(&marks[i][1]);
  }
  // Rounds over all candidates in turn (a GPU at its power cap changes clock within a second); each
  // candidate's time is its median over the rounds. A candidate that fails to launch gets no time.
  float times[kMaxCandidates][16];
  const int kept = rounds < 16 ? rounds : 16;
  bool failed[kMaxCandidates] = {};
  for (int r = 0; r < kept; ++r) {
    for (int i = 0; i < p->num_algos; ++i) {
      cudaEventRecord(marks[i][0], s);
      for (int rep = 0; rep < reps && !failed[i]; ++rep) {
        if (!matmul_locked(handle, *p, i, a, b, c, d, workspace, workspace_bytes, stream)) failed[i] = true;
      }
      cudaEventRecord(marks[i][1], s);
    }
    for (int i = 0; i < p->num_algos; ++i) {
      cudaEventSynchronize(marks[i][1]);
      float ms = 0.f;
      cudaEventElapsedTime(&ms, marks[i][0], marks[i][1]);
      times[i][r] = ms / reps;
    }
  }
  int best = 0;
  for (int i = 0; i < p->num_algos; ++i) {
    std::sort(times[i], times[i] + kept);
    ms_out[i] = failed[i] ? -1.f : times[i][kept / 2];
    if (!failed[i] && (failed[best] || ms_out[i] < ms_out[best])) best = i;
    cudaEventDestroy(marks[i][0]);
    cudaEventDestroy(marks[i][1]);
  }
  cudaGetLastError();  // (a failed candidate's launch error is reported through its -1 time)
  p->chosen = best;
  *num_out = p->num_algos;
  *chosen_out = best;
  return TEP_SUCCESS;
}

tep_status tep_gemm_choose(const void* a, int a_dtype, const void* b, int b_dtype, long long m, long long n,
                           long long k, const void* c, const void* d, int d_dtype, const void* bias, int fast_accum,
                           size_t workspace_bytes, int index) {
  std::lock_guard<std::mutex> lock(g_mutex);
  tep_lt::Handle handle = nullptr;
  Plan* p = nullptr;
  tep_status status = plan_locked(a, b, c, d, m, n, k, a_dtype, b_dtype, d_dtype, bias, fast_accum, workspace_bytes,
                                  &handle, &p);
  if (status != TEP_SUCCESS) return status;
  if (index < 0 || index >= p->num_algos) {
    tep::set_error("tep_gemm_choose: index %d; this plan has %d candidates", index, p->num_algos);
    return TEP_ERROR_INVALID_ARGUMENT;
  }
  p->chosen = index;
  return TEP_SUCCESS;
}

}  // extern "C"
