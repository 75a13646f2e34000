// StagingRing: host memory, the fetch on each device, and the checks (see staging_ring.h).
#include "capture/staging_ring.h"

#include <ATen/ops/zeros.h>

#include <cstring>

#include "common/check.h"
#include "nimble_train/build_config.h"

#if NT_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "capture/fetch.h"
#include "common/cuda_check.h"
#endif

namespace nimble_train::capture {

// The slots and the published counters: mapped pinned memory on CUDA (the fetch kernel reads
// and writes it across the bus), plain memory on the CPU.
struct StagingRing::HostMemory {
  std::byte* slots = nullptr;
  RingCounters* counters = nullptr;
  bool pinned = false;

  HostMemory(int64_t bytes, bool cuda) : pinned(cuda) {
#if NT_HAVE_CUDA
    if (cuda) {
      NT_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&slots), size_t(bytes),
                                  cudaHostAllocMapped | cudaHostAllocPortable));
      if (cudaHostAlloc(reinterpret_cast<void**>(&counters), sizeof(RingCounters),
                        cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
        cudaFreeHost(slots);
        NT_FAIL("StagingRing: cudaHostAlloc of ", sizeof(RingCounters), " bytes failed");
      }
    }
#endif
    if (!cuda) {
      slots = new std::byte[size_t(bytes)];  // 16-byte aligned, as operator new guarantees
      counters = new RingCounters;
    }
    std::memset(slots, 0, size_t(bytes));
    std::memset(counters, 0, sizeof(RingCounters));
  }

  ~HostMemory() {
    // Destructors must not throw; a failure here only leaks pinned memory.
#if NT_HAVE_CUDA
    if (pinned) {
      cudaFreeHost(slots);
      cudaFreeHost(counters);
      return;
    }
#endif
    delete[] slots;
    delete counters;
  }
};

StagingRing::StagingRing(int64_t num_values, at::Device device, int64_t capacity) {
  NT_CHECK(num_values >= 1 && num_values <= (int64_t(1) << 20),
           "StagingRing needs 1 to 2^20 values per slot; got ", num_values);
  NT_CHECK(capacity >= 2 && capacity <= (int64_t(1) << 20),
           "StagingRing needs 2 to 2^20 slots; got ", capacity);
  NT_CHECK(device.is_cuda() || device.is_cpu(), "StagingRing lives on a CPU or CUDA device; got ",
           device);
#if !NT_HAVE_CUDA
  NT_CHECK(!device.is_cuda(), "StagingRing on ", device, " needs CUDA, but nimble_train was "
           "built without it (", NT_CUDA_REASON, "). Rebuild it: pip install "
           "--no-build-isolation -e .");
#endif
  memory_ = std::make_unique<HostMemory>(capacity * slot_bytes(num_values), device.is_cuda());
  ring_ = std::make_unique<SlotRing>(memory_->slots, num_values, capacity, memory_->counters);
  const auto options = at::TensorOptions().device(device);
  current_ = at::zeros({num_values}, options.dtype(at::kFloat));
  if (device.is_cuda()) device_counts_ = at::zeros({2}, options.dtype(at::kLong));
}

StagingRing::~StagingRing() = default;

void StagingRing::check_size(const std::vector<float>& values, const char* op) const {
  NT_CHECK(static_cast<int64_t>(values.size()) == ring_->num_values(), "StagingRing.", op,
           ": expected ", ring_->num_values(), " values; got ", values.size());
}

int64_t StagingRing::stage(const std::vector<float>& values) {
  check_size(values, "stage");
  return ring_->stage(values.data(), timeout_);
}

void StagingRing::restage(const std::vector<float>& values) {
  check_size(values, "restage");
  ring_->restage(values.data());
}

void StagingRing::unstage() { ring_->unstage(); }

void StagingRing::launched(int64_t n) { ring_->launched(n); }

void StagingRing::fetch() {
  if (current_.is_cpu()) {
    fetch_slot_reference(memory_->slots, ring_->num_values(), ring_->capacity(),
                         current_.data_ptr<float>(), memory_->counters);
    return;
  }
#if NT_HAVE_CUDA
  const c10::cuda::CUDAGuard guard(current_.device());
  FetchArgs args;
  args.slots = memory_->slots;
  args.num_values = ring_->num_values();
  args.capacity = ring_->capacity();
  args.current = current_.data_ptr<float>();
  args.device_counts = device_counts_.data_ptr<int64_t>();
  args.published = memory_->counters;
  fetch_slot_cuda(args, c10::cuda::getCurrentCUDAStream());
#endif
}

}  // namespace nimble_train::capture
