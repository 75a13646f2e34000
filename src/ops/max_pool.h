// 2-D max-pooling over channels-last (NHWC) tensors, forward and backward, with the results of
// torch's CUDA kernels for that layout and an eighth of their index traffic.
//
// torch saves the position of each window's maximum as an int64 index into the input plane;
// the backward then gathers, for every input element, the gradients of the windows that chose
// it. Here a window's choice is a one-byte code: the position inside the window, row-major
// (kernel_h * kernel_w <= kMaxWindow), or kNoArgmax. The comparisons, the tie-breaking and the
// order of the backward's sums are torch's (DilatedMaxPool2d.cu, max_pool_forward_nhwc and
// max_pool_backward_nhwc, dilation 1), so outputs and gradients are the same bit for bit:
//   - a window's maximum is the first largest value in row-major order; a NaN wins over any
//     number, and a later NaN over an earlier one;
//   - a window that holds only -inf keeps torch's initial index, 0: the input's element (0, 0)
//     if the window covers it, no element otherwise;
//   - an input element's gradient is the sum, over the windows that chose it in row-major
//     order of the windows, of their output gradients, accumulated in float32 from 0; covered
//     by a single window, it is that window's gradient as it is.
// The CPU reference runs the same per-element code (MaxPoolMath) as the CUDA kernels.
#pragma once

#include <cstdint>

#include "common/cuda_fwd.h"
#include "common/dtype.h"
#include "optim/dtype_traits.h"

namespace nimble_train::ops {

// Window positions a one-byte code can name; kNoArgmax names none.
constexpr int kMaxWindow = 255;
constexpr uint8_t kNoArgmax = 255;

struct MaxPoolShape {
  int64_t batch = 0, channels = 0, height = 0, width = 0;
  int64_t out_height = 0, out_width = 0;
  int kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
};

// torch's pooling_output_shape with dilation 1: the windows along one dimension.
int64_t pooled_size(int64_t size, int kernel, int pad, int stride, bool ceil_mode);

// The shape for an input, with the output sizes filled in; InvalidArgument where torch's
// max_pool2d would refuse the parameters (non-positive kernel or stride, padding over half
// the kernel, an empty output) or a window holds more than kMaxWindow positions.
MaxPoolShape max_pool_shape(int64_t batch, int64_t channels, int64_t height, int64_t width,
                            int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h,
                            int pad_w, bool ceil_mode);

// One element's arithmetic, shared by the CPU reference and the CUDA kernels.
struct MaxPoolMath {
  // Output (oh, ow)'s window, clipped to the input: rows [h_begin, h_end), columns
  // [w_begin, w_end); (h0, w0) is its unclipped corner, which codes count from.
  struct Window {
    int h0, w0, h_begin, h_end, w_begin, w_end;
  };

  NT_HOST_DEVICE static Window window(const MaxPoolShape& s, int oh, int ow) {
    Window w;
    w.h0 = oh * s.stride_h - s.pad_h;
    w.w0 = ow * s.stride_w - s.pad_w;
    w.h_begin = w.h0 < 0 ? 0 : w.h0;
    w.w_begin = w.w0 < 0 ? 0 : w.w0;
    w.h_end = w.h0 + s.kernel_h < s.height ? w.h0 + s.kernel_h : static_cast<int>(s.height);
    w.w_end = w.w0 + s.kernel_w < s.width ? w.w0 + s.kernel_w : static_cast<int>(s.width);
    return w;
  }

  NT_HOST_DEVICE static uint8_t code(const MaxPoolShape& s, const Window& w, int ih, int iw) {
    return static_cast<uint8_t>((ih - w.h0) * s.kernel_w + (iw - w.w0));
  }

  // The code of a window whose maximum was never set (every value -inf): torch's initial index
  // 0, the input's element (0, 0), if the window covers it.
  NT_HOST_DEVICE static uint8_t initial_code(const MaxPoolShape& s, const Window& w) {
    return w.h0 <= 0 && w.w0 <= 0 && -w.h0 < s.kernel_h && -w.w0 < s.kernel_w
               ? code(s, w, 0, 0)
               : kNoArgmax;
  }

  // torch's comparison: larger, or NaN.
  NT_HOST_DEVICE static bool replaces(float value, float best) {
    return value > best || value != value;
  }

  // The windows that cover input row (or column) i: [first, last), as torch's p_start/p_end.
  NT_HOST_DEVICE static int first_window(int i, int pad, int kernel, int stride) {
    return i + pad < kernel ? 0 : (i + pad - kernel) / stride + 1;
  }
  NT_HOST_DEVICE static int last_window(int i, int pad, int stride, int64_t pooled) {
    const int last = (i + pad) / stride + 1;
    return last < pooled ? last : static_cast<int>(pooled);
  }
};

// ------------------------------------------------------------------ CPU reference
// x: [batch][height][width][channels]; y: [batch][out_height][out_width][channels]; argmax: the
// codes, laid out as y. grad_x: laid out as x.
void max_pool_forward_reference(const void* x, void* y, uint8_t* argmax, const MaxPoolShape& s,
                                DType dtype);
void max_pool_backward_reference(const void* grad_y, const uint8_t* argmax, void* grad_x,
                                 const MaxPoolShape& s, DType dtype);

// ------------------------------------------------------------------ CUDA (NT_HAVE_CUDA builds)
// The same, as kernels on `stream`: one thread per element and 16-byte pack of channels (one
// channel where the channel count or the pointers do not allow packs).
void max_pool_forward_cuda(const void* x, void* y, uint8_t* argmax, const MaxPoolShape& s,
                           DType dtype, cudaStream_t stream);
void max_pool_backward_cuda(const void* grad_y, const uint8_t* argmax, void* grad_x,
                            const MaxPoolShape& s, DType dtype, cudaStream_t stream);

}  // namespace nimble_train::ops
