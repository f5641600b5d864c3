// Bindings of csrc/comm_gemm_overlap (te_parallel/native/comm_overlap.py wraps them; the protocol's
// Python side is te_parallel/parallel/ub_transport.py).
//
// The communicator is a Python object owning a tep_comm*; the bootstrap all-gather is a Python
// callable bytes -> bytes (every rank's bytes concatenated in rank order), called with the GIL held.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "te_parallel/comm_gemm_overlap.h"

namespace py = pybind11;

namespace tep_bindings {

namespace {

struct BootstrapContext {
  py::function allgather;
  int world = 0;
  std::string error;  // a Python exception raised inside the callback, re-raised after create
};

int bootstrap_trampoline(void* ctx, const void* send, void* recv, size_t bytes) {
  auto* context = static_cast<BootstrapContext*>(ctx);
  try {
    py::bytes mine(static_cast<const char*>(send), bytes);
    py::object result = context->allgather(mine);
    std::string all = result.cast<std::string>();
    if (all.size() != bytes * static_cast<size_t>(context->world)) {
      context->error = "bootstrap all-gather returned " + std::to_string(all.size()) + " bytes; need " +
                       std::to_string(bytes * context->world) + " (world_size x " + std::to_string(bytes) + ")";
      return 1;
    }
    std::memcpy(recv, all.data(), all.size());
    return 0;
  } catch (py::error_already_set& err) {
    context->error = err.what();
    return 1;
  }
}

class Communicator {
 public:
  Communicator(int rank, int world, size_t buffer_bytes, int num_flags, py::function allgather) : rank_(rank) {
    BootstrapContext context{allgather, world, {}};
    tep_status status = tep_comm_create(rank, world, buffer_bytes, num_flags, &bootstrap_trampoline, &context, &comm_);
    if (!context.error.empty()) throw std::runtime_error("comm_gemm_overlap (rank " + std::to_string(rank) +
                                                         "): bootstrap failed: " + context.error);
    check(status);
  }
  ~Communicator() { tep_comm_destroy(comm_); }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  void close() {
    tep_status status = tep_comm_destroy(comm_);
    comm_ = nullptr;
    check(status);
  }
  std::uintptr_t buffer(int peer) const { return reinterpret_cast<std::uintptr_t>(tep_comm_buffer(live(), peer)); }
  std::uintptr_t flags(int peer) const { return reinterpret_cast<std::uintptr_t>(tep_comm_flags(live(), peer)); }
  void copy(std::uintptr_t dst, std::uintptr_t src, size_t bytes, std::uintptr_t stream) {
    check(tep_comm_copy(live(), reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                        reinterpret_cast<void*>(stream)));
  }
  void signal(int peer, int flag, uint32_t value, std::uintptr_t stream) {
    check(tep_comm_signal(live(), peer, flag, value, reinterpret_cast<void*>(stream)));
  }
  void wait(int flag, uint32_t value, std::uintptr_t stream) {
    check(tep_comm_wait(live(), flag, value, reinterpret_cast<void*>(stream)));
  }
  void claim(const std::vector<int>& flags, std::uintptr_t stream) {
    check(tep_comm_claim(live(), flags.data(), static_cast<int>(flags.size()), reinterpret_cast<void*>(stream)));
  }
  void release(int flag, int peer, int peer_flag, std::uintptr_t stream) {
    check(tep_comm_release(live(), flag, peer, peer_flag, reinterpret_cast<void*>(stream)));
  }
  static tep_gemm_args args(std::uintptr_t a, int a_dtype, std::uintptr_t b, int b_dtype, std::uintptr_t scale_a,
                            std::uintptr_t scale_b, long long k, long long n, std::uintptr_t bias, bool fast_accum,
                            std::uintptr_t workspace, size_t workspace_bytes) {
    return tep_gemm_args{ptr<const void>(a), a_dtype, ptr<const void>(b), b_dtype, ptr<const float>(scale_a),
                         ptr<const float>(scale_b), k, n, ptr<const void>(bias), fast_accum ? 1 : 0,
                         ptr<void>(workspace), workspace_bytes};
  }
  // The GIL stays held in the fused ops: they only enqueue work (a few dozen launches and stream operations).
  void gemm_rs(std::uintptr_t a, int a_dtype, std::uintptr_t b, int b_dtype, std::uintptr_t scale_a,
               std::uintptr_t scale_b, long long k, long long n, bool fast_accum, std::uintptr_t workspace,
               size_t workspace_bytes, long long m, int out_dtype, std::uintptr_t out, std::uintptr_t received,
               size_t send_offset, size_t slot_stride, const std::vector<long long>& piece_starts, int own_group,
               int ready_flag, int busy_flag, std::uintptr_t stream, std::uintptr_t side_stream) {
    tep_gemm_args g = args(a, a_dtype, b, b_dtype, scale_a, scale_b, k, n, 0, fast_accum, workspace, workspace_bytes);
    const int pieces = piece_starts.size() > 1 ? static_cast<int>(piece_starts.size()) - 1 : 1;
    check(tep_comm_gemm_rs(live(), &g, m, out_dtype, ptr<void>(out), ptr<void>(received), send_offset, slot_stride,
                           piece_starts.size() > 2 ? piece_starts.data() : nullptr, pieces, own_group, ready_flag,
                           busy_flag, ptr<void>(stream), ptr<void>(side_stream)));
  }
  void ag_gemm(std::uintptr_t a, int a_dtype, std::uintptr_t b, int b_dtype, std::uintptr_t scale_a,
               std::uintptr_t scale_b, long long k, long long n, std::uintptr_t bias, bool fast_accum,
               std::uintptr_t workspace, size_t workspace_bytes, long long m, int out_dtype, std::uintptr_t out,
               std::uintptr_t gathered, size_t recv_offset, size_t slot_bytes, int ready_flag, int busy_flag,
               std::uintptr_t stream, std::uintptr_t side_stream) {
    tep_gemm_args g = args(a, a_dtype, b, b_dtype, scale_a, scale_b, k, n, bias, fast_accum, workspace, workspace_bytes);
    check(tep_comm_ag_gemm(live(), &g, m, out_dtype, ptr<void>(out), ptr<void>(gathered), recv_offset, slot_bytes,
                           ready_flag, busy_flag, ptr<void>(stream), ptr<void>(side_stream)));
  }

