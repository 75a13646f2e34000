// NT_CHECK_CUDA and NT_CHECK_LAUNCH: CUDA runtime status turned into a RuntimeFailure; the
// device's multiprocessor count, which kernels size their grids by; a scoped current device.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>

#include "common/check.h"

#define NT_CHECK_CUDA(expr)                                                          \
  do {                                                                               \
    const cudaError_t nt_status_ = (expr);                                           \
    if (nt_status_ != cudaSuccess) {                                                 \
      NT_FAIL(#expr, " failed: ", cudaGetErrorName(nt_status_), " (",                \
              cudaGetErrorString(nt_status_), ")");                                  \
    }                                                                                \
  } while (0)

// After every kernel launch: a bad configuration is reported here, not at the next sync.
#define NT_CHECK_LAUNCH() NT_CHECK_CUDA(cudaGetLastError())

namespace nimble_train {

inline int multiprocessors(int device) {
  int sms = 0;
  NT_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max(sms, 1);
}

// Sets the current device for the lifetime of the guard, and puts the previous one back.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    NT_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) NT_CHECK_CUDA(cudaSetDevice(device));
  }
  ~DeviceGuard() { (void)cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace nimble_train
