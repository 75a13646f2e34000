// Shapes and the CPU reference of small_conv.h.
#include "ops/small_conv.h"

#include <vector>

#include "common/check.h"

namespace nimble_train::ops {

SmallConvShape small_conv_shape(int64_t batch, int64_t channels, int64_t height, int64_t width,
                                int64_t out_channels, int kernel_h, int kernel_w, int stride_h,
                                int stride_w, int pad_h, int pad_w, int dilation_h,
                                int dilation_w) {
  const char* op = "small_conv2d";
  NT_CHECK(kernel_h > 0 && kernel_w > 0 && stride_h > 0 && stride_w > 0 && dilation_h > 0 &&
               dilation_w > 0,
           op, ": kernel, stride and dilation must be positive; got kernel (", kernel_h, ", ",
           kernel_w, "), stride (", stride_h, ", ", stride_w, "), dilation (", dilation_h, ", ",
           dilation_w, ")");
  NT_CHECK(pad_h >= 0 && pad_w >= 0, op, ": padding must be non-negative; got (", pad_h, ", ",
           pad_w, ")");
  NT_CHECK(batch > 0 && channels > 0 && height > 0 && width > 0 && out_channels > 0, op,
           ": the input and the weight must be non-empty; got input [", batch, ", ", channels,
           ", ", height, ", ", width, "] and ", out_channels, " output channels");
  NT_CHECK(height < (int64_t(1) << 30) && width < (int64_t(1) << 30), op,
           ": height and width must be below 2^30; got ", height, " x ", width);
  NT_CHECK(channels * kernel_h * kernel_w <= kSmallConvMaxColumns, op,
           ": at most ", kSmallConvMaxColumns, " input channels x kernel positions; got ",
           channels, " x ", kernel_h, " x ", kernel_w, " (use torch's convolution)");
  NT_CHECK(out_channels <= kSmallConvMaxOutChannels, op, ": at most ",
           kSmallConvMaxOutChannels, " output channels; got ", out_channels,
           " (use torch's convolution)");
  SmallConvShape s;
  s.batch = batch;
  s.channels = static_cast<int>(channels);
  s.height = static_cast<int>(height);
  s.width = static_cast<int>(width);
  s.out_channels = static_cast<int>(out_channels);
  s.kernel_h = kernel_h;
  s.kernel_w = kernel_w;
  s.stride_h = stride_h;
  s.stride_w = stride_w;
  s.pad_h = pad_h;
  s.pad_w = pad_w;
  s.dilation_h = dilation_h;
  s.dilation_w = dilation_w;
  const int64_t out_h =
      (height + 2 * int64_t(pad_h) - int64_t(dilation_h) * (kernel_h - 1) - 1) / stride_h + 1;
  const int64_t out_w =
      (width + 2 * int64_t(pad_w) - int64_t(dilation_w) * (kernel_w - 1) - 1) / stride_w + 1;
  NT_CHECK(height + 2 * int64_t(pad_h) >= int64_t(dilation_h) * (kernel_h - 1) + 1 &&
               width + 2 * int64_t(pad_w) >= int64_t(dilation_w) * (kernel_w - 1) + 1,
           op, ": the padded input (", height, " x ", width, ", padding (", pad_h, ", ", pad_w,
           ")) is smaller than the kernel's extent (", kernel_h, " x ", kernel_w,
           ", dilation (", dilation_h, ", ", dilation_w, "))");
  s.out_height = static_cast<int>(out_h);
  s.out_width = static_cast<int>(out_w);
  NT_CHECK(s.pixels() < (int64_t(1) << 31), op, ": at most 2^31 output pixels (batch x height x "
           "width); got ", batch, " x ", out_h, " x ", out_w);
  return s;
}

namespace {

// The windows of every pixel: [pixels][columns + 1] floats, the last column 1 (the bias's).
template <typename Traits>
std::vector<float> windows(const typename Traits::Storage* x, const SmallConvShape& s) {
  const int k1 = s.columns() + 1;
  std::vector<float> out(static_cast<size_t>(s.pixels()) * k1);
  for (int64_t p = 0; p < s.pixels(); ++p) {
    int64_t n;
    int oh, ow;
    SmallConvMath::pixel(s, p, n, oh, ow);
    for (int k = 0; k < k1 - 1; ++k) {
      const int64_t at = SmallConvMath::input_offset(s, n, oh, ow, k);
      out[p * k1 + k] = at < 0 ? 0.0f : Traits::load(x[at]);
    }
    out[p * k1 + k1 - 1] = 1.0f;
  }
  return out;
}

template <typename Traits>
void forward(const void* x_, const void* w_, const void* b_, void* y_, const SmallConvShape& s) {
  using S = typename Traits::Storage;
  const S* w = static_cast<const S*>(w_);
  const S* b = static_cast<const S*>(b_);
  S* y = static_cast<S*>(y_);
  const int k1 = s.columns() + 1;
  const std::vector<float> win = windows<Traits>(static_cast<const S*>(x_), s);
  for (int64_t p = 0; p < s.pixels(); ++p) {
    for (int o = 0; o < s.out_channels; ++o) {
      float acc = 0.0f;
      for (int k = 0; k < k1 - 1; ++k) {
        acc += win[p * k1 + k] * Traits::load(w[SmallConvMath::weight_offset(s, o, k)]);
      }
      if (b != nullptr) acc += Traits::load(b[o]);
      y[p * s.out_channels + o] = Traits::store(acc);
    }
  }
}

template <typename Traits, typename GradTraits>
void weight_grad(const void* g_, const void* x_, void* gw_, void* gb_, const SmallConvShape& s) {
  using S = typename Traits::Storage;
  using G = typename GradTraits::Storage;
  const S* g = static_cast<const S*>(g_);
  const int k1 = s.columns() + 1;
  const int o_count = s.out_channels;
  const std::vector<float> win = windows<Traits>(static_cast<const S*>(x_), s);
  std::vector<float> acc(static_cast<size_t>(k1) * o_count, 0.0f);
  for (int64_t p = 0; p < s.pixels(); ++p) {
    int64_t n;
    int oh, ow;
    SmallConvMath::pixel(s, p, n, oh, ow);
    for (int o = 0; o < o_count; ++o) {
      const float go = Traits::load(
          g[n * s.g_stride[0] + o * s.g_stride[1] + oh * s.g_stride[2] + ow * s.g_stride[3]]);
      for (int k = 0; k < k1; ++k) acc[k * o_count + o] += win[p * k1 + k] * go;
    }
  }
  G* gw = static_cast<G*>(gw_);
  G* gb = static_cast<G*>(gb_);
  for (int o = 0; o < o_count; ++o) {
    for (int k = 0; k < k1 - 1; ++k) {
      gw[SmallConvMath::weight_offset(s, o, k)] = GradTraits::store(acc[k * o_count + o]);
    }
    if (gb != nullptr) gb[o] = GradTraits::store(acc[(k1 - 1) * o_count + o]);
  }
}

}  // namespace

void small_conv_forward_reference(const void* x, const void* weight, const void* bias, void* y,
                                  const SmallConvShape& s, DType dtype) {
  optim::dispatch_dtype(dtype, [&](auto traits) {
    forward<decltype(traits)>(x, weight, bias, y, s);
  });
}

void small_conv_weight_grad_reference(const void* grad_y, const void* x, void* grad_w,
                                      void* grad_b, const SmallConvShape& s, DType dtype,
                                      DType grad_dtype) {
  optim::dispatch_dtype(dtype, [&](auto traits) {
    optim::dispatch_dtype(grad_dtype, [&](auto grad_traits) {
      weight_grad<decltype(traits), decltype(grad_traits)>(grad_y, x, grad_w, grad_b, s);
    });
  });
}

}  // namespace nimble_train::ops
