// Host-written scalars (learning rates, the valid-sample count) that a captured CUDA graph reads
// afresh on every replay, without recapture and without a host sync.
//
// The CPU runs ahead of the GPU: when the host writes the values for launch n, launches n - 1,
// n - 2, ... may not have run yet, so one fixed pinned buffer would hand them the values of a
// later step. The values therefore go into a ring of `capacity` slots in mapped pinned memory:
// the host writes launch n's values into slot n % capacity, and the graph's first kernel copies
// slot (counter % capacity) into device memory, where the step's kernels read them, and
// advances the device-side counter. Host and device count launches alike, so they agree on
// the slot; the kernel also publishes the count to host memory, so the host overwrites a slot
// only after the launch that used it has read it. With 1024 slots the host waits only when it
// is 1024 launches ahead of the GPU (more than CUDA lets it queue).
#pragma once

#include <chrono>
#include <cstdint>

#include "common/cuda_fwd.h"

namespace nimble_train::capture {

class ScalarRing {
 public:
  // num_scalars floats per slot, `capacity` slots. Allocates mapped pinned host memory.
  ScalarRing(int num_scalars, int capacity);
  ~ScalarRing();
  ScalarRing(const ScalarRing&) = delete;
  ScalarRing& operator=(const ScalarRing&) = delete;

  // Host side: writes the values of the next launch (values: [num_scalars]). Waits, without a
  // CUDA call, while the GPU is `capacity` launches behind; throws after `timeout`.
  void stage(const float* values, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // Takes back the last stage() when the launch it was for did not happen.
  void unstage();

  // Device side: enqueues the kernel that copies the current slot into `current`
  // ([num_scalars] floats, device memory) and advances `counter` (one int64 in device memory,
  // zero before the first fetch). Captured into a graph, it runs once per replay.
  void fetch(float* current, int64_t* counter, cudaStream_t stream) const;

  int num_scalars() const { return num_scalars_; }
  int capacity() const { return capacity_; }
  int64_t staged() const { return staged_; }
  int64_t consumed() const;  // launches whose fetch has run, as last published by the GPU

 private:
  int num_scalars_;
  int capacity_;
  int64_t staged_ = 0;
  float* slots_ = nullptr;            // [capacity][num_scalars], mapped pinned host memory
  int64_t* consumed_host_ = nullptr;  // one int64, mapped pinned host memory, written by the GPU
};

}  // namespace nimble_train::capture
