// Binding of the fused delayed-scaling update (tep_delayed_scaling_update, te_parallel/te_parallel.h).
// Pointers and the stream arrive as integers; te_parallel/native/scaling.py checks the tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "te_parallel/te_parallel.h"

namespace py = pybind11;

namespace tep_bindings {

namespace {

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

void current_scale(std::uintptr_t x, int x_dtype, long long n, std::uintptr_t amax_in, float fp8_max,
                   std::uintptr_t partials, std::uintptr_t amax_out, std::uintptr_t scale_out,
                   std::uintptr_t scale_inv_out, std::uintptr_t stream) {
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_current_scale(reinterpret_cast<const void*>(x), x_dtype, n, reinterpret_cast<const float*>(amax_in),
                               fp8_max, reinterpret_cast<float*>(partials), reinterpret_cast<float*>(amax_out),
                               reinterpret_cast<float*>(scale_out), reinterpret_cast<float*>(scale_inv_out),
                               reinterpret_cast<void*>(stream));
  }
  check(status);
}

}  // namespace

void bind_scaling(py::module_& m) {
  py::dict algos;  // tep_amax_algo codes by the recipe's names (DelayedScaling.amax_compute_algo)
  algos["max"] = static_cast<int>(TEP_AMAX_MAX);
  algos["most_recent"] = static_cast<int>(TEP_AMAX_MOST_RECENT);
  m.attr("AMAX_ALGOS") = algos;
  m.def("delayed_scaling_update", &delayed_scaling_update, py::arg("states"), py::arg("fp8_max"),
        py::arg("scale_divisor"), py::arg("algo"), py::arg("update_scale"), py::arg("stream"),
        "Fused delayed-scaling update of all states in one launch. states: list of "
        "(amax_history_ptr, scale_ptr, scale_inv_ptr, history_len, num_tensors); algo: an AMAX_ALGOS "
        "code (0 = max over history, 1 = most recent); stream: cudaStream_t as int. Raises RuntimeError.");
  m.def("current_scale_partials", &tep_current_scale_partials, py::arg("n"),
        "Floats of scratch that current_scale needs for an n-element x.");
  m.def("current_scale", &current_scale, py::arg("x"), py::arg("x_dtype"), py::arg("n"), py::arg("amax_in"),
        py::arg("fp8_max"), py::arg("partials"), py::arg("amax_out"), py::arg("scale_out"),
        py::arg("scale_inv_out"), py::arg("stream"),
        "amax of x (or amax_in) and the current-scaling scale / scale_inv it gives (pointers as ints, 0 = "
        "none). Raises RuntimeError.");
}

}  // namespace tep_bindings
