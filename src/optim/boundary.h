// Tensor-level entry points of src/optim: check the tensors, then call the pointer-level code.
#pragma once

#include <ATen/core/Tensor.h>

namespace nimble_train::optim {

// x *= scale, in place. x: a contiguous float32/float16/bfloat16 tensor (a flat buffer, or any
// contiguous tensor); scale: a one-element float32 tensor on x's device, read on the device.
void flat_scale_(const at::Tensor& x, const at::Tensor& scale);

}  // namespace nimble_train::optim
