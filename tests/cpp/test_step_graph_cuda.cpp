// StepGraph on a GPU: several graphs in one pool, each launch reading its own staged values
// while the host runs ahead, rollback of a failed launch, and recovery from a capture that CUDA
// invalidated. Skipped, with the reason, where there is no CUDA GPU.
#include <gtest/gtest.h>

#include "nimble_train/build_config.h"

#if NT_HAVE_CUDA
#include <ATen/ATen.h>
#include <ATen/cuda/MemPool.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <vector>

#include "capture/step_graph.h"
#include "common/check.h"

namespace nimble_train::capture {
namespace {

class StepGraphTest : public testing::Test {
 protected:
  void SetUp() override {
    if (c10::cuda::device_count() == 0) GTEST_SKIP() << "needs a CUDA GPU; none is visible";
  }
  at::Device device{at::kCUDA, 0};
};

LeafSpec leaf(const std::string& path, std::vector<int64_t> sizes) {
  LeafSpec s;
  s.path = path;
  s.sizes = sizes;
  s.strides = at::empty(sizes, at::kMeta).strides().vec();
  s.dtype = at::kFloat;
  s.device = at::Device(at::kCUDA, 0);
  s.batched = true;
  return s;
}

// Captures out = (x * current[1]).sum(1) * (row < current[0]) for `entry` on a side stream.
at::Tensor capture_scaled_sum(StepGraph& g, int64_t entry) {
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  g.begin_capture(entry);
  const at::Tensor x = g.inputs(entry).buffers()[0];
  const at::Tensor rows = at::arange(x.size(0), x.options());
  const at::Tensor out = (x * g.current()[1]).sum(1) * (rows < g.current()[0]);
  const CaptureResult result = g.end_capture();
  EXPECT_TRUE(result.ok) << result.error;
  return out;
}

TEST_F(StepGraphTest, GraphsOfOnePoolReplayTheirOwnStagedValuesWhileTheHostRunsAhead) {
  StepGraph g(device, /*num_values=*/1, /*ring_capacity=*/8);
  const int64_t small = g.add_entry({leaf("batch[0]", {4, 16})});
  const int64_t large = g.add_entry({leaf("batch[0]", {64, 256})});
  const at::Tensor out_small = capture_scaled_sum(g, small);
  const at::Tensor out_large = capture_scaled_sum(g, large);
  EXPECT_GT(g.node_count(small), 1);
  std::vector<at::Tensor> results, inputs;
  std::vector<float> scales;
  for (int i = 0; i < 40; ++i) {  // the sleep lets the host queue several launches ahead
    at::cuda::sleep(20000);
    const bool big = i % 3 == 0;
    const at::Tensor x = at::randn(big ? std::vector<int64_t>{64, 256} : std::vector<int64_t>{
                                             int64_t(1 + i % 4), 16}, at::device(device));
    const float scale = 0.5f + float(i);
    g.launch(big ? large : small, {x}, {scale});
    results.push_back((big ? out_large : out_small).clone());
    inputs.push_back(x);
    scales.push_back(scale);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    const at::Tensor& x = inputs[i];
    at::Tensor expected = at::zeros({results[i].size(0)}, x.options());
    expected.narrow(0, 0, x.size(0)).copy_((x * scales[i]).sum(1));
    EXPECT_TRUE(at::allclose(results[i], expected, 1e-5, 1e-5)) << "launch " << i;
  }
  EXPECT_EQ(g.staging().ring().stale(), 0);
  EXPECT_EQ(g.staging().ring().consumed(), 40);
}

TEST_F(StepGraphTest, EntriesSharingInputsReadTheSameBuffers) {
  StepGraph g(device, 1, 8);
  const int64_t first = g.add_entry({leaf("batch[0]", {8, 4})});
  const int64_t second = g.add_entry_sharing_inputs(first);
  EXPECT_TRUE(g.inputs(second).buffers()[0].is_same(g.inputs(first).buffers()[0]));
  const at::Tensor out_first = capture_scaled_sum(g, first);
  at::Tensor out_second;
  {  // a different graph over the same inputs: x * scale + 1, summed
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    g.begin_capture(second);
    out_second = (g.inputs(second).buffers()[0] * g.current()[1] + 1).sum(1);
    ASSERT_TRUE(g.end_capture().ok);
  }
  const at::Tensor x = at::randn({8, 4}, at::device(device));
  const at::Tensor y = at::randn({5, 4}, at::device(device));
  g.launch(second, {x}, {2.0f});
  EXPECT_TRUE(at::allclose(out_second, (x * 2.0f + 1).sum(1), 1e-5, 1e-5));
  EXPECT_EQ(g.check(second, {y}), 5);  // the shared inputs' checks and padding
  g.launch(first, {y}, {3.0f});
  EXPECT_TRUE(at::allclose(out_first.narrow(0, 0, 5), (y * 3.0f).sum(1), 1e-5, 1e-5));
  EXPECT_THROW(g.add_entry_sharing_inputs(7), InvalidArgument);
}

TEST_F(StepGraphTest, AFailedLaunchGivesItsSlotBack) {
  StepGraph g(device, 1, 4);
  const int64_t e = g.add_entry({leaf("batch[0]", {8, 4})});
  const at::Tensor out = capture_scaled_sum(g, e);
  const at::Tensor x = at::randn({8, 4}, at::device(device));
  for (LaunchFault fault : {LaunchFault::kAfterStaging, LaunchFault::kAfterCopyIn}) {
    g.fail_next_launch(fault);
    EXPECT_THROW(g.launch(e, {x}, {100.0f}), RuntimeFailure);
    EXPECT_EQ(g.staging().ring().pending(), 0);
  }
  EXPECT_THROW(g.launch(e, {at::randn({9, 4}, at::device(device))}, {1.0f}), BatchMismatch);
  g.launch(e, {x}, {2.0f});
  EXPECT_TRUE(at::allclose(out, (x * 2.0f).sum(1), 1e-5, 1e-5));
  EXPECT_EQ(g.staging().ring().stale(), 0);
}

TEST_F(StepGraphTest, ACaptureInvalidatedByAHostSyncIsAbandonedCleanly) {
  StepGraph g(device, 1, 4);
  const int64_t e = g.add_entry({leaf("batch[0]", {8, 4})});
  {
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    g.begin_capture(e);
    (void)at::rand({16}, at::device(device));  // the generator joins the capture
    // A host synchronisation while capturing: CUDA refuses it and invalidates the capture.
    EXPECT_NE(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream()), cudaSuccess);
    const CaptureResult result = g.end_capture();
    EXPECT_FALSE(result.ok);
    EXPECT_TRUE(result.invalidated) << result.error;
  }
  EXPECT_FALSE(g.captured(e));
  // Nothing of the failed capture is left: random numbers work eagerly, a pool can come and go,
  // and the entry captures again.
  const at::Tensor r = at::rand({1024}, at::device(device));
  EXPECT_GT(r.std().item<float>(), 0.1f);
  { at::cuda::MemPool pool; }
  const at::Tensor out = capture_scaled_sum(g, e);
  const at::Tensor x = at::randn({8, 4}, at::device(device));
  g.launch(e, {x}, {3.0f});
  EXPECT_TRUE(at::allclose(out, (x * 3.0f).sum(1), 1e-5, 1e-5));
}

TEST_F(StepGraphTest, CapturesOnlyOnASideStream) {
  StepGraph g(device, 1, 4);
  const int64_t e = g.add_entry({leaf("batch[0]", {8, 4})});
  const c10::cuda::CUDAGuard guard(device);
  EXPECT_THROW(g.begin_capture(e), InvalidArgument);
}

}  // namespace
}  // namespace nimble_train::capture

#else

TEST(StepGraphTest, NeedsCuda) {
  GTEST_SKIP() << "nimble_train was built without CUDA (" NT_CUDA_REASON ")";
}

#endif
