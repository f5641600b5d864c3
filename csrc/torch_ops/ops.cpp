// te_parallel's torch custom ops (namespace `te_parallel`), on torch's stable C++ ABI.
//
// A thin layer over the C API (csrc/include/te_parallel): it exists for host time and for
// torch.compile. Called through torch's dispatcher, one op does the work of several Python-level calls
// (checks, allocations, the current stream, the launches) in C++; and torch.compile traces the ops as
// opaque nodes through the fake kernels that te_parallel/native/torch_ops.py registers, instead of
// breaking its graph at a pybind11 call that takes raw pointers.
//
// Only torch's stable ABI is used (torch/csrc/stable, the C shim): a build targets
// TORCH_TARGET_VERSION (2.11, set by setup.py) and runs on that torch and later ones. The ops here
// hold their CUDA kernels; their schemas are defined here too, and their CPU kernels (the PyTorch
// references) and fake kernels are registered from Python.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "te_parallel/gemm.h"
#include "te_parallel/te_parallel.h"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// cuBLASLt's workspace per GEMM (what its Hopper FP8 kernels may ask for; te_parallel.native.gemm's too).
constexpr int64_t kWorkspaceBytes = 32 * 1024 * 1024;

int tep_dtype_of(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return TEP_FLOAT32;
    case ScalarType::Half: return TEP_FLOAT16;
    case ScalarType::BFloat16: return TEP_BFLOAT16;
    case ScalarType::Float8_e4m3fn: return TEP_FLOAT8_E4M3;
    case ScalarType::Float8_e5m2: return TEP_FLOAT8_E5M2;
    default: return -1;
  }
}

bool is_fp8(ScalarType t) { return t == ScalarType::Float8_e4m3fn || t == ScalarType::Float8_e5m2; }

bool is_high_precision(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

float fp8_max_of(ScalarType t) { return t == ScalarType::Float8_e4m3fn ? 448.0f : 57344.0f; }

void check(tep_status status) { STD_TORCH_CHECK(status == TEP_SUCCESS, tep_last_error()); }

// The current CUDA stream of `device`. torch's getter lives in libtorch_cuda, which a CPU build of torch
// does not have: it is looked up when first needed (only CUDA kernels need it), not linked.
void* current_stream(int32_t device) {
  using Getter = AOTITorchError (*)(int32_t, void**);
  static Getter getter = [] {
    void* lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    return lib == nullptr ? nullptr : reinterpret_cast<Getter>(dlsym(lib, "aoti_torch_get_current_cuda_stream"));
  }();
  STD_TORCH_CHECK(getter != nullptr, "te_parallel ops: torch's CUDA library (libtorch_cuda.so) is not loaded");
  void* stream = nullptr;
  STD_TORCH_CHECK(getter(device, &stream) == AOTI_TORCH_SUCCESS, "te_parallel ops: no current CUDA stream on device ",
                  device);
  return stream;
}

// Kernels launch on the calling thread's current device: switch to the tensors' device only when it is
// another one (the usual case costs one query).
struct OnDevice {
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  void* stream;
  explicit OnDevice(const Tensor& t) {
    int32_t index = t.get_device_index();
    int32_t current = 0;
    STD_TORCH_CHECK(aoti_torch_get_current_device_index(&current) == AOTI_TORCH_SUCCESS,
                    "te_parallel ops: cannot read the current device");
    if (current != index) guard.emplace(index);
    stream = current_stream(index);
  }
};

int32_t aoti_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return aoti_torch_dtype_float32();
    case ScalarType::Half: return aoti_torch_dtype_float16();
    case ScalarType::BFloat16: return aoti_torch_dtype_bfloat16();
    case ScalarType::Float8_e4m3fn: return aoti_torch_dtype_float8_e4m3fn();
    case ScalarType::Float8_e5m2: return aoti_torch_dtype_float8_e5m2();
    default: return aoti_torch_dtype_uint8();
  }
}

// A new contiguous tensor on `like`'s device, straight from torch's allocator through the C shim (a
// dispatcher call per allocation would cost several times more host time than the launches).
Tensor empty_like_dev(const Tensor& like, std::initializer_list<int64_t> sizes, ScalarType dtype) {
  std::array<int64_t, 2> strides{1, 1};
  const int64_t* size = sizes.begin();
  if (sizes.size() == 2) strides[0] = size[1];
  AtenTensorHandle handle = nullptr;
  STD_TORCH_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), size, strides.data(),
                                           aoti_dtype(dtype), aoti_torch_device_type_cuda(),
                                           like.get_device_index(), &handle) == AOTI_TORCH_SUCCESS,
                  "te_parallel ops: allocation failed");
  return Tensor(handle);
}