 private:
  tep_comm* live() const {
    if (comm_ == nullptr) throw std::runtime_error("comm_gemm_overlap: the communicator was closed");
    return comm_;
  }
  tep_comm* comm_ = nullptr;
  int rank_;
};

void reduce_sum(const std::vector<std::uintptr_t>& inputs, int in_dtype, std::uintptr_t out, int out_dtype,
                size_t numel, std::uintptr_t stream) {
  std::vector<const void*> ptrs;
  for (auto p : inputs) ptrs.push_back(reinterpret_cast<const void*>(p));
  tep_status status;
  {
    py::gil_scoped_release no_gil;
    status = tep_reduce_sum(ptrs.data(), static_cast<int>(ptrs.size()), in_dtype, reinterpret_cast<void*>(out),
                            out_dtype, numel, reinterpret_cast<void*>(stream));
  }
  check(status);
}

}  // namespace

void bind_comm_overlap(py::module_& m) {
  py::class_<Communicator>(m, "Communicator",
                           "IPC-shared buffer + flags for one TP group (csrc/comm_gemm_overlap). Addresses "
                           "and streams are ints; all calls enqueue on the given stream.")
      .def(py::init<int, int, size_t, int, py::function>(), py::arg("rank"), py::arg("world_size"),
           py::arg("buffer_bytes"), py::arg("num_flags"), py::arg("allgather"),
           "Collective: allocate on the current device, exchange IPC handles with allgather(bytes) -> "
           "bytes (all ranks' bytes in rank order), map the peers. Raises RuntimeError.")
      .def("close", &Communicator::close, "Synchronise the device, unmap peers, free the buffer.")
      .def("buffer", &Communicator::buffer, py::arg("peer"), "Device address of peer's data buffer.")
      .def("flags", &Communicator::flags, py::arg("peer"), "Device address of peer's uint32 flags.")
      .def("copy", &Communicator::copy, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"),
           "Copy-engine copy (peer-mapped addresses allowed).")
      .def("signal", &Communicator::signal, py::arg("peer"), py::arg("flag"), py::arg("value"), py::arg("stream"),
           "Fence, then set peer's flags[flag] = value, on the stream.")
      .def("wait", &Communicator::wait, py::arg("flag"), py::arg("value"), py::arg("stream"),
           "The stream waits until own flags[flag] >= value.")
      .def("claim", &Communicator::claim, py::arg("flags"), py::arg("stream"),
           "One batch on the stream: for each own flag in turn, wait until it is 0, then set it to 1.")
      .def("release", &Communicator::release, py::arg("flag"), py::arg("peer"), py::arg("peer_flag"),
           py::arg("stream"), "One batch on the stream: clear own flags[flag], then (fenced) peer's flags[peer_flag].")
      .def("gemm_rs", &Communicator::gemm_rs, py::arg("a"), py::arg("a_dtype"), py::arg("b"), py::arg("b_dtype"),
           py::arg("scale_a"), py::arg("scale_b"), py::arg("k"), py::arg("n"), py::arg("fast_accum"),
           py::arg("workspace"), py::arg("workspace_bytes"), py::arg("m"), py::arg("out_dtype"), py::arg("out"),
           py::arg("received"), py::arg("send_offset"), py::arg("slot_stride"), py::arg("piece_starts"),
           py::arg("own_group"), py::arg("ready_flag"), py::arg("busy_flag"), py::arg("stream"), py::arg("side_stream"),
           "tep_comm_gemm_rs: the whole row-parallel GEMM + reduce-scatter schedule in one call "
           "(piece_starts: [0, ..., m] row bounds of the pieces, or [] for whole partials).")
      .def("ag_gemm", &Communicator::ag_gemm, py::arg("a"), py::arg("a_dtype"), py::arg("b"), py::arg("b_dtype"),
           py::arg("scale_a"), py::arg("scale_b"), py::arg("k"), py::arg("n"), py::arg("bias"), py::arg("fast_accum"),
           py::arg("workspace"), py::arg("workspace_bytes"), py::arg("m"), py::arg("out_dtype"), py::arg("out"),
           py::arg("gathered"), py::arg("recv_offset"), py::arg("slot_bytes"), py::arg("ready_flag"),
           py::arg("busy_flag"), py::arg("stream"), py::arg("side_stream"),
           "tep_comm_ag_gemm: the whole all-gather + GEMM ring in one call (gathered: 0, or where to keep "
           "the gathered A).");
  m.def("reduce_sum", &reduce_sum, py::arg("inputs"), py::arg("in_dtype"), py::arg("out"), py::arg("out_dtype"),
        py::arg("numel"), py::arg("stream"),
        "out = sum of inputs (device addresses, 1..8), fp32 accumulation in list order.");
}

}  // namespace tep_bindings
