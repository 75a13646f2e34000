// The fused batch norm + ReLU reference (src/ops/batch_norm_act.h) against an oracle in double
// precision written from the formulas in batch_norm_act.h: batch statistics of x, the
// normalisation, the residual, the ReLU, and the running averages with the unbiased variance.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "ops/batch_norm_act.h"
#include "optim/dtype_traits.h"

namespace nimble_train::ops {
namespace {

struct Oracle {
  std::vector<double> y, running_mean, running_var;
};

// Channel c's mean and biased variance of x [rows, channels], two passes in double.
std::pair<double, double> double_stats(const std::vector<float>& x, int64_t rows,
                                       int64_t channels, int64_t c) {
  double sum = 0.0, squares = 0.0;
  for (int64_t r = 0; r < rows; ++r) sum += x[r * channels + c];
  const double mean = sum / rows;
  for (int64_t r = 0; r < rows; ++r) {
    const double d = x[r * channels + c] - mean;
    squares += d * d;
  }
  return {mean, squares / rows};
}

// x and residual: [rows, channels] floats; the statistics in double, as a float64 batch norm.
Oracle oracle(const std::vector<float>& x, const std::vector<float>* residual, int64_t rows,
              int64_t channels, const std::vector<float>& w, const std::vector<float>& b,
              const std::vector<float>& rm, const std::vector<float>& rv, double momentum,
              double eps) {
  Oracle o{std::vector<double>(x.size()), std::vector<double>(channels),
           std::vector<double>(channels)};
  for (int64_t c = 0; c < channels; ++c) {
    const auto [mean, var] = double_stats(x, rows, channels, c);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r * channels + c;
      double z = w[c] * (x[i] - mean) / std::sqrt(var + eps) + b[c];
      if (residual != nullptr) z += (*residual)[i];
      o.y[i] = z < 0.0 ? 0.0 : z;
    }
    o.running_mean[c] = (1.0 - momentum) * rm[c] + momentum * mean;
    o.running_var[c] = (1.0 - momentum) * rv[c] + momentum * var * rows / (rows - 1);
  }
  return o;
}

void check(int64_t rows, int64_t channels, bool with_residual) {
  std::mt19937 gen(static_cast<unsigned>(rows * 131 + channels));
  std::normal_distribution<float> normal(0.5f, 2.0f);
  std::vector<float> x(rows * channels), res(rows * channels), w(channels), b(channels),
      rm(channels), rv(channels);
  for (auto* v : {&x, &res, &w, &b, &rm}) {
    for (float& e : *v) e = normal(gen);
  }
  for (float& e : rv) e = std::abs(normal(gen)) + 0.1f;
  const double momentum = 0.1, eps = 1e-5;
  const Oracle o = oracle(x, with_residual ? &res : nullptr, rows, channels, w, b, rm, rv,
                          momentum, eps);
  // The statistics as torch.batch_norm_stats hands them over: float32 mean and 1/sqrt(var+eps).
  std::vector<float> mean(channels), invstd(channels);
  for (int64_t c = 0; c < channels; ++c) {
    double sum = 0.0, squares = 0.0;
    for (int64_t r = 0; r < rows; ++r) sum += x[r * channels + c];
    for (int64_t r = 0; r < rows; ++r) {
      const double d = x[r * channels + c] - sum / rows;
      squares += d * d;
    }
    mean[c] = static_cast<float>(sum / rows);
    invstd[c] = static_cast<float>(1.0 / std::sqrt(squares / rows + eps));
  }
  std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
  BatchNormActParams p;
  p.mean = mean.data();
  p.invstd = invstd.data();
  p.weight = w.data();
  p.bias = b.data();
  p.running_mean = rm.data();
  p.running_var = rv.data();
  p.momentum = static_cast<float>(momentum);
  p.eps = static_cast<float>(eps);
  const BatchNormActShape s{rows, channels};
  std::vector<uint32_t> mask(relu_mask_words(s), 0xA5A5A5A5u);  // every word written
  batch_norm_relu_forward_reference(x.data(), with_residual ? res.data() : nullptr, y.data(),
                                    mask.data(), p, s, DType::kFloat32);
  int zeros = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    EXPECT_NEAR(y[i], o.y[i], 1e-5 * (1.0 + std::abs(o.y[i]))) << "element " << i;
    zeros += y[i] == 0.0f;
    EXPECT_EQ((mask[i / 32] >> (i % 32)) & 1u, y[i] > 0.0f ? 1u : 0u) << "element " << i;
  }
  for (size_t i = y.size(); i < mask.size() * 32; ++i) {
    EXPECT_EQ((mask[i / 32] >> (i % 32)) & 1u, 0u) << "bit " << i << " past the end";
  }
  EXPECT_GT(zeros, 0);
  EXPECT_LT(zeros, static_cast<int>(y.size()));
  for (int64_t c = 0; c < channels; ++c) {
    EXPECT_NEAR(rm[c], o.running_mean[c], 1e-6 * (1.0 + std::abs(o.running_mean[c])));
    EXPECT_NEAR(rv[c], o.running_var[c], 1e-5 * o.running_var[c]);
  }
}

TEST(BatchNormRelu, ReferenceIsTheFloat64Oracle) {
  check(37, 5, false);
  check(64, 16, true);
  check(2, 3, true);  // the fewest rows the unbiased variance takes
}

