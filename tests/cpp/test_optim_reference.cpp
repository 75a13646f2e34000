// The CPU references of the fused optimizer (fused_update.h, step_control.h) against float64
// loops, on awkward sizes, each dtype, fresh random inputs; and the float16/bfloat16 conversions
// they share with the CUDA kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "optim/device_tables.h"
#include "optim/dtype_traits.h"
#include "optim/fused_update.h"
#include "optim/step_control.h"

namespace nimble_train::optim {
namespace {

// ------------------------------------------------------------------ conversions

#if defined(__FLT16_MAX__)
uint16_t reference_half_bits(float f) {
  const _Float16 h = static_cast<_Float16>(f);  // the compiler's correctly rounded conversion
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}
#endif

TEST(HalfConversion, EveryHalfRoundTrips) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float f = half_to_float(static_cast<uint16_t>(bits));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f)))) << "bits " << bits;
      continue;
    }
    ASSERT_EQ(float_to_half(f), bits) << "bits " << bits << " -> " << f;
  }
}

TEST(HalfConversion, RoundsToNearestEvenLikeTheCompiler) {
#if defined(__FLT16_MAX__)
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits;
  // Random bit patterns cover every exponent, subnormals, overflow to infinity and ties.
  for (int i = 0; i < 2000000; ++i) {
    const float f = bits_float(any_bits(rng));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), reference_half_bits(f)) << "float " << f;
  }
  for (float f : {65504.0f, 65519.99f, 65520.0f, 5.9604645e-8f, 2.9802322e-8f, 2.9802326e-8f,
                  6.1035156e-5f, 6.1032104e-5f, -0.0f}) {
    EXPECT_EQ(float_to_half(f), reference_half_bits(f)) << "float " << f;
  }
#else
  GTEST_SKIP() << "this compiler has no _Float16 to compare with; EveryHalfRoundTrips still runs";
#endif
}

TEST(BFloat16Conversion, RoundsToNearestEven) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 2000000; ++i) {
    const float f = bits_float(any_bits(rng));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(f))));
      continue;
    }
    const uint16_t b = float_to_bfloat16(f);
    // The nearest of the two bfloat16 neighbours, ties to the even one, computed in double.
    const uint16_t down = static_cast<uint16_t>(float_bits(f) >> 16);
    const double lo = bfloat16_to_float(down);
    // Past the largest finite value the next neighbour is infinity, standing for +-2^128 in
    // round-to-nearest (IEEE 754 overflow).
    const double hi = std::isinf(bfloat16_to_float(down + 1))
                          ? std::copysign(std::ldexp(1.0, 128), double(f))
                          : double(bfloat16_to_float(down + 1));
    const double d_lo = std::fabs(double(f) - lo), d_hi = std::fabs(hi - double(f));
    const uint16_t expected =
        (d_lo < d_hi || (d_lo == d_hi && (down & 1) == 0) || std::isinf(f)) ? down : down + 1;
    ASSERT_EQ(b, expected) << "float " << f;
  }
}

// ------------------------------------------------------------------ update references

enum class Algo { kSgd, kSgdNesterov, kAdam, kAdamW, kAmsgrad, kLamb };

const char* algo_name(Algo a) {
  switch (a) {
    case Algo::kSgd: return "sgd";
    case Algo::kSgdNesterov: return "sgd_nesterov";
    case Algo::kAdam: return "adam";
    case Algo::kAdamW: return "adamw";
    case Algo::kAmsgrad: return "adam_amsgrad";
    case Algo::kLamb: return "lamb";
  }
  return "?";
}

struct Case {
  Algo algo;
  DType dtype;
  int64_t size;
  int step;  // the step count after this step (1: SGD's first step)
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << algo_name(c.algo) << " " << dtype_name(c.dtype) << " x " << c.size << " step "
      << c.step;
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(algo_name(c.algo)) + "_" + dtype_name(c.dtype) + "_n" +
         std::to_string(c.size) + "_step" + std::to_string(c.step);
}

