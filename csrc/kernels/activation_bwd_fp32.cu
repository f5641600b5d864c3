// fp32 instantiation of the bias + activation backward kernels (activation.cuh), in its own translation
// unit so that a parallel build compiles it beside the 2-byte ones.
#include "activation_bwd.cuh"

namespace tep {
namespace act {
template tep_status launch_bwd<float>(int, const BwdParams&, dim3, cudaStream_t);
}  // namespace act
}  // namespace tep
