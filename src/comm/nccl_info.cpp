// Which NCCL the process runs with (see nccl_info.h).
#include "comm/nccl_info.h"

#include "comm/nccl_check.h"

namespace nimble_train::comm {

std::string nccl_runtime_version() {
  int code = 0;
  NT_CHECK_NCCL(ncclGetVersion(&code));
  // Since NCCL 2.9 the code is major * 10000 + minor * 100 + patch.
  return detail::concat(code / 10000, ".", code / 100 % 100, ".", code % 100);
}

}  // namespace nimble_train::comm