// Two units in the last place of 1 in the dtype: the bound is a few of these, relative to the
// magnitudes involved (the update is float32 arithmetic rounded once into the dtype).
double dtype_eps(DType d) {
  switch (d) {
    case DType::kFloat32: return std::ldexp(1.0, -23);
    case DType::kFloat16: return std::ldexp(1.0, -10);
    case DType::kBFloat16: return std::ldexp(1.0, -7);
  }
  return 1.0;
}

// Two groups with different hyper-parameters; the staged columns, then the derived ones.
std::vector<float> make_hyper(const Case& c) {
  std::vector<float> hyper(2 * kHyperColumns, 0.0f);
  for (int g = 0; g < 2; ++g) {
    float* h = &hyper[g * kHyperColumns];
    h[kLr] = g == 0 ? 0.01f : 0.003f;
    h[kWeightDecay] = g == 0 ? 0.05f : 0.0f;
    h[kMomentum] = 0.9f;
    h[kDampening] = c.algo == Algo::kSgd ? 0.1f : 0.0f;
    h[kNesterov] = c.algo == Algo::kSgdNesterov ? 1.0f : 0.0f;
    h[kMaximize] = (c.algo == Algo::kSgd && g == 1) ? 1.0f : 0.0f;
    h[kBeta1] = 0.9f;
    h[kBeta2] = 0.999f;
    h[kEps] = 1e-6f;
    h[kBiasCorrection] = g == 0 ? 1.0f : 0.0f;
    h[kDecoupledDecay] = c.algo == Algo::kAdamW ? 1.0f : 0.0f;
    h[kAlwaysAdapt] = 0.0f;
    h[kStep] = static_cast<float>(c.step);
    derive_hyper(h);
  }
  return hyper;
}

// Tensors of ~n/3 elements (LAMB's norms are per tensor); the first tensor is group 0, the
// others group 1. Offsets are rounded to 8 elements, as the Python layer pads segments.
std::vector<int64_t> make_offsets(int64_t n) {
  std::vector<int64_t> off = {0};
  const int64_t third = (n / 3 + 7) / 8 * 8;
  if (third > 0 && third < n) off.push_back(third);
  if (2 * third > 0 && 2 * third < n) off.push_back(2 * third);
  off.push_back(n);
  return off;
}

struct Buffers {
  std::vector<double> p, g, m, v, vmax;  // inputs, already rounded to the dtype
};

