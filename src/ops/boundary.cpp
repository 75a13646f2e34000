// Tensor-level checks and calls of src/ops (see boundary.h).
#include "ops/boundary.h"

#include <ATen/ops/empty.h>

#include "common/check.h"
#include "common/torch_dtype.h"
#include "nimble_train/build_config.h"
#include "ops/max_pool.h"

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

}  // namespace

std::tuple<at::Tensor, at::Tensor> max_pool2d_forward(const at::Tensor& x,
                                                      const std::vector<int64_t>& kernel,
                                                      const std::vector<int64_t>& stride,
                                                      const std::vector<int64_t>& padding,
                                                      bool ceil_mode) {
  const char* op = "max_pool2d_forward";
  NT_CHECK(x.defined() && x.dim() == 4, op, ": x must be a 4-D [N, C, H, W] tensor; got ",
           x.defined() ? x.dim() : 0, " dimensions");
  const DType dtype = kernel_dtype(x, op, "x");
  check_device(x, op, "x");
  NT_CHECK(x.is_contiguous(at::MemoryFormat::ChannelsLast), op,
           ": x must be channels-last contiguous; got sizes ", x.sizes(), " with strides ",
           x.strides(), " (x.contiguous(memory_format=torch.channels_last) makes it so)");
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

}  // namespace nimble_train::ops
