// Tensor-level entry points of src/capture (see boundary.h).
#include "capture/boundary.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "common/check.h"
#include "nimble_train/build_config.h"

#if NT_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "capture/scalar_ring.h"
#include "common/cuda_check.h"
#endif

namespace nimble_train::capture {

#if NT_HAVE_CUDA

DeviceScalars::DeviceScalars(int64_t num_scalars, at::Device device, int64_t capacity) {
  NT_CHECK(device.is_cuda(), "DeviceScalars live on a CUDA device; got ", device);
  NT_CHECK(num_scalars >= 1 && num_scalars <= (1 << 20),
           "DeviceScalars needs 1 to 2^20 scalars; got ", num_scalars);
  NT_CHECK(capacity >= 2 && capacity <= (1 << 20),
           "DeviceScalars needs 2 to 2^20 ring slots; got ", capacity);
  const c10::cuda::CUDAGuard guard(device);
  ring_ = std::make_unique<ScalarRing>(static_cast<int>(num_scalars), static_cast<int>(capacity));
  values_ = at::zeros({num_scalars}, at::TensorOptions().dtype(at::kFloat).device(device));
  counter_ = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device));
}

DeviceScalars::~DeviceScalars() = default;

void DeviceScalars::stage(const std::vector<double>& values) {
  NT_CHECK(static_cast<int64_t>(values.size()) == ring_->num_scalars(), "DeviceScalars.stage: ",
           "expected ", ring_->num_scalars(), " values; got ", values.size());
  std::vector<float> as_float(values.begin(), values.end());
  ring_->stage(as_float.data());
}

void DeviceScalars::unstage() { ring_->unstage(); }

void DeviceScalars::fetch() {
  const c10::cuda::CUDAGuard guard(values_.device());
  ring_->fetch(values_.data_ptr<float>(), counter_.data_ptr<int64_t>(),
               c10::cuda::getCurrentCUDAStream());
}

int64_t DeviceScalars::staged() const { return ring_->staged(); }
int64_t DeviceScalars::consumed() const { return ring_->consumed(); }

int64_t graph_node_count(uintptr_t graph) {
  NT_CHECK(graph != 0, "graph_node_count: the graph handle is null (was the graph kept?)");
  size_t count = 0;
  NT_CHECK_CUDA(cudaGraphGetNodes(reinterpret_cast<cudaGraph_t>(graph), nullptr, &count));
  return static_cast<int64_t>(count);
}

#else  // CPU-only build

// No ring is ever made without CUDA; an empty definition completes the type for unique_ptr.
class ScalarRing {};

namespace {
[[noreturn]] void no_cuda(const char* what) {
  NT_FAIL(what, " needs CUDA, but nimble_train was built without it (", NT_CUDA_REASON,
          "). Rebuild it: pip install --no-build-isolation -e .");
}
}  // namespace

DeviceScalars::DeviceScalars(int64_t, at::Device, int64_t) { no_cuda("DeviceScalars"); }
DeviceScalars::~DeviceScalars() = default;
void DeviceScalars::stage(const std::vector<double>&) { no_cuda("DeviceScalars.stage"); }
void DeviceScalars::unstage() { no_cuda("DeviceScalars.unstage"); }
void DeviceScalars::fetch() { no_cuda("DeviceScalars.fetch"); }
int64_t DeviceScalars::staged() const { return 0; }
int64_t DeviceScalars::consumed() const { return 0; }
int64_t graph_node_count(uintptr_t) { no_cuda("graph_node_count"); }

#endif

}  // namespace nimble_train::capture
