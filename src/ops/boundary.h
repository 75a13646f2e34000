// Tensor-level entry points of src/ops: check the tensors, then call the pointer-level code.
// CPU tensors run the reference, CUDA tensors the kernels (on the current stream).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace nimble_train::ops {

// 2-D max-pooling of a channels-last [N, C, H, W] tensor (float32, float16 or bfloat16) with
// dilation 1 (see max_pool.h). kernel, stride, padding: (h, w). Returns (y, argmax): y as torch's
// max_pool2d gives it, channels-last; argmax: uint8, the window codes, laid out as y.
std::tuple<at::Tensor, at::Tensor> max_pool2d_forward(const at::Tensor& x,
                                                      const std::vector<int64_t>& kernel,
                                                      const std::vector<int64_t>& stride,
                                                      const std::vector<int64_t>& padding,
                                                      bool ceil_mode);

// The gradient of x: grad_y and argmax as the forward gave them (grad_y in any layout),
// input_size: x's [N, C, H, W]. Channels-last, x's dtype.
at::Tensor max_pool2d_backward(const at::Tensor& grad_y, const at::Tensor& argmax,
                               const std::vector<int64_t>& input_size,
                               const std::vector<int64_t>& kernel,
                               const std::vector<int64_t>& stride,
                               const std::vector<int64_t>& padding, bool ceil_mode);

}  // namespace nimble_train::ops
