// The part of cuBLASLt's C API that tep_gemm uses, declared here because cuBLASLt is opened at run
// time (dlopen) and its headers are not part of every CUDA toolkit install (the dev/CI machine has
// none). Values are those of cublasLt.h / cublas_api.h (CUDA 12 and 13 agree on all of them); where
// the real header is on the include path the build checks every value against it.
#pragma once

#include <cstddef>
#include <cstdint>

#include <library_types.h>  // cudaDataType_t (ships with the CUDA runtime headers)

namespace tep_lt {

using Status = int;  // cublasStatus_t
constexpr Status kSuccess = 0;

struct Context;
using Handle = Context*;
struct MatmulDescOpaque { uint64_t data[32]; };
struct MatrixLayoutOpaque { uint64_t data[8]; };
struct PreferenceOpaque { uint64_t data[8]; };
using MatmulDesc = MatmulDescOpaque*;
using MatrixLayout = MatrixLayoutOpaque*;
using Preference = PreferenceOpaque*;

struct Algo { uint64_t data[8]; };
struct HeuristicResult {
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves_count;
  int reserved[4];
};

// cublasComputeType_t, cublasOperation_t
constexpr int kCompute32F = 68;
constexpr int32_t kOpN = 0;
constexpr int32_t kOpT = 1;

// cublasLtMatmulDescAttributes_t
constexpr int kDescTransA = 3;
constexpr int kDescTransB = 4;
constexpr int kDescEpilogue = 7;
constexpr int kDescBiasPointer = 8;
constexpr int kDescAScalePointer = 17;
constexpr int kDescBScalePointer = 18;
constexpr int kDescFastAccum = 25;
constexpr int kDescBiasDataType = 26;

// cublasLtEpilogue_t
constexpr uint32_t kEpilogueDefault = 1;
constexpr uint32_t kEpilogueBias = 4;

// cublasLtMatmulPreferenceAttributes_t
constexpr int kPrefMaxWorkspaceBytes = 1;
constexpr int kPrefMinAlignmentA = 5;
constexpr int kPrefMinAlignmentB = 6;
constexpr int kPrefMinAlignmentC = 7;
constexpr int kPrefMinAlignmentD = 8;

using CreateFn = Status (*)(Handle*);
using DestroyFn = Status (*)(Handle);
using DescCreateFn = Status (*)(MatmulDesc*, int compute_type, cudaDataType_t scale_type);
using DescDestroyFn = Status (*)(MatmulDesc);
using DescSetFn = Status (*)(MatmulDesc, int attr, const void* buf, size_t bytes);
using LayoutCreateFn = Status (*)(MatrixLayout*, cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld);
using LayoutDestroyFn = Status (*)(MatrixLayout);
using PrefCreateFn = Status (*)(Preference*);
using PrefDestroyFn = Status (*)(Preference);
using PrefSetFn = Status (*)(Preference, int attr, const void* buf, size_t bytes);
using HeuristicFn = Status (*)(Handle, MatmulDesc, MatrixLayout, MatrixLayout, MatrixLayout, MatrixLayout,
                               Preference, int requested, HeuristicResult* results, int* returned);
using MatmulFn = Status (*)(Handle, MatmulDesc, const void* alpha, const void* a, MatrixLayout a_desc,
                            const void* b, MatrixLayout b_desc, const void* beta, const void* c, MatrixLayout c_desc,
                            void* d, MatrixLayout d_desc, const Algo* algo, void* workspace, size_t workspace_bytes,
                            void* stream);
using StatusStringFn = const char* (*)(Status);

}  // namespace tep_lt

#if defined(__has_include)
#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
// Built where the real header exists (the GPU machines): the declarations above must match it.
static_assert(CUBLAS_STATUS_SUCCESS == tep_lt::kSuccess, "cublasStatus_t");
static_assert(CUBLAS_COMPUTE_32F == tep_lt::kCompute32F, "cublasComputeType_t");
static_assert(CUBLAS_OP_N == tep_lt::kOpN && CUBLAS_OP_T == tep_lt::kOpT, "cublasOperation_t");
static_assert(CUBLASLT_MATMUL_DESC_TRANSA == tep_lt::kDescTransA, "TRANSA");
static_assert(CUBLASLT_MATMUL_DESC_TRANSB == tep_lt::kDescTransB, "TRANSB");
static_assert(CUBLASLT_MATMUL_DESC_EPILOGUE == tep_lt::kDescEpilogue, "EPILOGUE");
static_assert(CUBLASLT_MATMUL_DESC_BIAS_POINTER == tep_lt::kDescBiasPointer, "BIAS_POINTER");
static_assert(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER == tep_lt::kDescAScalePointer, "A_SCALE_POINTER");
static_assert(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER == tep_lt::kDescBScalePointer, "B_SCALE_POINTER");
static_assert(CUBLASLT_MATMUL_DESC_FAST_ACCUM == tep_lt::kDescFastAccum, "FAST_ACCUM");
static_assert(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE == tep_lt::kDescBiasDataType, "BIAS_DATA_TYPE");
static_assert(CUBLASLT_EPILOGUE_DEFAULT == tep_lt::kEpilogueDefault, "EPILOGUE_DEFAULT");
static_assert(CUBLASLT_EPILOGUE_BIAS == tep_lt::kEpilogueBias, "EPILOGUE_BIAS");
static_assert(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES == tep_lt::kPrefMaxWorkspaceBytes, "MAX_WORKSPACE");
static_assert(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES == tep_lt::kPrefMinAlignmentA, "ALIGN_A");
static_assert(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES == tep_lt::kPrefMinAlignmentB, "ALIGN_B");
static_assert(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES == tep_lt::kPrefMinAlignmentC, "ALIGN_C");
static_assert(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES == tep_lt::kPrefMinAlignmentD, "ALIGN_D");
static_assert(sizeof(cublasLtMatmulAlgo_t) == sizeof(tep_lt::Algo), "cublasLtMatmulAlgo_t");
static_assert(sizeof(cublasLtMatmulHeuristicResult_t) == sizeof(tep_lt::HeuristicResult), "heuristic result");
static_assert(offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize) ==
                  offsetof(tep_lt::HeuristicResult, workspace_size), "workspaceSize");
static_assert(offsetof(cublasLtMatmulHeuristicResult_t, state) == offsetof(tep_lt::HeuristicResult, state), "state");
#define TEP_CUBLASLT_HEADER_CHECKED 1
#endif
#endif
