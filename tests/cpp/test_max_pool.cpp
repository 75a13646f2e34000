// The max-pooling reference (src/ops/max_pool.h): output sizes as torch computes them, and the
// forward and backward against oracles written from the rules in max_pool.h: the forward by
// scanning each window for its first largest value, the backward by scattering each output's
// gradient onto the element its window chose (in output order, which is the gather's order of
// sums).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/check.h"
#include "ops/max_pool.h"
#include "optim/dtype_traits.h"

namespace nimble_train::ops {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(MaxPoolShape, OutputSizesAreTorchs) {
  struct Case {
    int64_t size;
    int kernel, stride, pad;
    bool ceil_mode;
    int64_t expected;  // torch.nn.functional.max_pool2d's
  };
  const Case cases[] = {{32, 3, 2, 1, false, 16}, {32, 3, 2, 0, true, 16}, {15, 3, 2, 0, true, 7},
                        {15, 3, 2, 0, false, 7},  {7, 2, 2, 0, true, 4},   {1, 3, 1, 1, false, 1},
                        {4, 3, 3, 1, true, 2},    {5, 4, 3, 2, true, 3},   {9, 5, 1, 2, false, 9},
                        {10, 3, 3, 0, true, 4}};
  for (const Case& c : cases) {
    EXPECT_EQ(pooled_size(c.size, c.kernel, c.pad, c.stride, c.ceil_mode), c.expected)
        << c.size << " k" << c.kernel << " s" << c.stride << " p" << c.pad << " ceil "
        << c.ceil_mode;
  }
}

TEST(MaxPoolShape, RefusesWhatTorchRefusesAndWindowsOverOneByte) {
  EXPECT_THROW(max_pool_shape(1, 1, 8, 8, 3, 3, 1, 1, 2, 0, false), InvalidArgument);  // pad
  EXPECT_THROW(max_pool_shape(1, 1, 8, 8, 0, 3, 1, 1, 0, 0, false), InvalidArgument);
  EXPECT_THROW(max_pool_shape(1, 1, 8, 8, 3, 3, 0, 1, 0, 0, false), InvalidArgument);
  EXPECT_THROW(max_pool_shape(1, 1, 2, 2, 3, 3, 1, 1, 0, 0, false), InvalidArgument);  // empty
  EXPECT_THROW(max_pool_shape(1, 1, 32, 32, 16, 16, 1, 1, 0, 0, false), InvalidArgument);
  EXPECT_THROW(max_pool_shape(0, 1, 8, 8, 2, 2, 2, 2, 0, 0, false), InvalidArgument);
  const MaxPoolShape s = max_pool_shape(2, 3, 9, 7, 3, 2, 2, 1, 1, 0, true);
  EXPECT_EQ(s.out_height, 5);
  EXPECT_EQ(s.out_width, 6);
}

// x[n][h][w][c] as a flat NHWC vector.
struct Image {
  MaxPoolShape s;
  std::vector<float> x;
  float& at(int64_t n, int64_t h, int64_t w, int64_t c) {
    return x[static_cast<size_t>(((n * s.height + h) * s.width + w) * s.channels + c)];
  }
};

// The oracle's choice for output (n, oh, ow, c): (row, column) of the element, or (-1, -1).
struct Choice {
  float value;
  int h, w;
};

Choice oracle_choice(Image& img, int64_t n, int oh, int ow, int64_t c) {
  const MaxPoolShape& s = img.s;
  Choice best{-kInf, -1, -1};
  bool set = false;
  for (int kh = 0; kh < s.kernel_h; ++kh) {
    for (int kw = 0; kw < s.kernel_w; ++kw) {
      const int h = oh * s.stride_h - s.pad_h + kh, w = ow * s.stride_w - s.pad_w + kw;
      if (h < 0 || w < 0 || h >= s.height || w >= s.width) continue;  // padding
      const float v = img.at(n, h, w, c);
      if (std::isnan(v) || v > best.value) {  // NaN wins; ties keep the first
        best = {v, h, w};
        set = true;
      }
    }
  }
  if (!set) {  // only -inf: torch's initial index 0, element (0, 0) if the window covers it
    const int h0 = oh * s.stride_h - s.pad_h, w0 = ow * s.stride_w - s.pad_w;
    const bool covers = h0 <= 0 && w0 <= 0 && h0 + s.kernel_h > 0 && w0 + s.kernel_w > 0;
    best = {-kInf, covers ? 0 : -1, covers ? 0 : -1};
  }
  return best;
}

void check_against_oracle(const MaxPoolShape& s, std::mt19937& rng, bool special) {
  Image img{s, std::vector<float>(static_cast<size_t>(s.batch * s.height * s.width * s.channels))};
  std::uniform_int_distribution<int> small(0, 2);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (float& v : img.x) {
    v = static_cast<float>(small(rng));  // ties everywhere
    if (special && unit(rng) < 0.05f) v = std::numeric_limits<float>::quiet_NaN();
    if (special && unit(rng) < 0.3f) v = -kInf;
  }
  const size_t outs = static_cast<size_t>(s.batch * s.out_height * s.out_width * s.channels);
  std::vector<float> y(outs), grad_y(outs), grad_x(img.x.size()), expected(img.x.size(), 0.0f);
  std::vector<uint8_t> argmax(outs);
  for (float& g : grad_y) g = 0.5f + unit(rng);  // never zero: the sums' signs stay simple
  max_pool_forward_reference(img.x.data(), y.data(), argmax.data(), s, DType::kFloat32);
  max_pool_backward_reference(grad_y.data(), argmax.data(), grad_x.data(), s, DType::kFloat32);
  size_t o = 0;
  for (int64_t n = 0; n < s.batch; ++n) {
    for (int oh = 0; oh < s.out_height; ++oh) {
      for (int ow = 0; ow < s.out_width; ++ow) {
        for (int64_t c = 0; c < s.channels; ++c, ++o) {
          const Choice want = oracle_choice(img, n, oh, ow, c);
          if (std::isnan(want.value)) {
            EXPECT_TRUE(std::isnan(y[o]));
          } else {
            EXPECT_EQ(y[o], want.value) << "output " << o;
          }
          if (want.h >= 0) {
            expected[static_cast<size_t>(((n * s.height + want.h) * s.width + want.w) *
                                             s.channels + c)] += grad_y[o];
          } else {
            EXPECT_EQ(argmax[o], kNoArgmax);
          }
        }
      }
    }
  }
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(grad_x[i], expected[i]) << "input " << i;
}

TEST(MaxPoolReference, ForwardAndBackwardFollowTheRules) {
  std::mt19937 rng(7);
  const MaxPoolShape shapes[] = {
      max_pool_shape(2, 3, 9, 9, 3, 3, 1, 1, 1, 1, false),
      max_pool_shape(1, 5, 10, 11, 3, 3, 2, 2, 0, 0, true),
      max_pool_shape(2, 2, 7, 9, 3, 2, 2, 1, 1, 0, true),
      max_pool_shape(1, 4, 8, 8, 2, 2, 2, 2, 0, 0, false),
      max_pool_shape(1, 2, 12, 12, 2, 4, 3, 3, 1, 2, true)};
  for (const MaxPoolShape& s : shapes) {
    check_against_oracle(s, rng, false);
    check_against_oracle(s, rng, true);
  }
}

TEST(MaxPoolReference, HalfTypesChooseAsFloatAndRoundTheFloatSumOnce) {
  std::mt19937 rng(3);
  const MaxPoolShape s = max_pool_shape(1, 3, 7, 7, 3, 3, 1, 1, 1, 1, false);
  const size_t ins = static_cast<size_t>(s.height * s.width * s.channels);
  const size_t outs = static_cast<size_t>(s.out_height * s.out_width * s.channels);
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> x(ins), grad_y(outs);
  for (float& v : x) v = static_cast<float>(small(rng)) * 0.25f;  // exact in bfloat16
  for (float& g : grad_y) g = optim::bfloat16_to_float(optim::float_to_bfloat16(unit(rng)));
  std::vector<uint16_t> xb(ins), yb(outs), gyb(outs), gxb(ins);
  for (size_t i = 0; i < ins; ++i) xb[i] = optim::float_to_bfloat16(x[i]);
  for (size_t i = 0; i < outs; ++i) gyb[i] = optim::float_to_bfloat16(grad_y[i]);
  std::vector<float> y(outs), gx(ins);
  std::vector<uint8_t> a(outs), ab(outs);
  max_pool_forward_reference(x.data(), y.data(), a.data(), s, DType::kFloat32);
  max_pool_backward_reference(grad_y.data(), a.data(), gx.data(), s, DType::kFloat32);
  max_pool_forward_reference(xb.data(), yb.data(), ab.data(), s, DType::kBFloat16);
  max_pool_backward_reference(gyb.data(), ab.data(), gxb.data(), s, DType::kBFloat16);
  EXPECT_EQ(a, ab);
  for (size_t i = 0; i < outs; ++i) EXPECT_EQ(optim::bfloat16_to_float(yb[i]), y[i]);
  for (size_t i = 0; i < ins; ++i) EXPECT_EQ(gxb[i], optim::float_to_bfloat16(gx[i]));
}

}  // namespace
}  // namespace nimble_train::ops
