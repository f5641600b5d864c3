// Bindings of the bias + activation kernels (csrc/include/te_parallel/activation.h). Pointers and the
// stream arrive as integers (0 = absent); te_parallel/native/activation.py checks the tensors.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "te_parallel/activation.h"

namespace py = pybind11;

namespace tep_bindings {

namespace {

// The FP8 output block, or "absent" when no FP8 output and no amax is asked for.
struct Fp8Arg {
  tep_fp8_output out;
  bool present;
};

Fp8Arg fp8_arg(std::uintptr_t data, std::uintptr_t data_t, std::uintptr_t scale, std::uintptr_t amax, int dtype) {
  Fp8Arg a{};
  a.out.data = reinterpret_cast<void*>(data);
  a.out.data_t = reinterpret_cast<void*>(data_t);
  a.out.scale = reinterpret_cast<const float*>(scale);
  a.out.amax = reinterpret_cast<float*>(amax);
  a.out.dtype = dtype;
  a.present = data != 0 || data_t != 0 || amax != 0;
  return a;
}

void bias_activation_fwd(int act, std::uintptr_t x, std::uintptr_t bias, int x_dtype, long long rows, long long cols,
                         std::uintptr_t out, std::uintptr_t fp8, std::uintptr_t fp8_t, std::uintptr_t scale,
                         std::uintptr_t amax, int fp8_dtype, std::uintptr_t stream) {
  const Fp8Arg f = fp8_arg(fp8, fp8_t, scale, amax, fp8_dtype);
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_bias_activation_fwd(act, reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(bias),
                                     x_dtype, rows, cols, reinterpret_cast<void*>(out), f.present ? &f.out : nullptr,
                                     reinterpret_cast<void*>(stream));
  }
  check(status);
}

void dbias_dactivation(int act, std::uintptr_t dy, std::uintptr_t x, std::uintptr_t bias, int x_dtype, long long rows,
                       long long cols, std::uintptr_t dx, std::uintptr_t fp8, std::uintptr_t fp8_t,
                       std::uintptr_t scale, std::uintptr_t amax, int fp8_dtype, std::uintptr_t dbias,
                       int dbias_dtype, std::uintptr_t workspace, long long workspace_bytes, std::uintptr_t stream) {
  const Fp8Arg f = fp8_arg(fp8, fp8_t, scale, amax, fp8_dtype);
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_dbias_dactivation(act, reinterpret_cast<const void*>(dy), reinterpret_cast<const void*>(x),
                                   reinterpret_cast<const void*>(bias), x_dtype, rows, cols,
                                   reinterpret_cast<void*>(dx), f.present ? &f.out : nullptr,
                                   reinterpret_cast<void*>(dbias), dbias_dtype, reinterpret_cast<void*>(workspace),
                                   workspace_bytes, reinterpret_cast<void*>(stream));
  }
  check(status);
}

}  // namespace

void bind_activation(pybind11::module_& m) {
  py::dict codes;  // tep_activation codes by TE's activation names
  codes["gelu"] = static_cast<int>(TEP_ACT_GELU);
  codes["relu"] = static_cast<int>(TEP_ACT_RELU);
  codes["silu"] = static_cast<int>(TEP_ACT_SILU);
  codes["qgelu"] = static_cast<int>(TEP_ACT_QGELU);
  codes["srelu"] = static_cast<int>(TEP_ACT_SRELU);
  codes["geglu"] = static_cast<int>(TEP_ACT_GEGLU);
  codes["reglu"] = static_cast<int>(TEP_ACT_REGLU);
  codes["swiglu"] = static_cast<int>(TEP_ACT_SWIGLU);
  codes["qgeglu"] = static_cast<int>(TEP_ACT_QGEGLU);
  codes["sreglu"] = static_cast<int>(TEP_ACT_SREGLU);
  m.attr("ACTIVATIONS") = codes;
  m.def("activation_is_gated", &tep_activation_is_gated, py::arg("act"),
        "1 if the tep_activation code is gated (x has 2F columns, the output F), 0 if not, -1 if unknown.");
  m.def("bias_activation_fwd", &bias_activation_fwd, py::arg("act"), py::arg("x"), py::arg("bias"),
        py::arg("x_dtype"), py::arg("rows"), py::arg("cols"), py::arg("out"), py::arg("fp8"), py::arg("fp8_t"),
        py::arg("scale"), py::arg("amax"), py::arg("fp8_dtype"), py::arg("stream"),
        "y = act(x + bias) for a row-major x [rows, cols] (pointers as ints, 0 = absent): out in x_dtype, fp8 / "
        "fp8_t the FP8 bytes of y * scale and their transpose, amax |y| max. Raises RuntimeError.");
  m.def("dbias_dactivation_workspace_size", &tep_dbias_dactivation_workspace_size, py::arg("rows"), py::arg("cols"),
        "Bytes of workspace dbias_dactivation needs for dbias of x [rows, cols].");
  m.def("dbias_dactivation", &dbias_dactivation, py::arg("act"), py::arg("dy"), py::arg("x"), py::arg("bias"),
        py::arg("x_dtype"), py::arg("rows"), py::arg("cols"), py::arg("dx"), py::arg("fp8"), py::arg("fp8_t"),
        py::arg("scale"), py::arg("amax"), py::arg("fp8_dtype"), py::arg("dbias"), py::arg("dbias_dtype"),
        py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"),
        "dx = dy * act'(x + bias) (pointers as ints, 0 = absent), with its FP8 bytes, transpose and amax, and "
        "dbias = column sums of dx (needs the workspace). Raises RuntimeError.");
}

}  // namespace tep_bindings
