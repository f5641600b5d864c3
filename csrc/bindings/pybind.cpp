// te_parallel._C: the one pybind11 module over the C API (csrc/include/te_parallel/*.h).
//
// No torch headers: the Python wrappers (te_parallel/native/) validate tensors and pass raw device
// pointers (tensor.data_ptr()) and the stream (torch.cuda.Stream.cuda_stream) as integers. That keeps
// the extension independent of the torch version/ABI it is imported next to, and lets it build
// without torch installed.
//
// This file makes the module, binds the library-wide entry points and the dtype table; each kernel
// family binds itself (its functions and its code tables) from csrc/bindings/<family>.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "te_parallel/te_parallel.h"

#ifndef TEP_BUILT_ARCHS
#define TEP_BUILT_ARCHS ""
#endif

namespace py = pybind11;

namespace tep_bindings {

void check(tep_status status) {
  if (status != TEP_SUCCESS) throw std::runtime_error(tep_last_error());
}

}  // namespace tep_bindings

namespace {

// "89;90;100" (the build's TE_PARALLEL_CUDA_ARCHS, normalised) -> ["89", "90", "100"].
std::vector<std::string> built_archs() {
  std::vector<std::string> archs;
  std::string current;
  for (const char* c = TEP_BUILT_ARCHS;; ++c) {
    if (*c == ';' || *c == '\0') {
      if (!current.empty()) archs.push_back(current);
      current.clear();
      if (*c == '\0') break;
    } else {
      current.push_back(*c);
    }
  }
  return archs;
}

// tep_dtype codes by torch's names for the same element types (torch.<name>), so that Python builds
// its dtype -> code map from the enum itself.
py::dict dtype_codes() {
  py::dict codes;
  codes["float32"] = static_cast<int>(TEP_FLOAT32);
  codes["float16"] = static_cast<int>(TEP_FLOAT16);
  codes["bfloat16"] = static_cast<int>(TEP_BFLOAT16);
  codes["float8_e4m3fn"] = static_cast<int>(TEP_FLOAT8_E4M3);
  codes["float8_e5m2"] = static_cast<int>(TEP_FLOAT8_E5M2);
  return codes;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "te_parallel native kernels (C API over raw device pointers; no torch dependency)";
  m.attr("__version__") = tep_version();
  m.attr("DTYPES") = dtype_codes();
  m.def("version", &tep_version, "Library version, e.g. '0.1.0'.");
  m.def("cuda_runtime_version", &tep_cuda_runtime_version,
        "CUDA runtime version linked in (statically), e.g. 13000.");
  m.def("device_count", &tep_device_count, "Visible CUDA devices; 0 without a driver or GPU.");
  m.def("built_archs", &built_archs, "CUDA architectures compiled in, e.g. ['89', '90', '100'].");
  // Each kernel family binds itself from its own file (csrc/bindings/<family>.cpp).
  tep_bindings::bind_cast(m);
  tep_bindings::bind_scaling(m);
  tep_bindings::bind_norm(m);
  tep_bindings::bind_activation(m);
  tep_bindings::bind_comm_overlap(m);
  tep_bindings::bind_gemm(m);
  tep_bindings::bind_rope(m);
  tep_bindings::bind_dropout(m);
}
