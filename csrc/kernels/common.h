// Internal helpers shared by the kernel files (not part of the public C API).
#pragma once

#include "te_parallel/te_parallel.h"

namespace tep {

// Records a printf-style one-line message as the calling thread's tep_last_error().
void set_error(const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

}  // namespace tep
