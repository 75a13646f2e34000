// TorchGraph: torch's CUDA graph, and the one place that knows what a failed capture leaves
// behind in it.
//
// at::cuda::CUDAGraph is used, not raw cudaStreamBeginCapture: its capture keeps the caching
// allocator's private pool and the CUDA generator's graph-safe RNG state right (dropout draws
// fresh masks at every replay). But a capture that fails inside cudaStreamEndCapture (CUDA
// invalidated it: a host sync, a synchronous copy) stops torch's capture_end before its
// bookkeeping, and the torch releases differ in what reset() then undoes: newer ones track
// the pool routing themselves (the `capturing_to_pool_` member), older ones (2.11) leave the
// allocator routing this thread's allocations to the pool (a later MemPool destruction then
// aborts the process on an internal assert), the pool referenced forever, and the generator
// believing it is still capturing (every later dropout then fails with "Offset increment
// outside graph capture"). abandon() undoes that whichever torch it runs with.
#pragma once

#include <ATen/cuda/CUDAGraph.h>

#include <cstdint>

namespace nimble_train::capture {

class TorchGraph : public at::cuda::CUDAGraph {
 public:
  TorchGraph();  // keeps the cudaGraph_t until instantiation, so its nodes can be counted

  // Ends the capture and instantiates the graph; returns its node count. memsets_as_kernels:
  // first rewrites its memset nodes as kernel nodes (graph_nodes.h; memset_nodes() says how
  // many). Throws when CUDA refuses the capture or an edit (fail_before_instantiate: throws
  // there, for the rollback tests); call abandon() then.
  int64_t finish(bool memsets_as_kernels = true, bool fail_before_instantiate = false);

  int64_t memset_nodes() const { return memset_nodes_; }

  // Whether CUDA has invalidated the capture under way (a call it forbids while capturing ran).
  bool invalidated() const;

  // CUDA's id of the capture under way (0: none is), which every stream taking part reports.
  unsigned long long capture_id() const;

  // After a failure anywhere between capture_begin() and finish(): ends the stream's capture
  // if it is still open, undoes what the capture set up in the allocator and the generator, and
  // drops what was captured. Returns whether CUDA had invalidated the capture (the mechanism
  // by which a host synchronisation inside a capture fails). Never throws.
  bool abandon() noexcept;

 private:
  int64_t memset_nodes_ = 0;  // memset nodes finish() rewrote as kernels

  // Returns whether the CUDA generator still believes it is capturing.
  template <typename Self>
  static bool undo_failed_end(Self& self) noexcept;
};

}  // namespace nimble_train::capture
