// Binding of tep_gemm (csrc/include/te_parallel/gemm.h). Pointers and the stream arrive as
// integers (0 = absent); te_parallel/native/gemm.py checks the tensors. The GIL stays held: the call only
// enqueues work, and releasing and re-taking it would cost more host time than the call itself.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "te_parallel/gemm.h"

namespace py = pybind11;

namespace tep_bindings {

namespace {

void gemm(std::uintptr_t a, int a_dtype, std::uintptr_t b, int b_dtype, long long m, long long n, long long k,
          std::uintptr_t scale_a, std::uintptr_t scale_b, std::uintptr_t c, std::uintptr_t d, int d_dtype,
          std::uintptr_t bias, bool fast_accum, std::uintptr_t workspace, size_t workspace_bytes,
          std::uintptr_t stream) {
  check(tep_gemm(ptr<const void>(a), a_dtype, ptr<const void>(b), b_dtype, m, n, k, ptr<const float>(scale_a),
                     ptr<const float>(scale_b), ptr<const void>(c), ptr<void>(d), d_dtype, ptr<const void>(bias),
                     fast_accum ? 1 : 0, ptr<void>(workspace), workspace_bytes, ptr<void>(stream)));
}

// (times of the candidates in ms, -1 where one failed; index now chosen)
py::tuple gemm_tune(std::uintptr_t a, int a_dtype, std::uintptr_t b, int b_dtype, long long m, long long n, long long k,
                    std::uintptr_t scale_a, std::uintptr_t scale_b, std::uintptr_t c, std::uintptr_t d, int d_dtype,
                    std::uintptr_t bias, bool fast_accum, std::uintptr_t workspace, size_t workspace_bytes,
                    std::uintptr_t stream, int rounds, int reps) {
  float ms[8];
  int num = 0, chosen = 0;
  tep_status status;
  {
    py::gil_scoped_release no_gil;  // (it waits for the GPU)
    status = tep_gemm_tune(ptr<const void>(a), a_dtype, ptr<const void>(b), b_dtype, m, n, k,
                                      ptr<const float>(scale_a), ptr<const float>(scale_b), ptr<const void>(c),
                                      ptr<void>(d), d_dtype, ptr<const void>(bias), fast_accum ? 1 : 0,
                                      ptr<void>(workspace), workspace_bytes, ptr<void>(stream), rounds, reps, ms, &num,
                                      &chosen);
  }
  check(status);  // (same thread: tep_last_error is thread-local)
  py::list times;
  for (int i = 0; i < num; ++i) times.append(ms[i]);
  return py::make_tuple(times, chosen);
}

}  // namespace

void bind_gemm(py::module_& m) {
  m.def("gemm_available", [] { return tep_gemm_available() != 0; },
        "True if cuBLASLt can be opened (else tep_last_error() says why: see gemm_unavailable_reason)");
  m.def("gemm_unavailable_reason", [] { return tep_gemm_available() ? std::string() : std::string(tep_last_error()); });
  m.def("gemm_cached_plans", &tep_gemm_cached_plans);
  m.def(
      "gemm_workspace",
      [](int device, std::uintptr_t stream, std::size_t bytes) {
        void* ws = nullptr;
        check(tep_gemm_workspace(device, reinterpret_cast<void*>(stream), bytes, &ws));
        return reinterpret_cast<std::uintptr_t>(ws);
      },
      "The GEMM workspace of (device, stream) (cudaMalloc'd once, kept); 0 while the stream is being captured "
      "and has none.");
  m.def("gemm_tune", &gemm_tune, py::arg("a"), py::arg("a_dtype"), py::arg("b"), py::arg("b_dtype"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("scale_a"), py::arg("scale_b"), py::arg("c"), py::arg("d"),
        py::arg("d_dtype"), py::arg("bias"), py::arg("fast_accum"), py::arg("workspace"), py::arg("workspace_bytes"),
        py::arg("stream"), py::arg("rounds"), py::arg("reps"),
        "Times the cached plan's candidate algorithms for gemm's arguments and keeps the fastest: "
        "([ms per candidate, -1 = failed], chosen index). Synchronizes with the stream.");
  m.def("gemm_choose",
        [](std::uintptr_t a, int a_dtype, std::uintptr_t b, int b_dtype, long long m, long long n, long long k,
           std::uintptr_t c, std::uintptr_t d, int d_dtype, std::uintptr_t bias, bool fast_accum,
           size_t workspace_bytes, int index) {
          check(tep_gemm_choose(ptr<const void>(a), a_dtype, ptr<const void>(b), b_dtype, m, n, k, ptr<const void>(c),
                                ptr<const void>(d), d_dtype, ptr<const void>(bias), fast_accum ? 1 : 0,
                                workspace_bytes, index));
        },
        py::arg("a"), py::arg("a_dtype"), py::arg("b"), py::arg("b_dtype"), py::arg("m"), py::arg("n"), py::arg("k"),
        py::arg("c"), py::arg("d"), py::arg("d_dtype"), py::arg("bias"), py::arg("fast_accum"),
        py::arg("workspace_bytes"), py::arg("index"),
        "Makes candidate `index` the algorithm gemm runs for these arguments (0: the heuristic's pick).");
  m.def("gemm", &gemm, py::arg("a"), py::arg("a_dtype"), py::arg("b"), py::arg("b_dtype"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("scale_a"), py::arg("scale_b"), py::arg("c"), py::arg("d"),
        py::arg("d_dtype"), py::arg("bias"), py::arg("fast_accum"), py::arg("workspace"), py::arg("workspace_bytes"),
        py::arg("stream"),
        "D[m, n] = scale_a*scale_b * A[m, k]·B[n, k]ᵀ (+ bias[n]) (+ C[m, n]) through cuBLASLt (pointers as ints; scales 0 for bf16/fp16 operands)");
}

}  // namespace tep_bindings
