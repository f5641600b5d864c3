// Binding of the dropout kernel (csrc/include/te_parallel/dropout.h). Pointers and the stream arrive as
// integers; te_parallel/native/dropout.py checks the tensors.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "te_parallel/dropout.h"

namespace py = pybind11;

namespace tep_bindings {

namespace {

void dropout_add(std::uintptr_t x, std::uintptr_t residual, std::uintptr_t out, int dtype, long long n, float p,
                 std::uint64_t seed, std::uint64_t offset, std::uintptr_t stream) {
  const tep_dropout_params params{reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(residual),
                                  reinterpret_cast<void*>(out), dtype, n, p, seed, offset};
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_dropout_add(&params, reinterpret_cast<void*>(stream));
  }
  check(status);
}

}  // namespace

void bind_dropout(py::module_& m) {
  m.def("dropout_add", &dropout_add, py::arg("x"), py::arg("residual"), py::arg("out"), py::arg("dtype"), py::arg("n"),
        py::arg("p"), py::arg("seed"), py::arg("offset"), py::arg("stream"),
        "out = residual + dropout(x) (residual 0: dropout alone) with the mask of (seed, offset, element index); "
        "the backward calls it with x = the gradient and no residual. Raises RuntimeError.");
  m.def("dropout_keep_threshold", &tep_dropout_keep_threshold, py::arg("p"),
        "The Philox word below which an element is kept, for drop probability p.");
}

}  // namespace tep_bindings
