// flat_scale_reference against a float64 computation, on awkward sizes and fresh random data.
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "optim/flat_scale.h"

namespace nimble_train::optim {
namespace {

struct Case {
  int64_t size;
  bool is_double;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << (c.is_double ? "float64" : "float32") << " x " << c.size;
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return (info.param.is_double ? "float64_n" : "float32_n") + std::to_string(info.param.size);
}

class FlatScaleReference : public testing::TestWithParam<Case> {};

template <typename T>
void check(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::vector<T> x(n);
  for (auto& v : x) v = static_cast<T>(normal(rng));
  const float scale = static_cast<float>(std::uniform_real_distribution<double>(0.1, 4.0)(rng));
  const std::vector<T> before = x;

  flat_scale_reference(x.data(), n, scale);

  // The product of two floats is exact in double (24 + 24 significant bits < 53), so rounding
  // the double product to float is the correctly rounded result: equality must be bitwise. For
  // double inputs the reference multiplies in double, which is what the check computes too.
  for (int64_t i = 0; i < n; ++i) {
    const T expected = static_cast<T>(static_cast<double>(before[i]) * static_cast<double>(scale));
    ASSERT_EQ(x[i], expected) << "element " << i << " of " << n << ", scale " << scale;
  }
}

TEST_P(FlatScaleReference, MatchesFloat64) {
  const Case c = GetParam();
  const auto seed = static_cast<uint32_t>(c.size * 2 + c.is_double);
  if (c.is_double) {
    check<double>(c.size, seed);
  } else {
    check<float>(c.size, seed);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, FlatScaleReference,
    testing::Values(Case{1, false}, Case{3, false}, Case{8, false}, Case{113, false},
                    Case{278011, false}, Case{1, true}, Case{113, true}, Case{278011, true}),
    case_name);

}  // namespace
}  // namespace nimble_train::optim
