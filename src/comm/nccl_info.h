// Which NCCL the process runs with (the library loaded at run time, not the header built with).
#pragma once

#include <string>

namespace nimble_train::comm {

// "2.28.3": the version of the libnccl loaded in this process.
std::string nccl_runtime_version();

}  // namespace nimble_train::comm
