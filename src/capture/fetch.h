// The fetch: the first kernel of every launch of a captured step, which copies the launch's
// staging slot into device memory (see slot_ring.h for the ring and its protocol).
#pragma once

#include <cstddef>
#include <cstdint>

#include "capture/slot_ring.h"
#include "common/cuda_fwd.h"

namespace nimble_train::capture {

struct FetchArgs {
  const std::byte* slots = nullptr;  // [capacity][slot_bytes(num_values)] mapped pinned memory
  int64_t num_values = 0;
  int64_t capacity = 0;
  float* current = nullptr;          // [num_values] device memory: this launch's values
  int64_t* device_counts = nullptr;  // [2] device memory: launches fetched, stale slots seen
  RingCounters* published = nullptr;  // mapped pinned memory: the counts, for the host
};

// One block; follows fetch_slot_reference. Captured into a graph, it runs once per replay.
void fetch_slot_cuda(const FetchArgs& args, cudaStream_t stream);

}  // namespace nimble_train::capture