bool f32_cell(const Tensor& t, int32_t device) {
  return t.is_cuda() && t.get_device_index() == device && t.scalar_type() == ScalarType::Float && t.numel() == 1;
}

template <typename T = void>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// (data [rows, cols] or [0, cols], data_t [cols, rows] or [0, rows], scale_inv [], scale snapshot [1] if kept)
std::tuple<Tensor, Tensor, Tensor, std::optional<Tensor>> cast_into(const Tensor& x, const std::optional<Tensor>& scale,
                                                     const std::optional<Tensor>& amax, ScalarType fp8_dtype,
                                                     bool rowwise, bool transpose, bool keep_scale,
                                                     void* stream) {
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor data = empty_like_dev(x, {rowwise ? rows : 0, cols}, fp8_dtype);
  Tensor data_t = empty_like_dev(x, {transpose ? cols : 0, rows}, fp8_dtype);
  Tensor scale_inv = empty_like_dev(x, {}, ScalarType::Float);
  std::optional<Tensor> snapshot;
  if (keep_scale) snapshot = empty_like_dev(x, {1}, ScalarType::Float);
  const float* scale_ptr = nullptr;
  std::optional<Tensor> scratch;
  if (scale.has_value()) {
    scale_ptr = ptr<const float>(*scale);
  } else {  // current scaling: amax(x) -> scale, in two launches, before the cast reads it
    const int64_t n = rows * cols;
    scratch = empty_like_dev(x, {2 + tep_current_scale_partials(n)}, ScalarType::Float);
    float* base = ptr<float>(*scratch);
    check(tep_current_scale(x.data_ptr(), tep_dtype_of(x.scalar_type()), n, nullptr, fp8_max_of(fp8_dtype),
                            base + 2, amax.has_value() ? ptr<float>(*amax) : base + 1, base, nullptr, stream));
    scale_ptr = base;
  }
  check(tep_cast_transpose_amax(x.data_ptr(), tep_dtype_of(x.scalar_type()), rows, cols, scale_ptr,
                                rowwise ? data.data_ptr() : nullptr, transpose ? data_t.data_ptr() : nullptr,
                                scale.has_value() && amax.has_value() ? ptr<float>(*amax) : nullptr,
                                ptr<float>(scale_inv), snapshot.has_value() ? ptr<float>(*snapshot) : nullptr,
                                tep_dtype_of(fp8_dtype), stream));
  return {data, data_t, scale_inv, snapshot};
}

void check_cast_args(const char* op, const Tensor& x, const std::optional<Tensor>& scale,
                     const std::optional<Tensor>& amax, ScalarType fp8_dtype, bool rowwise, bool transpose) {
  const int32_t dev = x.get_device_index();
  STD_TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && is_high_precision(x.scalar_type()) &&
                      x.numel() > 0 && (!scale.has_value() || f32_cell(*scale, dev)) &&
                      (!amax.has_value() || f32_cell(*amax, dev)) && is_fp8(fp8_dtype) && (rowwise || transpose),
                  op, ": need a contiguous non-empty 2-D fp32/fp16/bf16 CUDA x, 1-element fp32 scale and amax on its "
                  "device, an FP8 dtype and at least one output; got x of ", x.dim(), " dims, dtype code ",
                  static_cast<int>(x.scalar_type()), ", contiguous=", x.is_contiguous());
}

// te_parallel::cast_fp8: x [rows, cols] -> FP8 bytes with `scale` (delayed scaling; amax, when given,
// receives max(amax, max|x|)) or, without a scale, with fp8_max / max|x| (current scaling; amax, when
// given, receives max|x|).
std::tuple<Tensor, Tensor, Tensor, Tensor> cast_fp8(Tensor x, std::optional<Tensor> scale,
                                                    std::optional<Tensor> amax, ScalarType fp8_dtype, bool rowwise,
                                                    bool transpose, bool keep_scale) {
  check_cast_args("te_parallel::cast_fp8", x, scale, amax, fp8_dtype, rowwise, transpose);
  OnDevice on(x);
  auto [data, data_t, scale_inv, snapshot] = cast_into(x, scale, amax, fp8_dtype, rowwise, transpose, keep_scale,
                                                       on.stream);
  return {data, data_t, scale_inv, snapshot.has_value() ? *snapshot : empty_like_dev(x, {0}, ScalarType::Float)};
}

