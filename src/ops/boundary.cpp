// Tensor-level checks and calls of src/ops (see boundary.h).
#include "ops/boundary.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>

#include <algorithm>

#include "common/check.h"
#include "common/torch_dtype.h"
#include "nimble_train/build_config.h"
#include "ops/batch_norm_act.h"
#include "ops/max_pool.h"
#include "ops/small_conv.h"

#if NT_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace nimble_train::ops {
namespace {

int pair_entry(const std::vector<int64_t>& v, int i, const char* op, const char* name) {
  NT_CHECK(v.size() == 2, op, ": ", name, " must be a pair (h, w); got ", v.size(), " values");
  NT_CHECK(v[i] >= 0 && v[i] < (int64_t(1) << 30), op, ": ", name, " must be in [0, 2^30); got ",
           v[i]);
  return static_cast<int>(v[i]);
}

MaxPoolShape shape_of(const std::vector<int64_t>& input_size, const std::vector<int64_t>& kernel,
                      const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                      bool ceil_mode, const char* op) {
  NT_CHECK(input_size.size() == 4, op, ": the input must be [N, C, H, W]; got ",
           input_size.size(), " dimensions");
  return max_pool_shape(input_size[0], input_size[1], input_size[2], input_size[3],
                        pair_entry(kernel, 0, op, "kernel"), pair_entry(kernel, 1, op, "kernel"),
                        pair_entry(stride, 0, op, "stride"), pair_entry(stride, 1, op, "stride"),
                        pair_entry(padding, 0, op, "padding"),
                        pair_entry(padding, 1, op, "padding"), ceil_mode);
}

void check_device(const at::Tensor& t, const char* op, const char* name) {
  NT_CHECK(t.device().is_cpu() || (NT_HAVE_CUDA && t.device().is_cuda()), op, ": ", name,
           " must be on the CPU", NT_HAVE_CUDA ? " or a CUDA device" : "", "; got ", t.device());
}

// x: a 4-D channels-last contiguous tensor of a kernel dtype on a device the kernels run on;
// returns its dtype.
DType channels_last_input(const at::Tensor& x, const char* op) {
  NT_CHECK(x.defined() && x.dim() == 4, op, ": x must be a 4-D [N, C, H, W] tensor; got ",
           x.defined() ? x.dim() : 0, " dimensions");
  const DType dtype = kernel_dtype(x, op, "x");
  check_device(x, op, "x");
  NT_CHECK(x.is_contiguous(at::MemoryFormat::ChannelsLast), op,
           ": x must be channels-last contiguous; got sizes ", x.sizes(), " with strides ",
           x.strides(), " (x.contiguous(memory_format=torch.channels_last) makes it so)");
  return dtype;
}

BatchNormActShape rows_and_channels(const at::Tensor& x) {
  BatchNormActShape s;
  s.channels = x.size(1);
  s.rows = x.numel() / std::max<int64_t>(s.channels, 1);
  return s;
}

// A [channels] float32 tensor of the batch norm over x: its data.
float* channel_values(const at::Tensor& t, const at::Tensor& x, const BatchNormActShape& s,
                      const char* op, const char* name) {
  NT_CHECK(t.defined() && t.dim() == 1 && t.size(0) == s.channels &&
               t.scalar_type() == at::kFloat && t.device() == x.device() && t.is_contiguous(),
           op, ": ", name, " must be a contiguous float32 [", s.channels, "] tensor on ",
           x.device(), "; got ", t.defined() ? t.sizes() : at::IntArrayRef{}, " ",
           t.defined() ? t.scalar_type() : at::ScalarType::Undefined, " on ",
           t.defined() ? t.device() : x.device());
  return t.data_ptr<float>();
}

// `t` (named `name`) laid out as x: x's sizes, dtype and device, channels-last contiguous.
void like_x(const at::Tensor& t, const at::Tensor& x, const char* op, const char* name) {
  NT_CHECK(t.defined() && t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() &&
               t.device() == x.device() && t.is_contiguous(at::MemoryFormat::ChannelsLast),
           op, ": ", name, " must be channels-last contiguous, with x's sizes ", x.sizes(),
           ", dtype ", x.scalar_type(), " and device ", x.device(), "; got ",
           t.defined() ? t.sizes() : at::IntArrayRef{}, " ",
           t.defined() ? t.scalar_type() : at::ScalarType::Undefined, " on ",
           t.defined() ? t.device() : x.device(), " with strides ",
           t.defined() ? t.strides() : at::IntArrayRef{});
}

// The ReLU's mask of a batch norm over x (see relu_mask_words): int32, on x's device.
uint32_t* relu_mask_of(const at::Tensor& mask, const at::Tensor& x, const BatchNormActShape& s,
                       const char* op) {
  const int64_t words = relu_mask_words(s);
  NT_CHECK(mask.dim() == 1 && mask.size(0) == words && mask.scalar_type() == at::kInt &&
               mask.device() == x.device() && mask.is_contiguous(),
           op, ": mask must be the int32 [", words, "] tensor batch_norm_relu_forward(..., "
           "mask=True) returned for x ", x.sizes(), " on ", x.device(), "; got ", mask.sizes(),
           " ", mask.scalar_type(), " on ", mask.device());
  return reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
}

SmallConvShape conv_shape_of(const at::Tensor& x, at::IntArrayRef weight_size,
                             const std::vector<int64_t>& stride,
                             const std::vector<int64_t>& padding,
                             const std::vector<int64_t>& dilation, const char* op) {
  NT_CHECK(x.defined() && x.dim() == 4, op, ": x must be a 4-D [N, C, H, W] tensor; got ",
           x.defined() ? x.dim() : 0, " dimensions");
  NT_CHECK(weight_size.size() == 4 && weight_size[1] == x.size(1), op,
           ": the weight must be [O, C, kh, kw] with x's ", x.size(1), " channels; got ",
           weight_size);
  const std::vector<int64_t> kernel(weight_size.begin() + 2, weight_size.end());
  SmallConvShape s = small_conv_shape(
      x.size(0), x.size(1), x.size(2), x.size(3), weight_size[0],
      pair_entry(kernel, 0, op, "kernel"), pair_entry(kernel, 1, op, "kernel"),
      pair_entry(stride, 0, op, "stride"), pair_entry(stride, 1, op, "stride"),
      pair_entry(padding, 0, op, "padding"), pair_entry(padding, 1, op, "padding"),
      pair_entry(dilation, 0, op, "dilation"), pair_entry(dilation, 1, op, "dilation"));
  for (int d = 0; d < 4; ++d) s.x_stride[d] = x.stride(d);
  return s;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> max_pool2d_forward(const at::Tensor& x,
                                                      const std::vector<int64_t>& kernel,
                                                      const std::vector<int64_t>& stride,
                                                      const std::vector<int64_t>& padding,
                                                      bool ceil_mode) {
  const char* op = "max_pool2d_forward";
  const DType dtype = channels_last_input(x, op);
  const MaxPoolShape s = shape_of(x.sizes().vec(), kernel, stride, padding, ceil_mode, op);
  const auto options = x.options().memory_format(at::MemoryFormat::ChannelsLast);
  at::Tensor y = at::empty({s.batch, s.channels, s.out_height, s.out_width}, options);
  at::Tensor argmax =
      at::empty({s.batch, s.channels, s.out_height, s.out_width}, options.dtype(at::kByte));
  if (x.is_cpu()) {
    max_pool_forward_reference(x.data_ptr(), y.data_ptr(), argmax.data_ptr<uint8_t>(), s, dtype);
  } else {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    max_pool_forward_cuda(x.data_ptr(), y.data_ptr(), argmax.data_ptr<uint8_t>(), s, dtype,
                          c10::cuda::getCurrentCUDAStream());
#endif
  }
  return {y, argmax};
}

at::Tensor max_pool2d_backward(const at::Tensor& grad_y, const at::Tensor& argmax,
                               const std::vector<int64_t>& input_size,
                               const std::vector<int64_t>& kernel,
                               const std::vector<int64_t>& stride,
                               const std::vector<int64_t>& padding, bool ceil_mode) {
  const char* op = "max_pool2d_backward";
  const MaxPoolShape s = shape_of(input_size, kernel, stride, padding, ceil_mode, op);
  const std::vector<int64_t> out_size = {s.batch, s.channels, s.out_height, s.out_width};
  NT_CHECK(grad_y.defined() && grad_y.sizes().vec() == out_size, op,
           ": grad_y must have the output's sizes ", at::IntArrayRef(out_size), "; got ",
           grad_y.defined() ? grad_y.sizes() : at::IntArrayRef{});
  NT_CHECK(argmax.defined() && argmax.scalar_type() == at::kByte &&
               argmax.sizes().vec() == out_size &&
               argmax.is_contiguous(at::MemoryFormat::ChannelsLast),
           op, ": argmax must be the forward's: uint8, channels-last, sizes ",
           at::IntArrayRef(out_size));
  const DType dtype = kernel_dtype(grad_y, op, "grad_y");
  check_device(grad_y, op, "grad_y");
  NT_CHECK(argmax.device() == grad_y.device(), op, ": argmax must be on grad_y's device ",
           grad_y.device(), "; got ", argmax.device());
  const at::Tensor g = grad_y.contiguous(at::MemoryFormat::ChannelsLast);
  at::Tensor grad_x =
      at::empty(input_size, g.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (g.is_cpu()) {
    max_pool_backward_reference(g.data_ptr(), argmax.data_ptr<uint8_t>(), grad_x.data_ptr(), s,
                                dtype);
  } else {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(g.device());
    max_pool_backward_cuda(g.data_ptr(), argmax.data_ptr<uint8_t>(), grad_x.data_ptr(), s, dtype,
                           c10::cuda::getCurrentCUDAStream());
#endif
  }
  return grad_x;
}

at::Tensor small_conv2d_forward(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias,
                                const std::vector<int64_t>& stride,
                                const std::vector<int64_t>& padding,
                                const std::vector<int64_t>& dilation) {
  const char* op = "small_conv2d_forward";
  SmallConvShape s = conv_shape_of(x, weight.sizes(), stride, padding, dilation, op);
  const DType dtype = kernel_dtype(x, op, "x");
  check_device(x, op, "x");
  NT_CHECK(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(), op,
           ": the weight must be x's dtype and device (", x.scalar_type(), ", ", x.device(),
           "); got ", weight.scalar_type(), ", ", weight.device());
  for (int d = 0; d < 4; ++d) s.w_stride[d] = weight.stride(d);
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor b;
  if (has_bias) {
    NT_CHECK(bias->dim() == 1 && bias->size(0) == s.out_channels &&
                 bias->scalar_type() == x.scalar_type() && bias->device() == x.device(),
             op, ": the bias must be [", s.out_channels, "] of x's dtype and device; got ",
             bias->sizes(), " ", bias->scalar_type(), " on ", bias->device());
    b = bias->contiguous();
  }
  at::Tensor y = at::empty({s.batch, s.out_channels, s.out_height, s.out_width},
                           x.options().memory_format(at::MemoryFormat::ChannelsLast));
  const void* bias_ptr = has_bias ? b.data_ptr() : nullptr;
  if (x.is_cpu()) {
    small_conv_forward_reference(x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), s,
                                 dtype);
  } else {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    small_conv_forward_cuda(x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), s, dtype,
                            c10::cuda::getCurrentCUDAStream());
#endif
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> small_conv2d_weight_grad(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight_like,
    const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
    const std::vector<int64_t>& dilation, bool with_bias) {
  const char* op = "small_conv2d_weight_grad";
  SmallConvShape s = conv_shape_of(x, weight_like.sizes(), stride, padding, dilation, op);
  const DType dtype = kernel_dtype(x, op, "x");
  const DType grad_dtype = kernel_dtype(weight_like, op, "weight_like");
  check_device(x, op, "x");
  const std::vector<int64_t> out_size = {s.batch, s.out_channels, s.out_height, s.out_width};
  NT_CHECK(grad_y.defined() && grad_y.sizes().vec() == out_size &&
               grad_y.scalar_type() == x.scalar_type() && grad_y.device() == x.device(),
           op, ": grad_y must be the output's sizes ", at::IntArrayRef(out_size),
           " in x's dtype and device; got ",
           grad_y.defined() ? grad_y.sizes() : at::IntArrayRef{});
  NT_CHECK(weight_like.device() == x.device(), op, ": weight_like must be on x's device ",
           x.device(), "; got ", weight_like.device());
  // The kernels read the output's gradient pixel by pixel (the reference takes any layout).
  const at::Tensor g =
      grad_y.is_cpu() ? grad_y : grad_y.contiguous(at::MemoryFormat::ChannelsLast);
  for (int d = 0; d < 4; ++d) s.g_stride[d] = g.stride(d);
  at::Tensor grad_w = at::empty_strided(weight_like.sizes(), weight_like.strides(),
                                        weight_like.options());
  for (int d = 0; d < 4; ++d) s.w_stride[d] = grad_w.stride(d);
  at::Tensor grad_b =
      with_bias ? at::empty({s.out_channels}, weight_like.options()) : at::Tensor();
  void* bias_ptr = with_bias ? grad_b.data_ptr() : nullptr;
  if (x.is_cpu()) {
    small_conv_weight_grad_reference(g.data_ptr(), x.data_ptr(), grad_w.data_ptr(),
                                     bias_ptr, s, dtype, grad_dtype);
  } else {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    const int blocks = small_conv_weight_grad_blocks(s, x.device().index());
    at::Tensor workspace = at::empty({int64_t(blocks) * (s.columns() + 1) * s.out_channels},
                                     x.options().dtype(at::kFloat));
    small_conv_weight_grad_cuda(g.data_ptr(), x.data_ptr(), workspace.data_ptr<float>(),
                                blocks, grad_w.data_ptr(), bias_ptr, s, dtype, grad_dtype,
                                c10::cuda::getCurrentCUDAStream());
#endif
  }
  return {grad_w, grad_b};
}

std::tuple<at::Tensor, at::Tensor> batch_norm_stats(const at::Tensor& x, double eps,
                                                    bool early) {
  const char* op = "batch_norm_stats";
  const DType dtype = channels_last_input(x, op);
  const BatchNormActShape s = rows_and_channels(x);
  NT_CHECK(s.rows > 0, op, ": x has no values per channel (input ", x.sizes(), ")");
  at::Tensor mean = at::empty({s.channels}, x.options().dtype(at::kFloat));
  at::Tensor invstd = at::empty({s.channels}, x.options().dtype(at::kFloat));
  BatchNormStats out;
  out.mean = mean.data_ptr<float>();
  out.invstd = invstd.data_ptr<float>();
  out.eps = static_cast<float>(eps);
  if (x.is_cpu()) {
    batch_norm_stats_reference(x.data_ptr(), out, s, dtype);
  } else {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    at::Tensor workspace = at::empty(
        {batch_norm_stats_workspace(s, dtype, x.device().index())}, mean.options());
    batch_norm_stats_cuda(x.data_ptr(), out, workspace.data_ptr<float>(), s, dtype,
                          c10::cuda::getCurrentCUDAStream(), early);
#endif
  }
  return {mean, invstd};
}

std::tuple<at::Tensor, at::Tensor> batch_norm_relu_forward(
    const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
    const at::Tensor& weight, const at::Tensor& bias, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    double momentum, double eps, bool gelu, bool mask, bool early) {
  const char* op = "batch_norm_relu_forward";
  const DType dtype = channels_last_input(x, op);
  const BatchNormActShape s = rows_and_channels(x);
  const auto per_channel = [&](const at::Tensor& t, const char* name) {
    return channel_values(t, x, s, op, name);
  };
  BatchNormActParams p;
  p.mean = per_channel(mean, "mean");
  p.invstd = per_channel(invstd, "invstd");
  p.weight = per_channel(weight, "weight");
  p.bias = per_channel(bias, "bias");
  const bool has_mean = running_mean.has_value() && running_mean->defined();
  const bool has_var = running_var.has_value() && running_var->defined();
  NT_CHECK(has_mean == has_var, op, ": running_mean and running_var go together; got ",
           has_mean ? "running_mean" : "running_var", " alone");
  if (has_mean) {
    NT_CHECK(s.rows > 1, op, ": the running variance needs more than one value per channel; got ",
             s.rows, " (input ", x.sizes(), ")");
    p.running_mean = per_channel(*running_mean, "running_mean");
    p.running_var = per_channel(*running_var, "running_var");
  }
  p.momentum = static_cast<float>(momentum);
  p.eps = static_cast<float>(eps);
  p.activation = gelu ? Activation::kGelu : Activation::kRelu;
  const bool has_residual = residual.has_value() && residual->defined();
  NT_CHECK(!(gelu && has_residual), op, ": a residual goes with the ReLU only; got gelu=True "
           "and a residual (add it after the GELU yourself)");
  NT_CHECK(!(gelu && mask), op, ": the mask is the ReLU's; got gelu=True and mask=True (the "
           "GELU's backward recomputes its derivative from x)");
  if (has_residual) like_x(*residual, x, op, "residual");
  const void* res = has_residual ? residual->data_ptr() : nullptr;
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::ChannelsLast));
  at::Tensor bits =
      mask ? at::empty({relu_mask_words(s)}, x.options().dtype(at::kInt)) : at::Tensor();
  uint32_t* bits_ptr = mask ? reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>()) : nullptr;
  if (x.is_cpu()) {
    batch_norm_relu_forward_reference(x.data_ptr(), res, y.data_ptr(), bits_ptr, p, s, dtype);
  } else {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    batch_norm_relu_forward_cuda(x.data_ptr(), res, y.data_ptr(), bits_ptr, p, s, dtype,
                                 c10::cuda::getCurrentCUDAStream(), early);
#endif
  }
  return {y, bits};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_relu_backward(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& y, const at::Tensor& x,
    const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
    const at::Tensor& bias, bool input_grad, bool residual_grad, bool gelu,
    const std::optional<at::Tensor>& mask, bool early) {
  const char* op = "batch_norm_relu_backward";
  NT_CHECK(!(gelu && residual_grad), op, ": a residual goes with the ReLU only; got gelu=True "
           "and residual_grad=True");
  const DType dtype = channels_last_input(x, op);
  const bool has_y = y.has_value() && y->defined();
  const bool has_mask = mask.has_value() && mask->defined();
  NT_CHECK(gelu || has_y || has_mask, op, ": the ReLU's backward needs the output y or its "
           "mask (batch_norm_relu_forward(..., mask=True)); got neither");
  // Read by the kernels only where the mask is not given (the ReLU's mask).
  if (has_y) like_x(*y, x, op, "y");
  NT_CHECK(grad_y.defined() && grad_y.sizes() == x.sizes() &&
               grad_y.scalar_type() == x.scalar_type() && grad_y.device() == x.device(),
           op, ": grad_y must have x's sizes ", x.sizes(), ", dtype ", x.scalar_type(),
           " and device ", x.device(), "; got ",
           grad_y.defined() ? grad_y.sizes() : at::IntArrayRef{}, " ",
           grad_y.defined() ? grad_y.scalar_type() : at::ScalarType::Undefined);
  const at::Tensor g = grad_y.contiguous(at::MemoryFormat::ChannelsLast);
  const BatchNormActShape s = rows_and_channels(x);
  BatchNormActParams p;
  p.mean = channel_values(mean, x, s, op, "mean");
  p.invstd = channel_values(invstd, x, s, op, "invstd");
  p.weight = channel_values(weight, x, s, op, "weight");
  p.bias = channel_values(bias, x, s, op, "bias");
  p.activation = gelu ? Activation::kGelu : Activation::kRelu;
  const auto like = x.options().memory_format(at::MemoryFormat::ChannelsLast);
  at::Tensor grad_x = input_grad ? at::empty(x.sizes(), like) : at::Tensor();
  at::Tensor grad_residual = residual_grad ? at::empty(x.sizes(), like) : at::Tensor();
  at::Tensor grad_weight = at::empty({s.channels}, x.options().dtype(at::kFloat));
  at::Tensor grad_bias = at::empty({s.channels}, x.options().dtype(at::kFloat));
  BatchNormActGrads grads;
  grads.grad_x = input_grad ? grad_x.data_ptr() : nullptr;
  grads.grad_residual = residual_grad ? grad_residual.data_ptr() : nullptr;
  grads.grad_weight = grad_weight.data_ptr<float>();
  grads.grad_bias = grad_bias.data_ptr<float>();
  const void* y_ptr = has_y ? y->data_ptr() : nullptr;
  const uint32_t* mask_ptr = has_mask ? relu_mask_of(*mask, x, s, op) : nullptr;
  if (x.is_cpu()) {
    batch_norm_relu_backward_reference(g.data_ptr(), y_ptr, mask_ptr, x.data_ptr(), p, grads, s,
                                       dtype);
  } else {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    at::Tensor workspace = at::empty(
        {batch_norm_relu_backward_workspace(s, dtype, x.device().index())},
        x.options().dtype(at::kFloat));
    batch_norm_relu_backward_cuda(g.data_ptr(), y_ptr, mask_ptr, x.data_ptr(), p, grads,
                                  workspace.data_ptr<float>(), s, dtype,
                                  c10::cuda::getCurrentCUDAStream(), early);
#endif
  }
  return {grad_x, grad_residual, grad_weight, grad_bias};
}

}  // namespace nimble_train::ops
