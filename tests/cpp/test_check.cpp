// NT_CHECK: passes silently, or throws InvalidArgument naming the place and the values seen.
#include <gtest/gtest.h>

#include <string>

#include "common/check.h"

namespace nimble_train {
namespace {

int checked_offset(int offset) {
  NT_CHECK(offset % 16 == 0, "bucket 3 must be 16-byte aligned; got offset ", offset);
  return offset;
}

TEST(Check, PassesWhenConditionHolds) { EXPECT_EQ(checked_offset(1024), 1024); }

TEST(Check, ThrowsInvalidArgumentWithValuesAndPlace) {
  try {
    checked_offset(1030);
    FAIL() << "NT_CHECK did not throw";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("bucket 3 must be 16-byte aligned; got offset 1030"), std::string::npos)
        << what;
    EXPECT_NE(what.find("checked_offset"), std::string::npos) << what;
    // The place is given relative to the project, never as the build machine's absolute path.
    EXPECT_NE(what.find("[tests/cpp/test_check.cpp:"), std::string::npos) << what;
  }
}

TEST(Check, InvalidArgumentIsAStdInvalidArgument) {
  EXPECT_THROW(checked_offset(7), std::invalid_argument);
}

TEST(Check, FailThrowsRuntimeFailure) {
  EXPECT_THROW(NT_FAIL("ncclAllReduce failed: ", "unhandled system error"), RuntimeFailure);
}

}  // namespace
}  // namespace nimble_train
