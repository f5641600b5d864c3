// te_parallel._C: the one pybind11 module over the C API (csrc/include/te_parallel/te_parallel.h).
//
// No torch headers: the Python wrapper (te_parallel/_native.py) validates tensors and passes raw
// device pointers (tensor.data_ptr()) and the stream (torch.cuda.Stream.cuda_stream) as integers.
// That keeps the extension independent of the torch version/ABI it is imported next to, and lets it
// build without torch installed.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
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

using tep_bindings::check;

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

// (amax_history_ptr, scale_ptr, scale_inv_ptr, history_len, num_tensors)
using StateTuple = std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, int, int>;

void delayed_scaling_update(const std::vector<StateTuple>& states, float fp8_max,
                            float scale_divisor, int algo, bool update_scale,
                            std::uintptr_t stream) {
  std::vector<tep_scaling_state> c_states;
  c_states.reserve(states.size());
  for (const auto& [hist, scale, scale_inv, history_len, num_tensors] : states) {
    c_states.push_back({reinterpret_cast<float*>(hist), reinterpret_cast<float*>(scale),
                        reinterpret_cast<float*>(scale_inv), history_len, num_tensors});
  }
  tep_status status;
  {
    // Only a launch happens here, but there is no reason to hold the GIL for it.
    py::gil_scoped_release no_gil;
    status = tep_delayed_scaling_update(c_states.data(), static_cast<int>(c_states.size()),
                                        fp8_max, scale_divisor, algo, update_scale ? 1 : 0,
                                        reinterpret_cast<void*>(stream));
  }
  check(status);  // same thread as the call: tep_last_error is thread-local
}

void cast_transpose_amax(std::uintptr_t x, int x_dtype, long long rows, long long cols, std::uintptr_t scale,
                         std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t amax, std::uintptr_t scale_inv,
                         std::uintptr_t scale_out, int out_dtype, std::uintptr_t stream) {
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_cast_transpose_amax(reinterpret_cast<const void*>(x), x_dtype, rows, cols,
                                     reinterpret_cast<const float*>(scale), reinterpret_cast<void*>(out),
                                     reinterpret_cast<void*>(out_t), reinterpret_cast<float*>(amax),
                                     reinterpret_cast<float*>(scale_inv), reinterpret_cast<float*>(scale_out),
                                     out_dtype, reinterpret_cast<void*>(stream));
  }
  check(status);
}

void cast_transpose_dbias(std::uintptr_t x, int x_dtype, long long rows, long long cols, std::uintptr_t scale,
                          std::uintptr_t out, std::uintptr_t out_t, std::uintptr_t amax, std::uintptr_t scale_inv,
                          int out_dtype, std::uintptr_t dbias, int dbias_dtype, std::uintptr_t workspace,
                          long long workspace_bytes, std::uintptr_t stream) {
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_cast_transpose_dbias(reinterpret_cast<const void*>(x), x_dtype, rows, cols,
                                      reinterpret_cast<const float*>(scale), reinterpret_cast<void*>(out),
                                      reinterpret_cast<void*>(out_t), reinterpret_cast<float*>(amax),
                                      reinterpret_cast<float*>(scale_inv), out_dtype, reinterpret_cast<void*>(dbias),
                                      dbias_dtype, reinterpret_cast<void*>(workspace), workspace_bytes,
                                      reinterpret_cast<void*>(stream));
  }
  check(status);
}

void transpose_fp8(std::uintptr_t x, long long rows, long long cols, std::uintptr_t out_t, std::uintptr_t stream) {
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_transpose_fp8(reinterpret_cast<const void*>(x), rows, cols, reinterpret_cast<void*>(out_t),
                               reinterpret_cast<void*>(stream));
  }
  check(status);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "te_parallel native kernels (C API over raw device pointers; no torch dependency)";
  m.attr("__version__") = tep_version();
  m.def("version", &tep_version, "Library version, e.g. '0.1.0'.");
  m.def("cuda_runtime_version", &tep_cuda_runtime_version,
        "CUDA runtime version linked in (statically), e.g. 13000.");
  m.def("device_count", &tep_device_count, "Visible CUDA devices; 0 without a driver or GPU.");
  m.def("built_archs", &built_archs, "CUDA architectures compiled in, e.g. ['89', '90', '100'].");
  m.def("delayed_scaling_update", &delayed_scaling_update, py::arg("states"), py::arg("fp8_max"),
        py::arg("scale_divisor"), py::arg("algo"), py::arg("update_scale"), py::arg("stream"),
        "Fused delayed-scaling update of all states in one launch. states: list of "
        "(amax_history_ptr, scale_ptr, scale_inv_ptr, history_len, num_tensors); algo 0 = max "
        "over history, 1 = most recent; stream: cudaStream_t as int. Raises RuntimeError.");
  m.def("cast_transpose_amax", &cast_transpose_amax, py::arg("x"), py::arg("x_dtype"), py::arg("rows"),
        py::arg("cols"), py::arg("scale"), py::arg("out"), py::arg("out_t"), py::arg("amax"),
        py::arg("scale_inv"), py::arg("scale_out"), py::arg("out_dtype"), py::arg("stream"),
        "FP8 cast of a row-major [rows, cols] matrix (out) and/or its transposed copy (out_t), with amax, "
        "scale_inv = 1/scale and scale_out = scale (pointers as ints, 0 = absent); dtypes as tep_dtype codes. "
        "Raises RuntimeError.");
  m.def("cast_transpose_dbias", &cast_transpose_dbias, py::arg("x"), py::arg("x_dtype"), py::arg("rows"),
        py::arg("cols"), py::arg("scale"), py::arg("out"), py::arg("out_t"), py::arg("amax"), py::arg("scale_inv"),
        py::arg("out_dtype"), py::arg("dbias"), py::arg("dbias_dtype"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("stream"),
        "cast_transpose_amax plus dbias = column sums of x (fp32, fixed order) into dbias [cols].");
  m.def("cast_transpose_dbias_workspace_size", &tep_cast_transpose_dbias_workspace_size, py::arg("rows"),
        py::arg("cols"), "Bytes of workspace cast_transpose_dbias needs.");
  m.def("transpose_fp8", &transpose_fp8, py::arg("x"), py::arg("rows"), py::arg("cols"), py::arg("out_t"),
        py::arg("stream"), "Transpose of a row-major [rows, cols] byte (FP8) matrix into out_t [cols, rows].");
  // Each kernel family binds itself from its own file (csrc/bindings/<family>.cpp).
  tep_bindings::bind_norm(m);
  tep_bindings::bind_activation(m);
  tep_bindings::bind_comm_overlap(m);
  tep_bindings::bind_gemm(m);
}
