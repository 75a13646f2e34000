// Tensor-level entry points of src/ops: check the tensors, then call the pointer-level code.
// CPU tensors run the reference, CUDA tensors the kernels (on the current stream).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
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

// A 2-D convolution of few input channels, groups 1 (see small_conv.h): x [N, C, H, W] and
// weight [O, C, kh, kw] in any layout, bias [O] or undefined, all of one dtype (float32,
// float16 or bfloat16). stride, padding, dilation: (h, w). Returns y [N, O, Ho, Wo],
// channels-last, in x's dtype.
at::Tensor small_conv2d_forward(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias,
                                const std::vector<int64_t>& stride,
                                const std::vector<int64_t>& padding,
                                const std::vector<int64_t>& dilation);

// The weight's and the bias's gradients of small_conv2d_forward from the output's (grad_y, any
// layout, x's dtype): (grad_weight, grad_bias), laid out and typed as `weight_like` (the
// parameter, whose dtype may differ from x's under autocast); grad_bias undefined unless
// with_bias.
std::tuple<at::Tensor, at::Tensor> small_conv2d_weight_grad(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight_like,
    const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
    const std::vector<int64_t>& dilation, bool with_bias);

// A training batch norm's batch statistics (see batch_norm_act.h): (mean, invstd), float32 [C],
// of x [N, C, H, W] channels-last contiguous, float32, float16 or bfloat16, as
// torch.batch_norm_stats(x, eps) gives them (deterministic; no memset).
// `early` (here and below): on CUDA, each kernel allowed to start while the one before it on the
// stream ends (programmatic dependent launch: common/early_launch.cuh); the same results.
std::tuple<at::Tensor, at::Tensor> batch_norm_stats(const at::Tensor& x, double eps,
                                                    bool early = true);

// A training batch norm's normalisation, an optional residual and the ReLU in one pass (see
// batch_norm_act.h): x (and residual) [N, C, H, W] channels-last contiguous, float32, float16 or
// bfloat16; mean and invstd as batch_norm_stats (or torch's) gives them, weight, bias, running_mean
// and running_var: float32 [C] (the running averages updated in place when given, both or
// neither). Returns relu(weight * (x - mean) * invstd + bias [+ residual]), channels-last, in
// x's dtype.
// With gelu, the exact GELU instead of the ReLU (no residual). Returns (y, mask): with `mask`
// (the ReLU only) the ReLU's mask as bits (relu_mask_words(s) int32 words), else undefined.
std::tuple<at::Tensor, at::Tensor> batch_norm_relu_forward(
    const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
    const at::Tensor& weight, const at::Tensor& bias, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    double momentum, double eps, bool gelu, bool mask, bool early = true);

// The backward of batch_norm_relu_forward (see batch_norm_act.h) from the output's gradient
// grad_y (any layout, y's dtype), the ReLU's mask (the forward's `mask`, or else the output y;
// the GELU needs neither), the input x (channels-last contiguous) and the forward's mean,
// invstd, weight and bias: (grad_x, grad_residual, grad_weight, grad_bias), the first two
// channels-last in x's dtype and undefined unless asked for, the last two float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_relu_backward(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& y, const at::Tensor& x,
    const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
    const at::Tensor& bias, bool input_grad, bool residual_grad, bool gelu,
    const std::optional<at::Tensor>& mask, bool early = true);

}  // namespace nimble_train::ops
