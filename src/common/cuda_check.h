// NT_CHECK_CUDA and NT_CHECK_LAUNCH: CUDA runtime status turned into a RuntimeFailure.
#pragma once

#include <cuda_runtime_api.h>

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
