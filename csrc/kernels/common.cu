// Library-wide entry points: version, thread-local last error, CUDA runtime / device queries.
#include <cstdarg>
#include <cstdio>
#include <string>

#include <cuda_runtime.h>

#include "common.h"

namespace {
// Thread-local so that concurrent callers (e.g. one Python thread per device) never read each
// other's messages; the pointer returned by tep_last_error stays valid until the next failure.
thread_local std::string g_last_error;
}  // namespace

namespace tep {

void set_error(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  g_last_error = buf;
}

}  // namespace tep

extern "C" {

const char* tep_version(void) { return "0.1.0"; }

const char* tep_last_error(void) { return g_last_error.c_str(); }

int tep_cuda_runtime_version(void) {
  // With cudart linked statically this is the build's runtime version; it needs no driver.
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) {
    cudaGetLastError();  // do not leave the failure behind for the next launch check
    return 0;
  }
  return version;
}

int tep_device_count(void) {
  // Without a driver or GPU this returns cudaErrorNoDevice / cudaErrorInsufficientDriver: that is a
  // normal answer ("no devices"), not a failure, so clear it and report 0.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

}  // extern "C"