template <typename Traits>
void run(const Case& c) {
  using S = typename Traits::Storage;
  const int64_t n = c.size;
  std::mt19937 rng(static_cast<uint32_t>(n * 31 + int(c.algo) * 7 + int(c.dtype)));
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.01, 0.2);
  const float factor = 0.37f;  // an unscale-and-clip factor, read from the control block

  std::vector<S> p(n), g(n), s0(n), s1(n), s2(n);
  Buffers in;
  auto fill = [&](std::vector<S>& dst, std::vector<double>& copy, auto&& draw) {
    copy.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = Traits::store(static_cast<float>(draw()));
      copy[i] = Traits::load(dst[i]);
    }
  };
  fill(p, in.p, [&] { return normal(rng); });
  fill(g, in.g, [&] { return normal(rng) * 3.0; });
  fill(s0, in.m, [&] { return normal(rng) * 0.3; });
  fill(s1, in.v, [&] { return uniform(rng); });
  fill(s2, in.vmax, [&] { return uniform(rng) * 1.5; });

  const std::vector<int64_t> offsets = make_offsets(n);
  const int64_t num_tensors = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<int64_t> tensor_group(num_tensors, 1);
  tensor_group[0] = 0;
  std::vector<int64_t> first_chunk;
  // 1000-element chunks: several chunks per tensor at the larger sizes.
  const std::vector<int64_t> chunks =
      build_chunk_table(offsets.data(), tensor_group.data(), num_tensors, 1000, &first_chunk);
  const std::vector<float> hyper = make_hyper(c);
  std::vector<float> control(kControlSize, 0.0f);
  control[kGradFactor] = factor;

  FlatBuffers b;
  b.param = p.data();
  b.grad = g.data();
  b.state[0] = s0.data();
  b.state[1] = s1.data();
  b.state[2] = s2.data();
  b.dtype = c.dtype;
  b.numel = n;
  const UpdateTables t{chunks.data(), static_cast<int64_t>(chunks.size()) / kChunkColumns,
                       hyper.data(), control.data()};
  std::vector<float> chunk_norms(2 * t.num_chunks), trust(num_tensors);
  const LambTables l{first_chunk.data(), num_tensors, chunk_norms.data(), trust.data()};

  switch (c.algo) {
    case Algo::kSgd:
    case Algo::kSgdNesterov: sgd_update_reference<Traits>(b, t); break;
    case Algo::kAdam:
    case Algo::kAdamW: adam_update_reference<Traits, false>(b, t); break;
    case Algo::kAmsgrad: adam_update_reference<Traits, true>(b, t); break;
    case Algo::kLamb: lamb_update_reference<Traits>(b, t, l); break;
  }

  // The float64 reference, element by element (LAMB: per tensor, for its norms).
  const double eps = dtype_eps(c.dtype);
  const double t_step = c.step;
  for (int64_t tensor = 0; tensor < num_tensors; ++tensor) {
    const int64_t lo = offsets[tensor], hi = offsets[tensor + 1];
    const int group = tensor == 0 ? 0 : 1;
    const float* h = &hyper[group * kHyperColumns];
    const double lr = h[kLr], wd = h[kWeightDecay], mom = h[kMomentum], damp = h[kDampening];
    const double b1 = h[kBeta1], b2 = h[kBeta2], e = h[kEps];
    std::vector<double> exp_p(hi - lo), exp_m(hi - lo), exp_v(hi - lo), exp_vmax(hi - lo),
        scale(hi - lo);
    double w_sq = 0.0, u_sq = 0.0;
    std::vector<double> u(hi - lo);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t k = i - lo;
      double grad = in.g[i] * double(factor), w = in.p[i];
      double m = in.m[i], v = in.v[i], vmax = in.vmax[i];
      switch (c.algo) {
        case Algo::kSgd:
        case Algo::kSgdNesterov: {
          if (h[kMaximize] != 0.0f) grad = -grad;
          grad += wd * w;
          m = c.step == 1 ? grad : m * mom + (1.0 - damp) * grad;
          const double d = h[kNesterov] != 0.0f ? grad + mom * m : m;
          exp_p[k] = w - lr * d;
          scale[k] = std::fabs(w) + std::fabs(lr * d);
          break;
        }
        case Algo::kAdam:
        case Algo::kAdamW:
        case Algo::kAmsgrad: {
          if (c.algo == Algo::kAdamW) {
            w *= 1.0 - lr * wd;
          } else {
            grad += wd * w;
          }
          m = m + (1.0 - b1) * (grad - m);
          v = v * b2 + (1.0 - b2) * grad * grad;
          vmax = std::max(vmax, v);
          const double second = c.algo == Algo::kAmsgrad ? vmax : v;
          const double bc1 = 1.0 - std::pow(b1, t_step), bc2 = 1.0 - std::pow(b2, t_step);
          const double d = (lr / bc1) * m / (std::sqrt(second) / std::sqrt(bc2) + e);
          exp_p[k] = w - d;
          scale[k] = std::fabs(in.p[i]) + std::fabs(d) * 4;
          break;
        }
        case Algo::kLamb: {
          m = m * b1 + (1.0 - b1) * grad;
          v = v * b2 + (1.0 - b2) * grad * grad;
          const bool bc = h[kBiasCorrection] != 0.0f;
          const double ibc1 = bc ? 1.0 / (1.0 - std::pow(b1, t_step)) : 1.0;
          const double ibc2 = bc ? 1.0 / (1.0 - std::pow(b2, t_step)) : 1.0;
          u[k] = (m * ibc1) / (std::sqrt(v * ibc2) + e) + wd * w;
          w_sq += w * w;
          u_sq += u[k] * u[k];
          break;
        }
      }
      exp_m[k] = m;
      exp_v[k] = v;
      exp_vmax[k] = vmax;
    }
    if (c.algo == Algo::kLamb) {
      const bool adapt = wd != 0.0;
      const double tr = (adapt && w_sq > 0 && u_sq > 0) ? std::sqrt(w_sq / u_sq) : 1.0;
      for (int64_t k = 0; k < hi - lo; ++k) {
        exp_p[k] = in.p[lo + k] - lr * tr * u[k];
        // The direction is computed from moments rounded to the dtype: a relative error of
        // eps in m and v moves the update by about eps of itself.
        scale[k] = std::fabs(in.p[lo + k]) + std::fabs(lr * tr * u[k]) * 8;
      }
    }
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t k = i - lo;
      const double tol_p = 4 * eps * scale[k] + 1e-30;
      ASSERT_NEAR(Traits::load(p[i]), exp_p[k], tol_p) << "param " << i << " of " << n;
      const bool has_moments = c.algo != Algo::kSgd && c.algo != Algo::kSgdNesterov;
      // exp_avg, or SGD's momentum buffer (which also carries weight_decay * p).
      const double tol_m = 4 * eps * (std::fabs(in.m[i]) + std::fabs(in.g[i] * factor) +
                                      0.1 * std::fabs(in.p[i]) + std::fabs(exp_m[k]));
      ASSERT_NEAR(Traits::load(s0[i]), exp_m[k], tol_m) << "first state buffer, element " << i;
      if (has_moments) {
        const double tol_v = 4 * eps * (std::fabs(in.v[i]) + std::fabs(exp_v[k])) + 1e-30;
        ASSERT_NEAR(Traits::load(s1[i]), exp_v[k], tol_v) << "exp_avg_sq, element " << i;
      }
      if (c.algo == Algo::kAmsgrad) {
        ASSERT_NEAR(Traits::load(s2[i]), exp_vmax[k], 4 * eps * exp_vmax[k])
            << "max_exp_avg_sq, element " << i;
      }
    }
  }
}