// cuBLASLt's workspace of GEMMs issued on `stream` of `like`'s device: the C API's, kept per (device,
// stream) outside torch's allocator (so that no CUDA graph's memory pool holds it: inductor's CUDA graph
// trees refuse a tensor of their pool that outlives their run). On a stream being captured that has none
// yet, the GEMM gets a temporary in `scratch`, freed when the op returns, as any temporary of a captured op.
void* workspace(const Tensor& like, void* stream, std::optional<Tensor>& scratch) {
  void* ws = nullptr;
  check(tep_gemm_workspace(like.get_device_index(), stream, static_cast<size_t>(kWorkspaceBytes), &ws));
  if (ws == nullptr) {
    scratch = empty_like_dev(like, {kWorkspaceBytes}, ScalarType::Byte);
    ws = scratch->data_ptr();
  }
  return ws;
}

void gemm_into(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b, const Tensor& b_scale_inv,
               const std::optional<Tensor>& bias, const std::optional<Tensor>& accumulate, const Tensor& out,
               bool fast_accum, void* stream) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  // cuBLASLt refuses FP8 scale pointers that are not 16-byte aligned ("not supported"), and a compiled
  // graph may hand over a scalar that sits inside a larger buffer: such a scale is copied first.
  auto aligned = [](const Tensor& t) {
    return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0 ? t : torch::stable::clone(t);
  };
  const Tensor sa = aligned(a_scale_inv), sb = aligned(b_scale_inv);
  std::optional<Tensor> scratch;
  void* ws = workspace(a, stream, scratch);
  tep_status status =
      tep_gemm(a.data_ptr(), tep_dtype_of(a.scalar_type()), b.data_ptr(), tep_dtype_of(b.scalar_type()), m, n, k,
               ptr<const float>(sa), ptr<const float>(sb),
               accumulate.has_value() ? accumulate->data_ptr() : nullptr, out.data_ptr(),
               tep_dtype_of(out.scalar_type()), bias.has_value() ? bias->data_ptr() : nullptr, fast_accum ? 1 : 0,
               ws, static_cast<size_t>(kWorkspaceBytes), stream);
  auto misalign = [](const void* p) { return static_cast<int>(reinterpret_cast<std::uintptr_t>(p) % 256); };
  STD_TORCH_CHECK(status == TEP_SUCCESS, "te_parallel::fp8_gemm: m=", m, " n=", n, " k=", k, " dtype codes a=",
                  tep_dtype_of(a.scalar_type()), " b=", tep_dtype_of(b.scalar_type()), " out=",
                  tep_dtype_of(out.scalar_type()), ", addresses mod 256: a ", misalign(a.data_ptr()), " b ",
                  misalign(b.data_ptr()), " out ", misalign(out.data_ptr()), " scales ", misalign(a_scale_inv.data_ptr()),
                  " ", misalign(b_scale_inv.data_ptr()), ": ", tep_last_error());
}

// The GEMM's checks from A's rows, columns and dtype (a fused op checks before it makes A, so that a
// refused call has launched nothing).
void check_gemm(const char* op, int64_t m, int64_t k, ScalarType a_dtype, int32_t dev, const Tensor& b,
                const Tensor& b_scale_inv, ScalarType out_dtype, const std::optional<Tensor>& bias,
                const std::optional<Tensor>& accumulate) {
  const bool shapes = b.dim() == 2 && b.size(1) == k && ((m | k | b.size(0)) & 15) == 0;
  const bool operands = b.is_cuda() && b.get_device_index() == dev && is_fp8(a_dtype) && is_fp8(b.scalar_type()) &&
                        !(a_dtype == ScalarType::Float8_e5m2 && b.scalar_type() == ScalarType::Float8_e5m2) &&
                        b.is_contiguous() && f32_cell(b_scale_inv, dev) && is_high_precision(out_dtype);
  const bool extras =
      (!bias.has_value() || (bias->dim() == 1 && shapes && bias->size(0) == b.size(0) &&
                             bias->scalar_type() == out_dtype && bias->is_contiguous() && bias->is_cuda())) &&
      (!accumulate.has_value() || (accumulate->dim() == 2 && shapes && accumulate->size(0) == m &&
                                   accumulate->size(1) == b.size(0) && accumulate->scalar_type() == out_dtype &&
                                   accumulate->is_contiguous() && accumulate->is_cuda()));
  STD_TORCH_CHECK(shapes && operands && extras, op,
                  ": need FP8 a [m, k] and b [n, k] (not both E5M2), m, n, k multiples of 16, contiguous on one GPU, "
                  "fp32 scalar scales, a high-precision out dtype, bias [n] and accumulate [m, n] of that dtype; got "
                  "a [", m, ", ", k, "] and b of ", b.dim(), " dims", b.dim() == 2 ? " [" : "",
                  b.dim() == 2 ? b.size(0) : 0, b.dim() == 2 ? ", " : "", b.dim() == 2 ? b.size(1) : 0,
                  b.dim() == 2 ? "]" : "");
}

