// ScalarRing: the fetch kernel and the host side (see scalar_ring.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "capture/scalar_ring.h"
#include "common/cuda_check.h"

namespace nimble_train::capture {
namespace {

__global__ void fetch_scalars_kernel(const float* __restrict__ slots, int num_scalars,
                                     int capacity, float* __restrict__ current,
                                     int64_t* __restrict__ counter,
                                     int64_t* __restrict__ consumed_host) {
  const int64_t launch = *counter;
  const float* slot = slots + (launch % capacity) * num_scalars;
  for (int i = threadIdx.x; i < num_scalars; i += blockDim.x) current[i] = slot[i];
  __syncthreads();  // every thread has read `launch` before it moves on
  if (threadIdx.x == 0) {
    *counter = launch + 1;
    *reinterpret_cast<volatile int64_t*>(consumed_host) = launch + 1;
    __threadfence_system();
  }
}

}  // namespace

ScalarRing::ScalarRing(int num_scalars, int capacity)
    : num_scalars_(num_scalars), capacity_(capacity) {
  NT_CHECK(num_scalars >= 1, "ScalarRing needs at least one scalar per slot; got ", num_scalars);
  NT_CHECK(capacity >= 2, "ScalarRing needs at least two slots; got ", capacity);
  const size_t bytes = sizeof(float) * size_t(num_scalars) * size_t(capacity);
  NT_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&slots_), bytes,
                              cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(slots_, 0, bytes);
  if (cudaHostAlloc(reinterpret_cast<void**>(&consumed_host_), sizeof(int64_t),
                    cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    cudaFreeHost(slots_);
    NT_FAIL("ScalarRing: cudaHostAlloc of the consumed counter failed");
  }
  *consumed_host_ = 0;
}

ScalarRing::~ScalarRing() {
  // Destructors must not throw; a failure here only leaks pinned memory.
  cudaFreeHost(slots_);
  cudaFreeHost(consumed_host_);
}

int64_t ScalarRing::consumed() const {
  return *reinterpret_cast<volatile const int64_t*>(consumed_host_);
}

void ScalarRing::stage(const float* values, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (staged_ - consumed() >= capacity_) {
    NT_CHECK(std::chrono::steady_clock::now() < deadline,
             "ScalarRing: the GPU has not started any of the last ", capacity_,
             " graph launches within ", timeout.count(), " ms (consumed ", consumed(),
             ", staged ", staged_, "); is the device hung?");
    std::this_thread::yield();
  }
  std::memcpy(slots_ + (staged_ % capacity_) * num_scalars_, values,
              sizeof(float) * size_t(num_scalars_));
  ++staged_;
}

void ScalarRing::unstage() {
  NT_CHECK(staged_ > consumed(), "ScalarRing::unstage: nothing staged is left unconsumed");
  --staged_;
}

void ScalarRing::fetch(float* current, int64_t* counter, cudaStream_t stream) const {
  // With unified addressing a mapped host pointer is valid on the device as it is.
  const int threads = std::min(256, ((num_scalars_ + 31) / 32) * 32);
  fetch_scalars_kernel<<<1, threads, 0, stream>>>(slots_, num_scalars_, capacity_, current,
                                                  counter, consumed_host_);
  NT_CHECK_LAUNCH();
}

}  // namespace nimble_train::capture
