// Binding of the RoPE kernel (csrc/include/te_parallel/rope.h). Pointers and the stream arrive as
// integers; te_parallel/native/rope.py checks the tensors.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "te_parallel/rope.h"

namespace py = pybind11;

namespace tep_bindings {

namespace {

void rope(std::uintptr_t x, std::uintptr_t out, std::uintptr_t freqs, int dtype, long long s, long long b,
          long long h, long long d, long long xs, long long xb, long long xh, long long os, long long ob,
          long long oh, long long fs, int rot, bool backward, std::uintptr_t stream) {
  const tep_rope_params p{reinterpret_cast<const void*>(x), reinterpret_cast<void*>(out),
                          reinterpret_cast<const float*>(freqs), dtype, s, b, h, d, xs, xb, xh, os, ob, oh, fs, rot,
                          backward ? 1 : 0};
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_rope(&p, reinterpret_cast<void*>(stream));
  }
  check(status);
}

}  // namespace

void bind_rope(py::module_& m) {
  m.def("rope", &rope, py::arg("x"), py::arg("out"), py::arg("freqs"), py::arg("dtype"), py::arg("s"), py::arg("b"),
        py::arg("h"), py::arg("d"), py::arg("x_stride_s"), py::arg("x_stride_b"), py::arg("x_stride_h"),
        py::arg("out_stride_s"), py::arg("out_stride_b"), py::arg("out_stride_h"), py::arg("freqs_stride_s"),
        py::arg("rot"), py::arg("backward"), py::arg("stream"),
        "RoPE forward (or its transpose, backward) of a [S][B][H][D] view into out. Raises RuntimeError.");
}

}  // namespace tep_bindings
