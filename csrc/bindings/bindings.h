// Shared by the binding files of te_parallel._C: each kernel family registers its functions from its
// own csrc/bindings/<family>.cpp through one bind_<family>(module) call made by pybind.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include "te_parallel/te_parallel.h"

namespace tep_bindings {

// Throws RuntimeError(tep_last_error()) unless status is TEP_SUCCESS (call on the failing thread).
void check(tep_status status);

// A device address passed from Python as an int (0 = absent), as the C API's pointer type.
template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

void bind_cast(pybind11::module_& m);        // cast.cpp: FP8 cast (+ transpose, amax, dbias), FP8 transpose
void bind_scaling(pybind11::module_& m);     // scaling.cpp: the fused delayed-scaling update
void bind_norm(pybind11::module_& m);        // norm.cpp: LayerNorm / RMSNorm kernels
void bind_activation(pybind11::module_& m);  // activation.cpp: bias + activation kernels
void bind_comm_overlap(pybind11::module_& m);  // comm_overlap.cpp: csrc/comm_gemm_overlap
void bind_gemm(pybind11::module_& m);          // gemm.cpp: the cuBLASLt FP8 GEMM (csrc/gemm)
void bind_rope(pybind11::module_& m);          // rope.cpp: rotary position embedding
void bind_dropout(pybind11::module_& m);       // dropout.cpp: dropout (+ residual add), mask regenerated

}  // namespace tep_bindings
