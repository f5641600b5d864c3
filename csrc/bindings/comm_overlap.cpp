#include "bindings.h"

namespace tep_bindings {

void bind_comm_overlap(pybind11::module_& m) { (void)m; }

}  // namespace tep_bindings
