// 2-D convolutions of few input channels (a network's stem), forward and weight gradient.
//
// A stem reads the images: three input channels. cuDNN has no tensor-core kernel for so few
// channels in float32; for channels-last tensors it transposes the input and the output around
// an NCHW kernel in the forward and runs a weight-gradient kernel of a few thread blocks in the
// backward. Here each output pixel's window is its C·kh·kw values (columns, ordered (c, i, j)),
// with a constant 1 after them for the bias:
//   - forward: each thread block stages the weight and bias ([columns + 1][out channels], float)
//     and a tile of pixels' windows in shared memory; each thread computes a pack of output
//     channels of a pixel and stores it channels-last;
//   - weight gradient: each block sums window value × output gradient over its share of the
//     pixels into per-(column, output channel) float accumulators (the bias's is the constant
//     column's), writes them to a workspace, and a second kernel adds the blocks' partial sums
//     in block order (deterministic: no atomics) into the gradients.
// Sums run in float32 whatever the dtype. The input's gradient is not computed: a stem's input
// is the batch. The CPU reference computes the same sums in pixel order.
#pragma once

#include <cstdint>

#include "common/cuda_fwd.h"
#include "common/dtype.h"
#include "optim/dtype_traits.h"

namespace nimble_train::ops {

// The most columns (input channels × kernel area) and output channels the kernels take.
constexpr int kSmallConvMaxColumns = 32;
constexpr int kSmallConvMaxOutChannels = 256;

struct SmallConvShape {
  int64_t batch = 0;
  int channels = 0, height = 0, width = 0, out_channels = 0;
  int kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1;
  int pad_h = 0, pad_w = 0, dilation_h = 1, dilation_w = 1;
  int out_height = 0, out_width = 0;
  // Element strides: the input (n, c, h, w), the weight or its gradient (o, c, i, j), the
  // output's gradient (n, o, h, w). The output is channels-last contiguous.
  int64_t x_stride[4] = {0, 0, 0, 0};
  int64_t w_stride[4] = {0, 0, 0, 0};
  int64_t g_stride[4] = {0, 0, 0, 0};

  NT_HOST_DEVICE int columns() const { return channels * kernel_h * kernel_w; }
  NT_HOST_DEVICE int64_t pixels() const { return batch * out_height * out_width; }
};

// The shape for an input [batch, channels, height, width] and a weight [out_channels, channels,
// kernel_h, kernel_w], with the output sizes filled in (strides left at zero); InvalidArgument
// where torch's conv2d would refuse the parameters or the kernels do not take the layer (more
// than kSmallConvMaxColumns columns or kSmallConvMaxOutChannels output channels).
SmallConvShape small_conv_shape(int64_t batch, int64_t channels, int64_t height, int64_t width,
                                int64_t out_channels, int kernel_h, int kernel_w, int stride_h,
                                int stride_w, int pad_h, int pad_w, int dilation_h,
                                int dilation_w);

// One pixel's arithmetic, shared by the CPU reference and the kernels.
struct SmallConvMath {
  // The input element column k of output pixel (n, oh, ow) reads, or -1 where the window lies
  // over the padding.
  NT_HOST_DEVICE static int64_t input_offset(const SmallConvShape& s, int64_t n, int oh, int ow,
                                             int k) {
    const int j = k % s.kernel_w;
    const int i = (k / s.kernel_w) % s.kernel_h;
    const int c = k / (s.kernel_w * s.kernel_h);
    const int ih = oh * s.stride_h - s.pad_h + i * s.dilation_h;
    const int iw = ow * s.stride_w - s.pad_w + j * s.dilation_w;
    if (ih < 0 || ih >= s.height || iw < 0 || iw >= s.width) return -1;
    return n * s.x_stride[0] + c * s.x_stride[1] + ih * s.x_stride[2] + iw * s.x_stride[3];
  }

  // The weight (or weight gradient) element of output channel o and column k.
  NT_HOST_DEVICE static int64_t weight_offset(const SmallConvShape& s, int o, int k) {
    const int j = k % s.kernel_w;
    const int i = (k / s.kernel_w) % s.kernel_h;
    const int c = k / (s.kernel_w * s.kernel_h);
    return o * s.w_stride[0] + c * s.w_stride[1] + i * s.w_stride[2] + j * s.w_stride[3];
  }

  // Pixel p (images, rows, columns) as (n, oh, ow).
  NT_HOST_DEVICE static void pixel(const SmallConvShape& s, int64_t p, int64_t& n, int& oh,
                                   int& ow) {
    ow = static_cast<int>(p % s.out_width);
    oh = static_cast<int>((p / s.out_width) % s.out_height);
    n = p / (int64_t(s.out_width) * s.out_height);
  }
};

// ------------------------------------------------------------------ CPU reference
// x, weight, bias (or null) and y in `dtype`; y: [batch][out_height][out_width][out_channels].
void small_conv_forward_reference(const void* x, const void* weight, const void* bias, void* y,
                                  const SmallConvShape& s, DType dtype);
// grad_y and x in `dtype`; grad_w at w_stride and grad_b (or null; contiguous) in `grad_dtype`.
void small_conv_weight_grad_reference(const void* grad_y, const void* x, void* grad_w,
                                      void* grad_b, const SmallConvShape& s, DType dtype,
                                      DType grad_dtype);

// ------------------------------------------------------------------ CUDA (NT_HAVE_CUDA builds)
// Blocks of the weight gradient's first kernel on CUDA device `device` (two per
// multiprocessor at most): its workspace holds blocks × (columns + 1) × out_channels floats.
int small_conv_weight_grad_blocks(const SmallConvShape& s, int device);

void small_conv_forward_cuda(const void* x, const void* weight, const void* bias, void* y,
                             const SmallConvShape& s, DType dtype, cudaStream_t stream);
void small_conv_weight_grad_cuda(const void* grad_y, const void* x, float* workspace,
                                 int blocks, void* grad_w, void* grad_b, const SmallConvShape& s,
                                 DType dtype, DType grad_dtype, cudaStream_t stream);

}  // namespace nimble_train::ops