// The statistics from shifted sums against two-pass double sums, with the mean far from zero
// (40 standard deviations), where sums of x and x * x in float would lose the variance.
TEST(BatchNormRelu, StatisticsReferenceIsTheFloat64Oracle) {
  const int64_t rows = 4096, channels = 3;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(20.0f, 0.5f);
  std::vector<float> x(rows * channels);
  for (float& v : x) v = normal(gen);
  std::vector<float> mean(channels), invstd(channels);
  BatchNormStats out;
  out.mean = mean.data();
  out.invstd = invstd.data();
  out.eps = 1e-5f;
  batch_norm_stats_reference(x.data(), out, BatchNormActShape{rows, channels}, DType::kFloat32);
  for (int64_t c = 0; c < channels; ++c) {
    const auto [m, var] = double_stats(x, rows, channels, c);
    EXPECT_NEAR(mean[c], m, 1e-6 * m) << c;
    const double inv = 1.0 / std::sqrt(var + 1e-5);
    EXPECT_NEAR(invstd[c], inv, 1e-4 * inv) << c;
  }
}

TEST(BatchNormRelu, ReluKeepsNaNAndHalfStorageRounds) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(BatchNormActMath::apply(nan, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f)));
  EXPECT_EQ(BatchNormActMath::apply(-1.0f, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f), 0.0f);
  EXPECT_EQ(BatchNormActMath::apply(1.0f, 0.0f, 1.0f, 2.0f, 0.5f, 0.25f), 2.75f);
  // bfloat16 storage: each output is the float result rounded once.
  using BF16 = optim::DTypeTraits<DType::kBFloat16>;
  const std::vector<uint16_t> x = {BF16::store(1.3f), BF16::store(-0.7f)};
  std::vector<uint16_t> y(2);
  const float mean = 0.1f, invstd = 1.7f, w = 0.9f, b = 0.05f;
  BatchNormActParams p;
  p.mean = &mean;
  p.invstd = &invstd;
  p.weight = &w;
  p.bias = &b;
  batch_norm_relu_forward_reference(x.data(), nullptr, y.data(), nullptr, p,
                                    BatchNormActShape{2, 1}, DType::kBFloat16);
  for (int i = 0; i < 2; ++i) {
    const float expected = BatchNormActMath::apply(BF16::load(x[i]), mean, invstd, w, b, 0.0f);
    EXPECT_EQ(y[i], BF16::store(expected)) << i;
  }
}

// The backward from the forward's mask bits is the backward from the output, element for
// element, NaN outputs letting the gradient through as threshold_backward does; the mask's
// bits past the last element are never read as elements.
TEST(BatchNormRelu, BackwardFromTheMaskIsTheBackwardFromTheOutput) {
  const int64_t rows = 13, channels = 3;  // 39 elements: a second word, partly used
  const BatchNormActShape s{rows, channels};
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * channels), gy(x.size()), y(x.size());
  for (auto* v : {&x, &gy}) {
    for (float& e : *v) e = normal(gen);
  }
  x[4] = std::numeric_limits<float>::quiet_NaN();  // a NaN output
  const std::vector<float> mean = {0.1f, -0.2f, 0.3f}, invstd = {1.1f, 0.9f, 1.3f},
                           w = {0.8f, 1.2f, -0.5f}, b = {0.2f, 0.1f, -0.1f};
  BatchNormActParams p;
  p.mean = mean.data();
  p.invstd = invstd.data();
  p.weight = w.data();
  p.bias = b.data();
  std::vector<uint32_t> mask(relu_mask_words(s), 0xFFFFFFFFu);
  batch_norm_relu_forward_reference(x.data(), nullptr, y.data(), mask.data(), p, s,
                                    DType::kFloat32);
  EXPECT_TRUE(std::isnan(y[4]));
  EXPECT_EQ((mask[0] >> 4) & 1u, 1u);
  EXPECT_EQ(mask[1] >> 7, 0u);
  struct Grads {
    std::vector<float> x, r, w, b;
  };
  const auto run = [&](const void* out, const uint32_t* bits) {
    Grads got{std::vector<float>(x.size()), std::vector<float>(x.size()),
              std::vector<float>(channels), std::vector<float>(channels)};
    BatchNormActGrads g;
    g.grad_x = got.x.data();
    g.grad_residual = got.r.data();
    g.grad_weight = got.w.data();
    g.grad_bias = got.b.data();
    batch_norm_relu_backward_reference(gy.data(), out, bits, x.data(), p, g, s,
                                       DType::kFloat32);
    return got;
  };
  const Grads from_y = run(y.data(), nullptr);
  const Grads from_mask = run(nullptr, mask.data());
  int passed = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float through = y[i] <= 0.0f ? 0.0f : gy[i];
    EXPECT_EQ(from_y.r[i], through) << i;
    EXPECT_EQ(from_mask.r[i], through) << i;
    passed += through != 0.0f;
    const bool both_nan = std::isnan(from_y.x[i]) && std::isnan(from_mask.x[i]);
    if (!both_nan) EXPECT_EQ(from_y.x[i], from_mask.x[i]) << i;
  }
  EXPECT_GT(passed, 0);
  EXPECT_LT(passed, static_cast<int>(x.size()));
  for (int64_t c = 0; c < channels; ++c) {
    const bool w_nan = std::isnan(from_y.w[c]) && std::isnan(from_mask.w[c]);
    if (!w_nan) EXPECT_EQ(from_y.w[c], from_mask.w[c]) << c;
    const bool b_nan = std::isnan(from_y.b[c]) && std::isnan(from_mask.b[c]);
    if (!b_nan) EXPECT_EQ(from_y.b[c], from_mask.b[c]) << c;
  }
}

}  // namespace
}  // namespace nimble_train::ops
