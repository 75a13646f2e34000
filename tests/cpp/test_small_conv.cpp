// The stem-convolution reference (src/ops/small_conv.h) against a float64 oracle written from
// the definition of a convolution (input element (n, c, oh·stride + i·dilation − pad, ...)),
// with inputs and weights in strided layouts, and the shapes it refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/check.h"
#include "ops/small_conv.h"

namespace nimble_train::ops {
namespace {

struct Case {
  int64_t batch;
  int channels, height, width, out_channels, kh, kw, sh, sw, ph, pw, dh, dw;
  bool bias;
};

// Element strides of a [d0, d1, d2, d3] tensor, contiguous or channels-last.
void strides(const int64_t size[4], bool channels_last, int64_t out[4]) {
  if (channels_last) {
    out[1] = 1;
    out[3] = size[1];
    out[2] = size[1] * size[3];
    out[0] = size[1] * size[3] * size[2];
  } else {
    out[3] = 1;
    out[2] = size[3];
    out[1] = size[3] * size[2];
    out[0] = size[3] * size[2] * size[1];
  }
}

void check_against_oracle(const Case& c, bool channels_last, std::mt19937& rng) {
  SmallConvShape s = small_conv_shape(c.batch, c.channels, c.height, c.width, c.out_channels,
                                      c.kh, c.kw, c.sh, c.sw, c.ph, c.pw, c.dh, c.dw);
  const int64_t x_size[4] = {c.batch, c.channels, c.height, c.width};
  const int64_t w_size[4] = {c.out_channels, c.channels, c.kh, c.kw};
  const int64_t g_size[4] = {c.batch, c.out_channels, s.out_height, s.out_width};
  strides(x_size, channels_last, s.x_stride);
  strides(w_size, channels_last, s.w_stride);
  strides(g_size, !channels_last, s.g_stride);  // the other layout: any is read
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(c.batch * c.channels * c.height * c.width));
  std::vector<float> w(static_cast<size_t>(c.out_channels * c.channels * c.kh * c.kw));
  std::vector<float> b(static_cast<size_t>(c.out_channels));
  std::vector<float> g(static_cast<size_t>(s.pixels() * c.out_channels));
  for (auto* v : {&x, &w, &b, &g}) {
    for (float& e : *v) e = normal(rng);
  }
  std::vector<float> y(g.size()), gw(w.size()), gb(b.size());
  small_conv_forward_reference(x.data(), w.data(), c.bias ? b.data() : nullptr, y.data(), s,
                               DType::kFloat32);
  small_conv_weight_grad_reference(g.data(), x.data(), gw.data(), c.bias ? gb.data() : nullptr,
                                   s, DType::kFloat32, DType::kFloat32);

  auto at = [](const int64_t st[4], int64_t a, int64_t b2, int64_t c2, int64_t d) {
    return static_cast<size_t>(a * st[0] + b2 * st[1] + c2 * st[2] + d * st[3]);
  };
  std::vector<double> want_gw(w.size(), 0.0), want_gb(b.size(), 0.0);
  for (int64_t n = 0; n < c.batch; ++n) {
    for (int oh = 0; oh < s.out_height; ++oh) {
      for (int ow = 0; ow < s.out_width; ++ow) {
        const size_t pixel = static_cast<size_t>((n * s.out_height + oh) * s.out_width + ow);
        for (int o = 0; o < c.out_channels; ++o) {
          double want = c.bias ? b[o] : 0.0;
          const double go = g[at(s.g_stride, n, o, oh, ow)];
          want_gb[o] += go;
          for (int ci = 0; ci < c.channels; ++ci) {
            for (int i = 0; i < c.kh; ++i) {
              for (int j = 0; j < c.kw; ++j) {
                const int ih = oh * c.sh - c.ph + i * c.dh, iw = ow * c.sw - c.pw + j * c.dw;
                if (ih < 0 || iw < 0 || ih >= c.height || iw >= c.width) continue;
                const double xv = x[at(s.x_stride, n, ci, ih, iw)];
                want += xv * w[at(s.w_stride, o, ci, i, j)];
                want_gw[at(s.w_stride, o, ci, i, j)] += xv * go;
              }
            }
          }
          EXPECT_NEAR(y[pixel * c.out_channels + o], want, 1e-4 * (1 + std::fabs(want)))
              << "pixel " << pixel << " channel " << o;
        }
      }
    }
  }
  for (size_t i = 0; i < gw.size(); ++i) {
    EXPECT_NEAR(gw[i], want_gw[i], 1e-3 * (1 + std::fabs(want_gw[i]))) << "weight " << i;
  }
  if (c.bias) {
    for (size_t o = 0; o < gb.size(); ++o) {
      EXPECT_NEAR(gb[o], want_gb[o], 1e-3 * (1 + std::fabs(want_gb[o]))) << "bias " << o;
    }
  }
}

TEST(SmallConvReference, MatchesTheDefinitionInEitherLayout) {
  std::mt19937 rng(7);
  const Case cases[] = {
      {2, 3, 9, 11, 8, 3, 3, 1, 1, 1, 1, 1, 1, false},
      {3, 3, 12, 12, 24, 2, 2, 1, 1, 0, 0, 1, 1, true},
      {2, 2, 15, 10, 6, 3, 2, 2, 1, 1, 2, 2, 1, true},
      {1, 4, 7, 7, 5, 2, 4, 1, 2, 1, 2, 1, 1, false},
      {2, 1, 8, 8, 4, 5, 5, 2, 2, 2, 2, 1, 1, true},
  };
  for (const Case& c : cases) {
    check_against_oracle(c, false, rng);
    check_against_oracle(c, true, rng);
  }
}

TEST(SmallConvShape, OutputSizesAreTorchs) {
  // torch.nn.functional.conv2d's output sizes for the same parameters.
  EXPECT_EQ(small_conv_shape(1, 3, 32, 32, 64, 3, 3, 1, 1, 1, 1, 1, 1).out_height, 32);
  EXPECT_EQ(small_conv_shape(1, 3, 32, 32, 24, 2, 2, 1, 1, 0, 0, 1, 1).out_width, 31);
  EXPECT_EQ(small_conv_shape(1, 3, 224, 224, 32, 3, 3, 2, 2, 1, 1, 1, 1).out_height, 112);
  EXPECT_EQ(small_conv_shape(1, 3, 15, 10, 6, 3, 2, 2, 1, 1, 2, 2, 1).out_height, 7);
  EXPECT_EQ(small_conv_shape(1, 3, 15, 10, 6, 3, 2, 2, 1, 1, 2, 2, 1).out_width, 13);
}

TEST(SmallConvShape, RefusesWhatTheKernelsDoNotTake) {
  EXPECT_THROW(small_conv_shape(1, 4, 8, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1), InvalidArgument);
  EXPECT_THROW(small_conv_shape(1, 3, 8, 8, 257, 1, 1, 1, 1, 0, 0, 1, 1), InvalidArgument);
  EXPECT_THROW(small_conv_shape(1, 3, 2, 2, 8, 3, 3, 1, 1, 0, 0, 1, 1), InvalidArgument);
  EXPECT_THROW(small_conv_shape(1, 3, 8, 8, 8, 3, 3, 0, 1, 1, 1, 1, 1), InvalidArgument);
  EXPECT_THROW(small_conv_shape(1, 3, 8, 8, 8, 3, 3, 1, 1, -1, 1, 1, 1), InvalidArgument);
  EXPECT_THROW(small_conv_shape(0, 3, 8, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1), InvalidArgument);
}

}  // namespace
}  // namespace nimble_train::ops
