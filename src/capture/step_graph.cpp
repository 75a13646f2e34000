// StepGraph: entries, capture into the shared pool, and the replay path (see step_graph.h).
#include "capture/step_graph.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/MemPool.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <utility>

#include "capture/torch_graph.h"
#include "common/check.h"
#include "common/cuda_check.h"

namespace nimble_train::capture {

struct StepGraph::Entry {
  explicit Entry(std::shared_ptr<StaticInputs> in)
      : inputs_ptr(std::move(in)), inputs(*inputs_ptr) {}
  std::shared_ptr<StaticInputs> inputs_ptr;  // shared by the entries of one batch layout
  StaticInputs& inputs;
  std::unique_ptr<TorchGraph> graph;  // set while capturing and once captured
  std::unique_ptr<SerialGraph> serial;  // replayed in its place, when set (replay_serially)
  bool captured = false;
  bool staged = true;  // the graph fetches a slot of the ring first
  bool memsets_as_kernels = true;
  int64_t nodes = -1;
  int64_t memset_nodes = 0;

  void replay() {
    if (serial) {
      serial->launch(c10::cuda::getCurrentCUDAStream());
    } else {
      graph->replay();
    }
  }
};

StepGraph::StepGraph(at::Device device, int64_t num_values, int64_t ring_capacity)
    : device_(device), num_values_(num_values), ring_(1 + num_values, device, ring_capacity) {
  NT_CHECK(device.is_cuda() && device.has_index(), "StepGraph runs on one CUDA device given "
           "with its index (cuda:0); got ", device);
  NT_CHECK(num_values >= 0, "StepGraph: num_values must be >= 0; got ", num_values);
  const c10::cuda::CUDAGuard guard(device_);
  pool_ = std::make_unique<at::cuda::MemPool>();
  hold_host_pool();
}

// The pinned-host allocator keeps a pool of its own under the graphs' pool id, counted by the
// captures alone: when the last graph is dropped (to capture it again) its count reaches zero,
// and the next capture's incref then trips an internal assert. A reference held for the step
// graph's lifetime, as the MemPool holds one on the device side, keeps it alive in between:
// begin and end a routing that matches no stream, which only counts.
void StepGraph::hold_host_pool() {
  try {
    at::HostAllocator* host = at::getHostAllocator(at::kCUDA);
    host->begin_allocate_to_pool(pool_->id(), [](c10::Stream) { return false; });
    host->end_allocate_to_pool(pool_->id());
    holds_host_pool_ = true;
  } catch (const std::exception&) {
    holds_host_pool_ = false;  // a host allocator without graph pools needs no reference
  }
}

StepGraph::~StepGraph() {
  // A destructor must not throw; release() is the orderly way (it waits for the device).
  try {
    release();
  } catch (const std::exception&) {
  }
}

StepGraph::Entry& StepGraph::entry(int64_t index) {
  NT_CHECK(index >= 0 && index < num_entries(), "StepGraph: no entry ", index, " (it has ",
           num_entries(), ")");
  return *entries_[size_t(index)];
}

const StepGraph::Entry& StepGraph::entry(int64_t index) const {
  return const_cast<StepGraph*>(this)->entry(index);
}

int64_t StepGraph::add_entry(std::vector<LeafSpec> inputs) {
  for (const LeafSpec& spec : inputs) {
    NT_CHECK(spec.device == device_, "StepGraph on ", device_, ": input ", spec.path,
             " is on ", spec.device);
  }
  const c10::cuda::CUDAGuard guard(device_);
  entries_.push_back(
      std::make_unique<Entry>(std::make_shared<StaticInputs>(std::move(inputs))));
  return num_entries() - 1;
}

int64_t StepGraph::add_entry_sharing_inputs(int64_t other) {
  std::shared_ptr<StaticInputs> shared = entry(other).inputs_ptr;
  entries_.push_back(std::make_unique<Entry>(std::move(shared)));
  return num_entries() - 1;
}

const StaticInputs& StepGraph::inputs(int64_t index) const { return entry(index).inputs; }

int64_t StepGraph::check(int64_t index, const std::vector<at::Tensor>& leaves) const {
  return entry(index).inputs.check(leaves);
}

void StepGraph::copy_in(int64_t index, const std::vector<at::Tensor>& leaves, int64_t samples,
                        bool fill_padding) {
  entry(index).inputs.copy_in(leaves, samples, fill_padding);
}

std::vector<float> StepGraph::slot_values(int64_t samples, const std::vector<float>& values) const {
  NT_CHECK(static_cast<int64_t>(values.size()) == num_values_, "StepGraph: expected ",
           num_values_, " staged values; got ", values.size());
  std::vector<float> slot;
  slot.reserve(values.size() + 1);
  slot.push_back(static_cast<float>(samples));
  slot.insert(slot.end(), values.begin(), values.end());
  return slot;
}

void StepGraph::stage_eager(int64_t samples, const std::vector<float>& values) {
  NT_CHECK(capturing_ < 0, "StepGraph.stage_eager: entry ", capturing_, " is being captured");
  ring_.stage(slot_values(samples, values));
  try {
    ring_.fetch();
  } catch (...) {
    ring_.unstage();
    throw;
  }
  ring_.launched();
}

void StepGraph::begin_capture(int64_t index, bool staged, bool memsets_as_kernels) {
  Entry& e = entry(index);
  NT_CHECK(capturing_ < 0, "StepGraph.begin_capture: entry ", capturing_,
           " is being captured already");
  const c10::cuda::CUDAGuard guard(device_);
  NT_CHECK(c10::cuda::getCurrentCUDAStream() != c10::cuda::getDefaultCUDAStream(),
           "StepGraph.begin_capture: capture runs on a side stream, and the current stream "
           "is the default stream");
  e.serial.reset();
  e.graph.reset();
  e.captured = false;
  e.nodes = -1;
  e.memset_nodes = 0;
  e.staged = staged;
  e.memsets_as_kernels = memsets_as_kernels;
  e.graph = std::make_unique<TorchGraph>();
  workspaces_.lend();  // the graphs of one step share the workspaces, as they never run at once
  try {
    e.graph->capture_begin(pool_->id(), cudaStreamCaptureModeThreadLocal);
  } catch (...) {
    e.graph->abandon();  // undoes whatever capture_begin had set up before it failed
    e.graph.reset();
    workspaces_.take_lent();
    throw;
  }
  capturing_ = index;
  if (!staged) return;
  try {
    ring_.fetch();  // the graph's first node: every replay fetches its own slot
  } catch (...) {
    abandon_capture();
    throw;
  }
}

CaptureResult StepGraph::end_capture() {
  NT_CHECK(capturing_ >= 0, "StepGraph.end_capture: nothing is being captured");
  Entry& e = entry(capturing_);
  // Asked before ending: once cudaStreamEndCapture has run, the stream no longer says.
  const bool invalidated = e.graph->invalidated();
  try {
    workspaces_.take(e.graph->capture_id());  // the graph replays into them
    const int64_t nodes =
        e.graph->finish(e.memsets_as_kernels, std::exchange(fail_capture_end_, false));
    e.nodes = nodes;
    e.memset_nodes = e.graph->memset_nodes();
    e.captured = true;
    capturing_ = -1;
    return {true, false, ""};
  } catch (const std::exception& exc) {
    CaptureResult result = abandon_capture();
    result.invalidated = result.invalidated || invalidated;
    result.error = exc.what();
    return result;
  }
}

CaptureResult StepGraph::abandon_capture() {
  NT_CHECK(capturing_ >= 0, "StepGraph.abandon_capture: nothing is being captured");
  Entry& e = entry(capturing_);
  CaptureResult result;
  result.invalidated = e.graph->abandon();
  result.error = result.invalidated ? "CUDA invalidated the capture" : "the capture was abandoned";
  e.graph.reset();
  workspaces_.take_lent();
  capturing_ = -1;
  return result;
}

void StepGraph::inject(LaunchFault point) {
  if (fault_ != point) return;
  fault_ = LaunchFault::kNone;
  NT_FAIL("injected failure ", point == LaunchFault::kAfterStaging ? "after staging" :
          "after the copy-in", " (a rollback test)");
}

void StepGraph::launch(int64_t index, const std::vector<at::Tensor>& leaves,
                       const std::vector<float>& values) {
  Entry& e = entry(index);
  NT_CHECK(e.captured, "StepGraph.launch: entry ", index, " has no captured graph");
  const int64_t samples = e.inputs.check(leaves);  // before staging: nothing to undo
  if (!e.staged) {
    NT_CHECK(values.empty(), "StepGraph.launch: entry ", index, " reads no staged values; got ",
             values.size());
    const c10::cuda::CUDAGuard guard(device_);
    e.inputs.copy_in(leaves, samples);
    inject(LaunchFault::kAfterCopyIn);  // nothing staged: nothing to give back
    e.replay();
    return;
  }
  ring_.stage(slot_values(samples, values));
  try {
    inject(LaunchFault::kAfterStaging);
    const c10::cuda::CUDAGuard guard(device_);
    e.inputs.copy_in(leaves, samples);
    inject(LaunchFault::kAfterCopyIn);
    e.replay();
  } catch (...) {
    ring_.unstage();  // the launch did not happen: the next one takes this slot
    throw;
  }
  ring_.launched();
}

void StepGraph::drop(int64_t index) {
  Entry& e = entry(index);
  NT_CHECK(capturing_ != index, "StepGraph.drop: entry ", index, " is being captured");
  e.serial.reset();
  e.graph.reset();
  e.captured = false;
  e.nodes = -1;
}

void StepGraph::release() {
  if (!pool_) return;
  const c10::cuda::CUDAGuard guard(device_);
  if (capturing_ >= 0) abandon_capture();
  NT_CHECK_CUDA(cudaDeviceSynchronize());  // no launch may still read what is freed below
  for (auto& e : entries_) {
    e->serial.reset();
    e->graph.reset();
    e->captured = false;
  }
  entries_.clear();
  workspaces_.clear();
  if (holds_host_pool_) {
    at::getHostAllocator(at::kCUDA)->release_pool(pool_->id());
    holds_host_pool_ = false;
  }
  pool_.reset();  // the graphs released their references; this frees the pool's free blocks
}

bool StepGraph::captured(int64_t index) const { return entry(index).captured; }

int64_t StepGraph::node_count(int64_t index) const { return entry(index).nodes; }

int64_t StepGraph::memset_nodes(int64_t index) const { return entry(index).memset_nodes; }

GraphStructure StepGraph::structure(int64_t index) {
  Entry& e = entry(index);
  NT_CHECK(e.captured, "StepGraph.structure: entry ", index, " has no captured graph");
  return graph_structure(e.graph->raw_cuda_graph());
}

void StepGraph::replay_serially(int64_t index, bool serially) {
  Entry& e = entry(index);
  NT_CHECK(e.captured, "StepGraph.replay_serially: entry ", index, " has no captured graph");
  if (!serially) {
    e.serial.reset();
  } else if (!e.serial) {
    e.serial = std::make_unique<SerialGraph>(e.graph->raw_cuda_graph(), device_.index());
  }
}

std::pair<uint64_t, uint64_t> StepGraph::pool_id() const {
  NT_CHECK(pool_ != nullptr, "StepGraph.pool_id: the pool was released");
  const auto id = pool_->id();
  return {id.first, id.second};
}

}  // namespace nimble_train::capture
