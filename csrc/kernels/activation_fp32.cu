// fp32 instantiation of the bias + activation forward kernels (activation.cuh), in its own translation
// unit so that a parallel build compiles it beside the 2-byte ones (its accurate expf makes it the
// slowest to compile).
#include "activation.cuh"

namespace tep {
namespace act {
template tep_status launch_fwd<float>(int, const FwdParams&, dim3, cudaStream_t);
}  // namespace act
}  // namespace tep