class UpdateReference : public testing::TestWithParam<Case> {};

TEST_P(UpdateReference, MatchesFloat64) {
  const Case c = GetParam();
  dispatch_dtype(c.dtype, [&](auto traits) { run<decltype(traits)>(c); });
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Algo a : {Algo::kSgd, Algo::kSgdNesterov, Algo::kAdam, Algo::kAdamW, Algo::kAmsgrad,
                 Algo::kLamb}) {
    for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      for (int64_t n : {1, 3, 8, 113, 278011}) {
        cases.push_back({a, d, n, 3});
      }
    }
  }
  cases.push_back({Algo::kSgd, DType::kFloat32, 113, 1});  // first step: buf = grad
  cases.push_back({Algo::kSgdNesterov, DType::kBFloat16, 113, 1});
  cases.push_back({Algo::kAdam, DType::kFloat32, 113, 1});
  cases.push_back({Algo::kLamb, DType::kFloat16, 113, 1});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AlgosDtypesSizes, UpdateReference, testing::ValuesIn(all_cases()),
                         case_name);

TEST(UpdateReference, SkipFlagLeavesEverythingUntouched) {
  std::vector<float> p = {1.0f, -2.0f, 3.0f}, g = {0.5f, 0.25f, -1.0f}, m = {0.1f, 0.2f, 0.3f},
                     v = {0.4f, 0.5f, 0.6f};
  const auto p0 = p, m0 = m, v0 = v;
  const std::vector<int64_t> offsets = {0, 3}, groups = {0};
  std::vector<int64_t> first;
  const auto chunks = build_chunk_table(offsets.data(), groups.data(), 1, 8, &first);
  std::vector<float> hyper = make_hyper({Algo::kAdam, DType::kFloat32, 3, 2});
  std::vector<float> control(kControlSize, 0.0f);
  control[kGradFactor] = 1.0f;
  control[kSkipUpdate] = 1.0f;
  FlatBuffers b;
  b.param = p.data();
  b.grad = g.data();
  b.state[0] = m.data();
  b.state[1] = v.data();
  const UpdateTables t{chunks.data(), 1, hyper.data(), control.data()};
  adam_update_reference<DTypeTraits<DType::kFloat32>, false>(b, t);
  sgd_update_reference<DTypeTraits<DType::kFloat32>>(b, t);
  EXPECT_EQ(p, p0);
  EXPECT_EQ(m, m0);
  EXPECT_EQ(v, v0);
}

