// The runtime library on the CPU: StaticInputs (checks, messages, copy-in of short batches) and
// the StagingRing's CPU path (the same protocol as on CUDA, fetched at once).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "capture/static_inputs.h"
#include "capture/staging_ring.h"
#include "common/check.h"

namespace nimble_train::capture {
namespace {

LeafSpec spec(const std::string& path, std::vector<int64_t> sizes, at::ScalarType dtype,
              bool batched) {
  LeafSpec s;
  s.path = path;
  s.sizes = sizes;
  s.strides = at::empty(sizes, at::kMeta).strides().vec();
  s.dtype = dtype;
  s.batched = batched;
  return s;
}

// (images [8, 3, 4, 4], labels [8]) and a non-batched [5] side input.
StaticInputs image_inputs() {
  return StaticInputs({spec("batch[0][0]", {8, 3, 4, 4}, at::kFloat, true),
                       spec("batch[0][1]", {5}, at::kFloat, false),
                       spec("batch[1]", {8}, at::kLong, true)});
}

std::string mismatch_of(const StaticInputs& inputs, const std::vector<at::Tensor>& leaves) {
  try {
    inputs.check(leaves);
  } catch (const BatchMismatch& e) {
    return e.what();
  }
  return "";
}

TEST(StaticInputs, CountsSamplesOfFullAndShortBatches) {
  const StaticInputs inputs = image_inputs();
  EXPECT_EQ(inputs.batch_size(), 8);
  EXPECT_EQ(inputs.check({at::randn({8, 3, 4, 4}), at::randn({5}), at::zeros({8}, at::kLong)}), 8);
  EXPECT_EQ(inputs.check({at::randn({3, 3, 4, 4}), at::randn({5}), at::zeros({3}, at::kLong)}), 3);
}

TEST(StaticInputs, MessagesSayWhatWasExpectedWhatWasSeenAndTheFix) {
  const StaticInputs inputs = image_inputs();
  const at::Tensor side = at::randn({5});
  const at::Tensor labels = at::zeros({8}, at::kLong);
  std::string m = mismatch_of(inputs, {at::randn({8, 3, 4, 4}, at::kDouble), side, labels});
  EXPECT_NE(m.find("batch[0][0] must be a tensor of shape (N<=8, 3, 4, 4), torch.float32, on cpu;"
                   " got a tensor of shape (8, 3, 4, 4), torch.float64, on cpu."),
            std::string::npos) << m;
  EXPECT_NE(m.find("pad or bucket inputs"), std::string::npos) << m;
  m = mismatch_of(inputs, {at::randn({16, 3, 4, 4}), side, at::zeros({16}, at::kLong)});
  EXPECT_NE(m.find("16 samples, more than the 8 of the first batch"), std::string::npos) << m;
  m = mismatch_of(inputs, {at::randn({8, 3, 4, 4}), side, at::zeros({4}, at::kLong)});
  EXPECT_NE(m.find("batch[1] has 4 samples but an earlier entry of the batch has 8"),
            std::string::npos) << m;
  m = mismatch_of(inputs, {at::randn({8, 3, 4, 4}), at::randn({6}), labels});
  EXPECT_NE(m.find("batch[0][1] must be a tensor of shape (5), torch.float32"), std::string::npos)
      << m;
  m = mismatch_of(inputs, {at::randn({8, 3, 5, 4}), side, labels});
  EXPECT_NE(m.find("got a tensor of shape (8, 3, 5, 4)"), std::string::npos) << m;
  m = mismatch_of(inputs, {at::randn({0, 3, 4, 4}), side, at::zeros({0}, at::kLong)});
  EXPECT_NE(m.find("got a tensor of shape (0, 3, 4, 4)"), std::string::npos) << m;
  m = mismatch_of(inputs, {at::randn({8, 3, 4, 4}), side, at::zeros({8}, at::kInt)});
  EXPECT_NE(m.find("got a tensor of shape (8,), torch.int32"), std::string::npos) << m;
  EXPECT_THROW(inputs.check({at::randn({8, 3, 4, 4})}), InvalidArgument);  // a leaf missing
}

TEST(StaticInputs, AShortBatchFillsTheLeadingRowsAndKeepsTheRest) {
  StaticInputs inputs = image_inputs();
  const at::Tensor x = at::randn({8, 3, 4, 4}), side = at::randn({5});
  const at::Tensor y = at::arange(8, at::kLong);
  inputs.copy_in({x, side, y}, 8);
  const at::Tensor short_x = at::randn({3, 3, 4, 4});
  const at::Tensor short_y = at::arange(100, 103, at::kLong);
  inputs.copy_in({short_x, side, short_y}, 3);
  const auto& b = inputs.buffers();
  EXPECT_TRUE(at::equal(b[0].narrow(0, 0, 3), short_x));
  EXPECT_TRUE(at::equal(b[0].narrow(0, 3, 5), x.narrow(0, 3, 5)));  // an earlier batch's rows
  EXPECT_TRUE(at::equal(b[2].narrow(0, 0, 3), short_y));
  EXPECT_TRUE(at::equal(b[1], side));
}

TEST(StaticInputs, TheFirstShortBatchPadsWithItsFirstSample) {
  StaticInputs inputs = image_inputs();
  const at::Tensor x = at::randn({2, 3, 4, 4});
  inputs.copy_in({x, at::randn({5}), at::arange(2, at::kLong)}, 2, /*fill_padding=*/true);
  const at::Tensor rows = inputs.buffers()[0];
  for (int64_t i = 2; i < 8; ++i) EXPECT_TRUE(at::equal(rows[i], x[0])) << i;
}

TEST(StaticInputs, KeepsTheFirstBatchsLayout) {
  LeafSpec s = spec("batch[0]", {4, 3, 5, 5}, at::kFloat, true);
  s.strides = at::empty({4, 3, 5, 5}).contiguous(at::MemoryFormat::ChannelsLast).strides().vec();
  StaticInputs inputs({s});
  EXPECT_TRUE(inputs.buffers()[0].is_contiguous(at::MemoryFormat::ChannelsLast));
  const at::Tensor x = at::randn({4, 3, 5, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  inputs.copy_in({x}, 4);
  EXPECT_TRUE(at::equal(inputs.buffers()[0], x));
  const at::Tensor plain = at::randn({2, 3, 5, 5});  // another layout still copies by value
  inputs.copy_in({plain}, 2);
  EXPECT_TRUE(at::equal(inputs.buffers()[0].narrow(0, 0, 2), plain));
}

TEST(StaticInputs, NamesDtypesAsPythonPrintsThem) {
  EXPECT_EQ(torch_dtype_name(at::kFloat), "torch.float32");
  EXPECT_EQ(torch_dtype_name(at::kBFloat16), "torch.bfloat16");
  EXPECT_EQ(torch_dtype_name(at::kLong), "torch.int64");
  EXPECT_EQ(torch_dtype_name(at::kBool), "torch.bool");
}

// A shape bucket: ids and labels [4, 8] that may be shorter along dimension 1 (labels padded
// with -100), and per-sample scores [4] that do not vary.
StaticInputs bucket_inputs() {
  LeafSpec ids = spec("batch['ids']", {4, 8}, at::kLong, true);
  LeafSpec labels = spec("batch['labels']", {4, 8}, at::kLong, true);
  ids.vary_dim = labels.vary_dim = 1;
  labels.pad_value = -100;
  return StaticInputs({ids, labels, spec("batch['score']", {4}, at::kFloat, true)});
}

TEST(StaticInputs, ABucketTakesAnyLengthUpToItsOwn) {
  const StaticInputs inputs = bucket_inputs();
  EXPECT_EQ(inputs.check({at::ones({4, 3}, at::kLong), at::ones({4, 3}, at::kLong),
                          at::ones({4})}), 4);
  EXPECT_EQ(inputs.check({at::ones({2, 8}, at::kLong), at::ones({2, 8}, at::kLong),
                          at::ones({2})}), 2);
  EXPECT_EQ(mismatch_of(inputs, {at::ones({4, 9}, at::kLong), at::ones({4, 9}, at::kLong),
                                 at::ones({4})}),
            "batch['ids'] has length 9 along dimension 1; this bucket holds 1 to 8 (got a tensor "
            "of shape (4, 9), torch.int64, on cpu).");
  EXPECT_EQ(mismatch_of(inputs, {at::ones({4, 3}, at::kLong), at::ones({4, 5}, at::kLong),
                                 at::ones({4})}),
            "batch['labels'] has length 5 along dimension 1 but batch['ids'] has 3; every entry "
            "that varies along dimension 1 must have the same length (pad them together).");
  EXPECT_NE(mismatch_of(inputs, {at::ones({4}, at::kLong), at::ones({4, 5}, at::kLong),
                                 at::ones({4})}).find("must be a tensor of shape (N<=4, L<=8)"),
            std::string::npos);
}

TEST(StaticInputs, AShorterBatchIsPaddedWithEachLeafsPadValue) {
  StaticInputs inputs = bucket_inputs();
  const at::Tensor ids = at::arange(1, 13, at::kLong).view({4, 3});
  inputs.copy_in({ids, ids + 100, at::ones({4})}, 4);
  const auto& buffers = inputs.buffers();
  EXPECT_TRUE(buffers[0].narrow(1, 0, 3).equal(ids));
  EXPECT_TRUE(buffers[0].narrow(1, 3, 5).eq(0).all().item<bool>());
  EXPECT_TRUE(buffers[1].narrow(1, 0, 3).equal(ids + 100));
  EXPECT_TRUE(buffers[1].narrow(1, 3, 5).eq(-100).all().item<bool>());
  // A short batch of another length: its rows padded, the other rows as they were.
  inputs.copy_in({ids.narrow(0, 0, 2).narrow(1, 0, 2), ids.narrow(0, 0, 2).narrow(1, 0, 2),
                  at::zeros({2})}, 2);
  EXPECT_TRUE(buffers[1].narrow(0, 0, 2).narrow(1, 2, 6).eq(-100).all().item<bool>());
  EXPECT_TRUE(buffers[0].narrow(0, 2, 2).narrow(1, 0, 3).equal(ids.narrow(0, 2, 2)));
}

TEST(StaticInputs, RefusesAVaryingDimensionALeafLacks) {
  LeafSpec ids = spec("batch['ids']", {4, 8}, at::kLong, true);
  ids.vary_dim = 2;
  EXPECT_THROW(StaticInputs({ids}), std::exception);
}

TEST(StagingRingCpu, FetchesEachLaunchsValuesAndRollsBack) {
  StagingRing ring(3, at::Device(at::kCPU), 4);
  for (int64_t launch = 0; launch < 9; ++launch) {
    ring.stage({-1.0f, -2.0f, -3.0f});
    ring.unstage();  // a call that failed after staging
    const std::vector<float> v = {float(launch), 0.5f, float(2 * launch)};
    EXPECT_EQ(ring.stage(v), launch);
    ring.launched();
    ring.fetch();
    EXPECT_TRUE(at::equal(ring.current(), at::tensor(v))) << launch;
  }
  EXPECT_EQ(ring.ring().stale(), 0);
  EXPECT_EQ(ring.ring().consumed(), 9);
  EXPECT_THROW(ring.stage({1.0f}), InvalidArgument);  // three values per slot
}

}  // namespace
}  // namespace nimble_train::capture
