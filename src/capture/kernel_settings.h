// The global settings by which torch picks a step's kernels, read in one call.
//
// An eager step reads them at every operator: the precision float32 matrix products,
// convolutions and RNNs compute in (IEEE or TF32), cuBLAS's reduced-precision reductions and
// fp16 accumulation, cuDNN and each attention backend switched on or off, deterministic
// algorithms, the dtype of the tensors a forward makes. A CUDA graph holds the kernels they
// chose when it was captured, so a Step records them at capture and compares them at each
// call: a replay under other settings would run kernels other than those asked for.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nimble_train::capture {

// The settings packed into one number (equal numbers: the same settings). About 20 ns.
uint64_t kernel_settings();

// "name is now, was captured" for each setting that differs between two kernel_settings()
// values, named as a Python program sets it (torch.backends.cudnn.allow_tf32, ...).
std::vector<std::string> kernel_setting_changes(uint64_t captured, uint64_t now);

}  // namespace nimble_train::capture
