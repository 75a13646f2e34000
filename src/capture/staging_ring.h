// StagingRing: the one host-to-graph staging mechanism of a step, on its device: per launch one
// slot of values (see slot_ring.h), fetched once by the launch's first kernel into `current`,
// the float32 tensor the step's kernels read (learning rates, the valid-sample count, the fused
// optimizer's hyper-parameters are views into it).
//
// On CUDA the slots and the published counters live in mapped pinned memory and fetch()
// enqueues the fetch kernel on the current stream (inside a capture: once per replay). On the
// CPU the same ring runs synchronously: fetch() copies the slot at once.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "capture/slot_ring.h"

namespace nimble_train::capture {

class StagingRing {
 public:
  StagingRing(int64_t num_values, at::Device device, int64_t capacity = 1024);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Host: the next launch's values ([num_values]); returns its sequence number. See SlotRing for
  // back-pressure, the stale-slot check and the timeout.
  int64_t stage(const std::vector<float>& values);
  void restage(const std::vector<float>& values);
  void unstage();
  void launched(int64_t n = 1);

  // Device: copies the oldest unconsumed slot into current() (on the current CUDA stream,
  // capturable; on the CPU at once).
  void fetch();

  const at::Tensor& current() const { return current_; }  // [num_values] float32
  at::Device device() const { return current_.device(); }
  const SlotRing& ring() const { return *ring_; }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 private:
  struct HostMemory;
  void check_size(const std::vector<float>& values, const char* op) const;

  std::unique_ptr<HostMemory> memory_;
  std::unique_ptr<SlotRing> ring_;
  at::Tensor current_;        // [num_values] float32 on the device
  at::Tensor device_counts_;  // CUDA: [2] int64, launches fetched and stale slots seen
  std::chrono::milliseconds timeout_{std::chrono::seconds(60)};
};

}  // namespace nimble_train::capture