// ------------------------------------------------------------------ chunk table

TEST(ChunkTable, CoversEverySegmentWithoutStraddling) {
  const std::vector<int64_t> offsets = {0, 8, 8, 8200, 8203, 30000};  // an empty tensor too
  const std::vector<int64_t> groups = {0, 0, 1, 1, 2};
  std::vector<int64_t> first;
  const auto table = build_chunk_table(offsets.data(), groups.data(), 5, 4096, &first);
  ASSERT_EQ(first.size(), 6u);
  int64_t covered = 0;
  for (int64_t t = 0; t < 5; ++t) {
    for (int64_t c = first[t]; c < first[t + 1]; ++c) {
      const int64_t* row = &table[c * kChunkColumns];
      EXPECT_EQ(row[kChunkTensor], t);
      EXPECT_EQ(row[kChunkGroup], groups[t]);
      EXPECT_EQ(row[kChunkBegin], offsets[t] + (c - first[t]) * 4096) << "chunk " << c;
      EXPECT_LE(row[kChunkBegin] + row[kChunkCount], offsets[t + 1]);
      EXPECT_GT(row[kChunkCount], 0);
      covered += row[kChunkCount];
    }
  }
  EXPECT_EQ(covered, 30000);
  EXPECT_EQ(first[1] - first[0], 1);  // 8 elements: one chunk
  EXPECT_EQ(first[2] - first[1], 0);  // empty tensor: none
  EXPECT_EQ(first[3] - first[2], 2);  // 8192 elements: two
}

// ------------------------------------------------------------------ step control

class GradStatsReference : public testing::TestWithParam<int64_t> {};

TEST_P(GradStatsReference, SumOfSquaresAndOverflow) {
  const int64_t n = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(n));
  std::normal_distribution<double> normal(0.0, 100.0);
  std::vector<uint16_t> g(n);
  double expected = 0.0;
  const float inv_scale = 1.0f / 1024.0f;
  for (auto& x : g) {
    x = float_to_half(static_cast<float>(normal(rng)));
    const double u = double(half_to_float(x)) * inv_scale;
    expected += u * u;
  }
  std::vector<float> partials(2 * grad_stats_rows(n), -1.0f);
  grad_stats_reference<DTypeTraits<DType::kFloat16>>(g.data(), n, &inv_scale, partials.data());
  double sum = 0.0;
  for (int64_t r = 0; r < grad_stats_rows(n); ++r) {
    sum += partials[2 * r];
    EXPECT_EQ(partials[2 * r + 1], 0.0f);
  }
  EXPECT_NEAR(sum, expected, 1e-6 * expected);
  g[n / 2] = 0x7c00;  // +inf
  grad_stats_reference<DTypeTraits<DType::kFloat16>>(g.data(), n, &inv_scale, partials.data());
  EXPECT_EQ(partials[1], 1.0f);
}

INSTANTIATE_TEST_SUITE_P(Sizes, GradStatsReference, testing::Values(1, 3, 8, 113, 278011),
                         [](const testing::TestParamInfo<int64_t>& info) {
                           return "n" + std::to_string(info.param);
                         });