// te_parallel::fp8_gemm: out[m, n] = a_scale_inv·b_scale_inv · a[m, k]·b[n, k]ᵀ (+ bias[n]) (+ accumulate).
Tensor fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype,
                std::optional<Tensor> bias, std::optional<Tensor> accumulate, bool fast_accum) {
  STD_TORCH_CHECK(a.is_cuda() && a.dim() == 2 && a.is_contiguous() && f32_cell(a_scale_inv, a.get_device_index()),
                  "te_parallel::fp8_gemm: need a contiguous 2-D CUDA a with a 1-element fp32 a_scale_inv on its device; "
                  "got a of ", a.dim(), " dims, contiguous=", a.is_contiguous());
  check_gemm("te_parallel::fp8_gemm", a.size(0), a.size(1), a.scalar_type(), a.get_device_index(), b, b_scale_inv,
             out_dtype, bias, accumulate);
  OnDevice on(a);
  Tensor out = empty_like_dev(a, {a.size(0), b.size(0)}, out_dtype);
  gemm_into(a, a_scale_inv, b, b_scale_inv, bias, accumulate, out, fast_accum, on.stream);
  return out;
}

// te_parallel::linear_fp8_fwd: the forward of an FP8 linear layer on one rank, in one call:
// x [M, K] cast to FP8 (cast_fp8's scale / amax rules; its transpose too when wgrad will need it), then
// y [M, N] = x_fp8 · W_fp8ᵀ (+ bias) in x's dtype. Returns (y, x_data, x_data_t or [0], x_scale_inv).
std::tuple<Tensor, Tensor, Tensor, Tensor> linear_fp8_fwd(Tensor x, std::optional<Tensor> x_scale,
                                                          std::optional<Tensor> x_amax, ScalarType x_fp8_dtype,
                                                          bool x_transpose, Tensor w, Tensor w_scale_inv,
                                                          std::optional<Tensor> bias, bool fast_accum) {
  check_cast_args("te_parallel::linear_fp8_fwd", x, x_scale, x_amax, x_fp8_dtype, true, x_transpose);
  check_gemm("te_parallel::linear_fp8_fwd", x.size(0), x.size(1), x_fp8_dtype, x.get_device_index(), w, w_scale_inv,
             x.scalar_type(), bias, std::nullopt);
  OnDevice on(x);
  auto [data, data_t, scale_inv, unused] =
      cast_into(x, x_scale, x_amax, x_fp8_dtype, true, x_transpose, false, on.stream);
  Tensor y = empty_like_dev(x, {x.size(0), w.size(0)}, x.scalar_type());
  gemm_into(data, scale_inv, w, w_scale_inv, bias, std::nullopt, y, fast_accum, on.stream);
  return {y, data, data_t, scale_inv};
}

}  // namespace

STABLE_TORCH_LIBRARY(te_parallel, m) {
  m.def("cast_fp8(Tensor x, Tensor? scale, Tensor(a!)? amax, ScalarType fp8_dtype, bool rowwise, bool transpose, "
        "bool keep_scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype, Tensor? bias, "
        "Tensor? accumulate, bool fast_accum) -> Tensor");
  m.def("linear_fp8_fwd(Tensor x, Tensor? x_scale, Tensor(a!)? x_amax, ScalarType x_fp8_dtype, bool x_transpose, "
        "Tensor w, Tensor w_scale_inv, Tensor? bias, bool fast_accum) -> (Tensor, Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(te_parallel, CUDA, m) {
  m.impl("cast_fp8", TORCH_BOX(&cast_fp8));
  m.impl("fp8_gemm", TORCH_BOX(&fp8_gemm));
  m.impl("linear_fp8_fwd", TORCH_BOX(&linear_fp8_fwd));
}
