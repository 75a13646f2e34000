// StepGraph: a training step's CUDA graphs, the one private memory pool they share, their
// static inputs, and the one staging ring every launch reads.
//
// A Step holds several graphs over time (a graph per shape bucket, an evaluation graph, the
// micro-batch and update graphs of gradient accumulation); each is an entry with its own static
// inputs. All are captured, one after another, into one private pool: a later capture reuses
// the memory an earlier one freed (its intermediates), so the pool holds about the largest
// graph's working memory, not the sum. That is safe because the graphs never run concurrently
// (one stream) and none reads another's intermediates; what must survive a replay (the loss,
// gradients of optimizers captured as they are) stays allocated and is never reused.
//
// Every launch reads its values from the staging ring (see slot_ring.h): value 0 of each slot
// is the launch's valid-sample count, which launch() computes from the batch; the caller's
// values follow. begin_capture() puts the fetch at the top of the graph, so each replay
// fetches its slot once, before any kernel of the step reads current().
//
// launch() is the whole replay path: check the batch, stage its values, copy it in, replay.
// If any part after the staging fails, the slot is given back (SlotRing::unstage), so a failed
// call leaves the ring, the model and the optimizer as after the last completed step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "capture/blas_workspaces.h"
#include "capture/graph_structure.h"
#include "capture/static_inputs.h"
#include "capture/staging_ring.h"

namespace at::cuda {
struct MemPool;
}

namespace nimble_train::capture {

class TorchGraph;

struct CaptureResult {
  bool ok = false;
  bool invalidated = false;  // CUDA invalidated the capture (a forbidden call: a host sync)
  std::string error;         // why it failed, when it did
};

// Points at which launch() can be made to fail once, for the rollback tests.
enum class LaunchFault { kNone, kAfterStaging, kAfterCopyIn };

class StepGraph {
 public:
  // num_values: the caller's values per launch (the ring holds one more: the sample count).
  StepGraph(at::Device device, int64_t num_values, int64_t ring_capacity = 1024);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // A new entry with static inputs laid out as `inputs`; its graph is captured later.
  int64_t add_entry(std::vector<LeafSpec> inputs);
  // A new entry whose graph reads `other`'s static inputs (the same buffers, not a copy): the
  // graphs of one batch layout (the micro-batch and update graphs of gradient accumulation).
  int64_t add_entry_sharing_inputs(int64_t other);
  const StaticInputs& inputs(int64_t entry) const;
  int64_t check(int64_t entry, const std::vector<at::Tensor>& leaves) const;
  void copy_in(int64_t entry, const std::vector<at::Tensor>& leaves, int64_t samples,
               bool fill_padding);

  // An eager step that reads current() (an eager fused update): stages [samples, values...]
  // and fetches it now, on the current stream.
  void stage_eager(int64_t samples, const std::vector<float>& values);

  // Capture of `entry`'s graph on the current stream (not the default stream), thread-local
  // mode, into the shared pool; the fetch is its first node. The step's work goes between.
  // staged=false: a graph that reads no staged value (an evaluation step) has no fetch, and
  // its launches leave the ring alone (their `values` must be empty). memsets_as_kernels: the
  // graph's memset nodes become kernel nodes before it is instantiated (graph_nodes.h: a
  // graph of kernels alone launches in one cheap submission).
  void begin_capture(int64_t entry, bool staged = true, bool memsets_as_kernels = true);
  CaptureResult end_capture();      // on failure the capture is abandoned
  CaptureResult abandon_capture();  // the step's own code failed while capturing

  // The replay path (see above). values: [num_values], or [] for an entry captured unstaged.
  void launch(int64_t entry, const std::vector<at::Tensor>& leaves,
              const std::vector<float>& values);

  void drop(int64_t entry);  // forgets the entry's graph (to capture it again)
  void release();            // waits for the device, then frees every graph and the pool

  bool captured(int64_t entry) const;
  int64_t node_count(int64_t entry) const;  // -1 before capture
  int64_t memset_nodes(int64_t entry) const;  // of those, memsets rewritten as kernels
  // The cuBLAS workspaces the captures use, which the step graph holds (blas_workspaces.h).
  int64_t blas_workspaces() const { return static_cast<int64_t>(workspaces_.size()); }
  std::vector<void*> blas_workspace_addresses() const { return workspaces_.addresses(); }

  // For measuring a step's floor (graph_structure.h): the captured graph's structure, and
  // whether its launches replay it one node at a time (the launch path is otherwise the same:
  // a serial launch is a training step). A new capture of the entry replays as captured.
  GraphStructure structure(int64_t entry);
  void replay_serially(int64_t entry, bool serially);
  std::pair<uint64_t, uint64_t> pool_id() const;
  int64_t num_entries() const { return static_cast<int64_t>(entries_.size()); }
  const at::Tensor& current() const { return ring_.current(); }  // [1 + num_values] float32
  const StagingRing& staging() const { return ring_; }
  int64_t num_values() const { return num_values_; }
  at::Device device() const { return device_; }

  void fail_next_launch(LaunchFault fault) { fault_ = fault; }
  // Makes the next end_capture() fail once, after the memset rewrite and before instantiation.
  void fail_next_capture_end() { fail_capture_end_ = true; }

 private:
  struct Entry;
  Entry& entry(int64_t index);
  const Entry& entry(int64_t index) const;
  std::vector<float> slot_values(int64_t samples, const std::vector<float>& values) const;
  void inject(LaunchFault point);
  void hold_host_pool();

  at::Device device_;
  int64_t num_values_;
  StagingRing ring_;
  std::unique_ptr<at::cuda::MemPool> pool_;
  std::vector<std::unique_ptr<Entry>> entries_;
  BlasWorkspaces workspaces_;  // freed after the graphs, before the pool
  bool holds_host_pool_ = false;
  int64_t capturing_ = -1;  // the entry being captured
  LaunchFault fault_ = LaunchFault::kNone;
  bool fail_capture_end_ = false;
};

}  // namespace nimble_train::capture