struct PrepareFixture {
  static constexpr int64_t kGroups = 2, kParams = 3;
  // The values the staging ring fetched for this step (src/capture/slot_ring.h).
  std::vector<float> staged = std::vector<float>(kGroups * kNumStagedHyper, 0.0f);
  std::vector<float> hyper = std::vector<float>(kGroups * kHyperColumns, 0.0f);
  std::vector<float> steps = std::vector<float>(kParams, 0.0f);
  std::vector<int64_t> param_group = {0, 1, 1};
  std::vector<float> control = std::vector<float>(kControlSize, 0.0f);
  std::vector<float> partials = {9.0f, 0.0f, 16.0f, 0.0f};  // norm 5 (before unscaling)
  float inv_scale = 0.5f, found = -1.0f;

  // Stages a step with lr = base + group.
  void stage(float base) {
    for (int64_t g = 0; g < kGroups; ++g) {
      float* row = staged.data() + g * kNumStagedHyper;
      row[kLr] = base + g;
      row[kBeta1] = 0.9f;
      row[kBeta2] = 0.999f;
    }
  }
  PrepareArgs args(bool with_partials, float max_norm) {
    PrepareArgs a;
    a.partials = with_partials ? partials.data() : nullptr;
    a.num_partials = 2;
    a.inv_scale = &inv_scale;
    a.max_norm = max_norm;
    a.skip_nonfinite = true;
    a.found_inf = &found;
    a.staged = staged.data();
    a.hyper = hyper.data();
    a.num_groups = kGroups;
    a.param_steps = steps.data();
    a.param_group = param_group.data();
    a.num_params = kParams;
    a.control = control.data();
    return a;
  }
};

TEST(PrepareStepReference, TakesTheStagedValuesAndCountsSteps) {
  PrepareFixture f;
  for (int64_t seq = 0; seq < 9; ++seq) {
    f.stage(0.1f * (seq + 1));
    prepare_step_reference(f.args(false, 0.0f));
    EXPECT_FLOAT_EQ(f.hyper[kLr], 0.1f * (seq + 1));
    EXPECT_FLOAT_EQ(f.hyper[kHyperColumns + kLr], 0.1f * (seq + 1) + 1);
    EXPECT_EQ(f.hyper[kStep], seq + 1);
    EXPECT_EQ(f.steps[2], seq + 1);
    EXPECT_FLOAT_EQ(f.hyper[kAdamStepSize], static_cast<float>(
        double(f.hyper[kLr]) / (1 - std::pow(double(0.9f), seq + 1.0))));
    EXPECT_TRUE(std::isnan(f.control[kGradNorm]));  // no stats pass: no norm
    EXPECT_EQ(f.control[kGradFactor], 0.5f);         // still unscaled
  }
}

TEST(PrepareStepReference, ClipsAndSkipsOnOverflow) {
  PrepareFixture f;
  f.stage(1.0f);
  prepare_step_reference(f.args(true, 1.0f));
  // Unscaled norm: sqrt(9 + 16) = 5 (the partials hold squares of already-unscaled grads).
  EXPECT_FLOAT_EQ(f.control[kGradNorm], 5.0f);
  EXPECT_FLOAT_EQ(f.control[kGradFactor], 0.5f * (1.0f / (5.0f + 1e-6f)));
  EXPECT_EQ(f.found, 0.0f);
  EXPECT_EQ(f.hyper[kStep], 1.0f);
  f.stage(1.0f);
  f.partials[3] = 1.0f;  // a non-finite gradient in the second block
  prepare_step_reference(f.args(true, 1.0f));
  EXPECT_EQ(f.found, 1.0f);
  EXPECT_EQ(f.control[kSkipUpdate], 1.0f);
  EXPECT_EQ(f.hyper[kStep], 1.0f);  // not counted
  EXPECT_EQ(f.steps[0], 1.0f);
  f.stage(1.0f);
  f.partials[3] = 0.0f;
  prepare_step_reference(f.args(true, 100.0f));  // norm below max_norm: factor is the unscale
  EXPECT_EQ(f.control[kGradFactor], 0.5f);
  EXPECT_EQ(f.control[kSkipUpdate], 0.0f);
  EXPECT_EQ(f.hyper[kStep], 2.0f);
}

}  // namespace
}  // namespace nimble_train::optim
