// NT_CHECK_NCCL: NCCL status turned into a RuntimeFailure naming the call and NCCL's own detail.
#pragma once

#include <nccl.h>

#include "common/check.h"

// ncclGetLastError carries the detail ncclGetErrorString lacks (which peer, which system call).
#define NT_CHECK_NCCL(expr)                                                             \
  do {                                                                                  \
    const ncclResult_t nt_status_ = (expr);                                             \
    if (nt_status_ != ncclSuccess && nt_status_ != ncclInProgress) {                    \
      NT_FAIL(#expr, " failed: ", ncclGetErrorString(nt_status_), " (last error: ",     \
              ncclGetLastError(nullptr), ")");                                          \
    }                                                                                   \
  } while (0)
