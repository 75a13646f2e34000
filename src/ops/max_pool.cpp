// Shapes and the CPU reference of max_pool.h.
#include "ops/max_pool.h"

#include <limits>

#include "common/check.h"

namespace nimble_train::ops {

int64_t pooled_size(int64_t size, int kernel, int pad, int stride, bool ceil_mode) {
  const int64_t span = size + 2 * int64_t(pad) - kernel + (ceil_mode ? stride - 1 : 0);
  // Division rounding down, as torch's div_rtn (span is negative for a window wider than the
  // padded input).
  int64_t out = (span >= 0 ? span / stride : -((-span + stride - 1) / stride)) + 1;
  if (ceil_mode && (out - 1) * stride >= size + pad) --out;  // the last window starts inside
  return out;
}

MaxPoolShape max_pool_shape(int64_t batch, int64_t channels, int64_t height, int64_t width,
                            int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h,
                            int pad_w, bool ceil_mode) {
  NT_CHECK(kernel_h > 0 && kernel_w > 0 && stride_h > 0 && stride_w > 0,
           "max_pool: kernel and stride must be positive; got kernel (", kernel_h, ", ",
           kernel_w, ") and stride (", stride_h, ", ", stride_w, ")");
  NT_CHECK(pad_h >= 0 && pad_w >= 0 && pad_h <= kernel_h / 2 && pad_w <= kernel_w / 2,
           "max_pool: padding must be in [0, kernel / 2]; got padding (", pad_h, ", ", pad_w,
           ") for kernel (", kernel_h, ", ", kernel_w, ")");
  NT_CHECK(kernel_h * kernel_w <= kMaxWindow, "max_pool: a window may hold at most ",
           kMaxWindow, " positions (one-byte argmax codes); got kernel (", kernel_h, ", ",
           kernel_w, ")");
  NT_CHECK(batch > 0 && channels > 0 && height > 0 && width > 0,
           "max_pool: the input must be non-empty; got [", batch, ", ", channels, ", ", height,
           ", ", width, "]");
  NT_CHECK(height < (int64_t(1) << 30) && width < (int64_t(1) << 30),
           "max_pool: height and width must be below 2^30; got ", height, " x ", width);
  MaxPoolShape s;
  s.batch = batch;
  s.channels = channels;
  s.height = height;
  s.width = width;
  s.kernel_h = kernel_h;
  s.kernel_w = kernel_w;
  s.stride_h = stride_h;
  s.stride_w = stride_w;
  s.pad_h = pad_h;
  s.pad_w = pad_w;
  s.out_height = pooled_size(height, kernel_h, pad_h, stride_h, ceil_mode);
  s.out_width = pooled_size(width, kernel_w, pad_w, stride_w, ceil_mode);
  NT_CHECK(s.out_height > 0 && s.out_width > 0, "max_pool: the output would be empty (",
           s.out_height, " x ", s.out_width, ") for a ", height, " x ", width,
           " input; use a smaller kernel or more padding");
  return s;
}

namespace {

template <typename Traits>
void forward(const void* x_, void* y_, uint8_t* argmax, const MaxPoolShape& s) {
  using S = typename Traits::Storage;
  const S* x = static_cast<const S*>(x_);
  S* y = static_cast<S*>(y_);
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const S minus_inf = Traits::store(kMinusInf);
  for (int64_t n = 0; n < s.batch; ++n) {
    for (int oh = 0; oh < s.out_height; ++oh) {
      for (int ow = 0; ow < s.out_width; ++ow) {
        const auto w = MaxPoolMath::window(s, oh, ow);
        const int64_t out = ((n * s.out_height + oh) * s.out_width + ow) * s.channels;
        for (int64_t c = 0; c < s.channels; ++c) {
          float best = kMinusInf;
          S best_value = minus_inf;
          uint8_t code = MaxPoolMath::initial_code(s, w);
          for (int ih = w.h_begin; ih < w.h_end; ++ih) {
            for (int iw = w.w_begin; iw < w.w_end; ++iw) {
              const S v = x[((n * s.height + ih) * s.width + iw) * s.channels + c];
              const float f = Traits::load(v);
              if (MaxPoolMath::replaces(f, best)) {
                best = f;
                best_value = v;
                code = MaxPoolMath::code(s, w, ih, iw);
              }
            }
          }
          y[out + c] = best_value;
          argmax[out + c] = code;
        }
      }
    }
  }
}

template <typename Traits>
void backward(const void* grad_y_, const uint8_t* argmax, void* grad_x_, const MaxPoolShape& s) {
  using S = typename Traits::Storage;
  const S* grad_y = static_cast<const S*>(grad_y_);
  S* grad_x = static_cast<S*>(grad_x_);
  for (int64_t n = 0; n < s.batch; ++n) {
    for (int ih = 0; ih < s.height; ++ih) {
      const int ph0 = MaxPoolMath::first_window(ih, s.pad_h, s.kernel_h, s.stride_h);
      const int ph1 = MaxPoolMath::last_window(ih, s.pad_h, s.stride_h, s.out_height);
      for (int iw = 0; iw < s.width; ++iw) {
        const int pw0 = MaxPoolMath::first_window(iw, s.pad_w, s.kernel_w, s.stride_w);
        const int pw1 = MaxPoolMath::last_window(iw, s.pad_w, s.stride_w, s.out_width);
        const bool single = ph1 - ph0 == 1 && pw1 - pw0 == 1;
        const int64_t in = ((n * s.height + ih) * s.width + iw) * s.channels;
        for (int64_t c = 0; c < s.channels; ++c) {
          float sum = 0.0f;
          S direct = Traits::store(0.0f);
          for (int oh = ph0; oh < ph1; ++oh) {
            for (int ow = pw0; ow < pw1; ++ow) {
              const auto w = MaxPoolMath::window(s, oh, ow);
              const int64_t out = ((n * s.out_height + oh) * s.out_width + ow) * s.channels + c;
              if (argmax[out] == MaxPoolMath::code(s, w, ih, iw)) {
                sum += Traits::load(grad_y[out]);
                direct = grad_y[out];
              }
            }
          }
          grad_x[in + c] = single ? direct : Traits::store(sum);
        }
      }
    }
  }
}

}  // namespace

void max_pool_forward_reference(const void* x, void* y, uint8_t* argmax, const MaxPoolShape& s,
                                DType dtype) {
  optim::dispatch_dtype(dtype, [&](auto traits) { forward<decltype(traits)>(x, y, argmax, s); });
}

void max_pool_backward_reference(const void* grad_y, const uint8_t* argmax, void* grad_x,
                                 const MaxPoolShape& s, DType dtype) {
  optim::dispatch_dtype(dtype, [&](auto traits) {
    backward<decltype(traits)>(grad_y, argmax, grad_x, s);
  });
}

}  // namespace nimble_train::ops
