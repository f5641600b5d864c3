// Bindings of the FP8 cast kernels (tep_cast_transpose_amax, tep_cast_transpose_dbias,
// tep_transpose_fp8: te_parallel/te_parallel.h). Pointers and the stream arrive as integers
// (0 = absent); te_parallel/native/cast.py checks the tensors.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "te_parallel/te_parallel.h"

namespace py = pybind11;

namespace tep_bindings {

namespace {

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

void bind_cast(py::module_& m) {
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
}

}  // namespace tep_bindings
