// TorchGraph: finishing and abandoning captures (see torch_graph.h).
#include "capture/torch_graph.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "capture/graph_nodes.h"
#include "common/cuda_check.h"

namespace nimble_train::capture {
namespace {

// A capture's epilogue is the only exported way to end a generator's capture state (its
// methods are not exported from libtorch_cuda): a trivial capture, begun and ended, runs it.
void run_generator_epilogue(c10::DeviceIndex device) {
  const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool(false, device));
  at::cuda::CUDAGraph graph;
  graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
  at::empty({1}, at::TensorOptions().device(at::kCUDA, device)).zero_();
  graph.capture_end();
}

}  // namespace

TorchGraph::TorchGraph() : at::cuda::CUDAGraph(/*keep_graph=*/true) {}

int64_t TorchGraph::finish(bool memsets_as_kernels, bool fail_before_instantiate) {
  capture_end();
  size_t nodes = 0;
  NT_CHECK_CUDA(cudaGraphGetNodes(raw_cuda_graph(), nullptr, &nodes));
  if (memsets_as_kernels) memset_nodes_ = capture::memsets_as_kernels(raw_cuda_graph(),
                                                                      capture_dev_);
  if (fail_before_instantiate) {
    NT_FAIL("injected failure after the memset rewrite, before instantiation (a rollback test)");
  }
  instantiate();
  return static_cast<int64_t>(nodes);
}

bool TorchGraph::invalidated() const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(capture_stream_.stream(), &status) == cudaSuccess &&
         status == cudaStreamCaptureStatusInvalidated;
}

unsigned long long TorchGraph::capture_id() const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (cudaStreamGetCaptureInfo(capture_stream_.stream(), &status, &id) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return status == cudaStreamCaptureStatusActive ? id : 0;
}

template <typename Self>
bool TorchGraph::undo_failed_end(Self& self) noexcept {
  if constexpr (requires(Self& g) { g.capturing_to_pool_; }) {
    return false;  // this torch's reset() ends the pool routing and releases the pool itself
  } else {
    // capture_end stopped at cudaStreamEndCapture. Ending the routing succeeds only when it
    // is still on, and only then does the capture's reference to the pool need releasing.
    try {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(self.capture_dev_, self.mempool_id_);
      c10::cuda::CUDACachingAllocator::releasePool(self.capture_dev_, self.mempool_id_);
    } catch (const std::exception&) {
    }
    try {
      at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(self.mempool_id_);
      at::getHostAllocator(at::kCUDA)->release_pool(self.mempool_id_);
    } catch (const std::exception&) {
    }
    bool generator_capturing = false;
    for (auto& entry : self.captured_generator_states_) {
      generator_capturing = generator_capturing || entry.first->capturing_;
    }
    return generator_capturing;
  }
}

bool TorchGraph::abandon() noexcept {
  bool invalidated = false;
  try {
    const c10::cuda::CUDAStreamGuard guard(capture_stream_);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(capture_stream_.stream(), &status) == cudaSuccess) {
      invalidated = status == cudaStreamCaptureStatusInvalidated;
      if (status != cudaStreamCaptureStatusNone) {
        try {
          capture_end();  // ends the capture, whatever its state, with torch's own bookkeeping
        } catch (const std::exception&) {
        }
      }
    }
    const bool generator_capturing = !capture_ended_ && undo_failed_end(*this);
    const c10::DeviceIndex device = capture_dev_;
    reset();
    if (generator_capturing) run_generator_epilogue(device);
  } catch (const std::exception&) {
  }
  (void)cudaGetLastError();  // the failed calls' error must not be reported by a later launch
  return invalidated;
}

}  // namespace nimble_train::capture
