// Bindings of the LayerNorm / RMSNorm kernels (C API: csrc/include/te_parallel/norm.h).
//
// Pointers arrive as integers (0 = NULL) from te_parallel/native/norm.py, which checks the
// tensors; the GIL is released around the launches.
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "bindings.h"
#include "te_parallel/norm.h"

namespace py = pybind11;

namespace tep_bindings {

namespace {

tep_norm_params make_params(int norm_type, long long rows, long long hidden, float eps, bool zero_centered_gamma,
                            std::uintptr_t gamma, std::uintptr_t beta, int w_dtype) {
  return {norm_type, rows, hidden, eps, zero_centered_gamma ? 1 : 0, ptr<const void>(gamma), ptr<const void>(beta),
          w_dtype};
}

void norm_fwd(int norm_type, long long rows, long long hidden, float eps, bool zero_centered_gamma,
              std::uintptr_t gamma, std::uintptr_t beta, int w_dtype, std::uintptr_t x, int x_dtype,
              std::uintptr_t out, int out_dtype, std::uintptr_t scale, std::uintptr_t out_t, std::uintptr_t amax,
              std::uintptr_t mu, std::uintptr_t rsigma, std::uintptr_t stream) {
  const tep_norm_params p = make_params(norm_type, rows, hidden, eps, zero_centered_gamma, gamma, beta, w_dtype);
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_norm_fwd(&p, ptr<const void>(x), x_dtype, ptr<void>(out), out_dtype, ptr<const float>(scale),
                          ptr<void>(out_t), ptr<float>(amax), ptr<float>(mu), ptr<float>(rsigma), ptr<void>(stream));
  }
  check(status);
}

std::size_t norm_bwd_workspace_size(int norm_type, long long rows, long long hidden, int w_dtype, int x_dtype) {
  // Only the shape and dtypes matter here; a non-NULL dummy gamma passes the argument check.
  const tep_norm_params p = make_params(norm_type, rows, hidden, 0.f, false, 1, 0, w_dtype);
  std::size_t bytes = 0;
  check(tep_norm_bwd_workspace_size(&p, x_dtype, &bytes));
  return bytes;
}

void norm_bwd(int norm_type, long long rows, long long hidden, bool zero_centered_gamma, std::uintptr_t gamma,
              int w_dtype, std::uintptr_t dy, std::uintptr_t x, int x_dtype, std::uintptr_t mu, std::uintptr_t rsigma,
              std::uintptr_t dx, std::uintptr_t dgamma, std::uintptr_t dbeta, std::uintptr_t workspace,
              std::size_t workspace_bytes, std::uintptr_t stream) {
  const tep_norm_params p = make_params(norm_type, rows, hidden, 0.f, zero_centered_gamma, gamma, 0, w_dtype);
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_norm_bwd(&p, ptr<const void>(dy), ptr<const void>(x), x_dtype, ptr<const float>(mu),
                          ptr<const float>(rsigma), ptr<void>(dx), ptr<void>(dgamma), ptr<void>(dbeta),
                          ptr<void>(workspace), workspace_bytes, ptr<void>(stream));
  }
  check(status);
}

}  // namespace

void bind_norm(py::module_& m) {
  m.attr("LAYERNORM") = static_cast<int>(TEP_LAYERNORM);
  m.attr("RMSNORM") = static_cast<int>(TEP_RMSNORM);
  py::dict types;  // tep_norm_type codes by the Python functions' names
  types["layer_norm"] = static_cast<int>(TEP_LAYERNORM);
  types["rms_norm"] = static_cast<int>(TEP_RMSNORM);
  m.attr("NORM_TYPES") = types;
  m.def("norm_fwd", &norm_fwd, py::arg("norm_type"), py::arg("rows"), py::arg("hidden"), py::arg("eps"),
        py::arg("zero_centered_gamma"), py::arg("gamma"), py::arg("beta"), py::arg("w_dtype"), py::arg("x"),
        py::arg("x_dtype"), py::arg("out"), py::arg("out_dtype"), py::arg("scale"), py::arg("out_t"),
        py::arg("amax"), py::arg("mu"), py::arg("rsigma"), py::arg("stream"),
        "LayerNorm (norm_type 0) / RMSNorm (1) forward of a row-major [rows, hidden] matrix (pointers as ints, "
        "0 = absent; dtypes as tep_dtype codes); see te_parallel/norm.h. Raises RuntimeError.");
  m.def("norm_bwd_workspace_size", &norm_bwd_workspace_size, py::arg("norm_type"), py::arg("rows"),
        py::arg("hidden"), py::arg("w_dtype"), py::arg("x_dtype"),
        "Bytes of workspace norm_bwd needs on the current device.");
  m.def("norm_bwd", &norm_bwd, py::arg("norm_type"), py::arg("rows"), py::arg("hidden"),
        py::arg("zero_centered_gamma"), py::arg("gamma"), py::arg("w_dtype"), py::arg("dy"), py::arg("x"),
        py::arg("x_dtype"), py::arg("mu"), py::arg("rsigma"), py::arg("dx"), py::arg("dgamma"), py::arg("dbeta"),
        py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"),
        "Backward of norm_fwd: dx, dgamma and (LayerNorm with bias) dbeta; deterministic. Raises RuntimeError.");
}

}  // namespace tep_bindings
