// A captured graph's structure and its serial clone (see graph_structure.h).
#include "capture/graph_structure.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <unordered_map>
#include <utility>

#include "common/cuda_check.h"

namespace nimble_train::capture {
namespace {

const char* kind_name(cudaGraphNodeType type) {
  switch (type) {
    case cudaGraphNodeTypeKernel: return "kernel";
    case cudaGraphNodeTypeMemcpy: return "memcpy";
    case cudaGraphNodeTypeMemset: return "memset";
    case cudaGraphNodeTypeHost: return "host";
    case cudaGraphNodeTypeGraph: return "child_graph";
    case cudaGraphNodeTypeEmpty: return "empty";
    case cudaGraphNodeTypeWaitEvent: return "event_wait";
    case cudaGraphNodeTypeEventRecord: return "event_record";
    case cudaGraphNodeTypeMemAlloc: return "mem_alloc";
    case cudaGraphNodeTypeMemFree: return "mem_free";
    case cudaGraphNodeTypeConditional: return "conditional";
    default: return "other";
  }
}

// The graph's nodes in topological order (the header's), each with the positions of its
// dependencies in that order.
struct Ordered {
  std::vector<cudaGraphNode_t> nodes;
  std::vector<std::vector<int64_t>> dependencies;
};

Ordered topological(cudaGraph_t graph) {
  size_t count = 0;
  NT_CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> listed(count);
  if (count > 0) NT_CHECK_CUDA(cudaGraphGetNodes(graph, listed.data(), &count));
  std::unordered_map<cudaGraphNode_t, int64_t> listed_at;
  for (size_t i = 0; i < count; ++i) listed_at[listed[i]] = int64_t(i);

  size_t edges = 0;
  NT_CHECK_CUDA(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &edges));
  std::vector<cudaGraphNode_t> from(edges), to(edges);
  // Asked without their data, edges that carry some (a programmatic dependent launch's, from
  // cuBLAS's kernels) fail the query as lossy. Every edge counts as a full dependency here.
  std::vector<cudaGraphEdgeData> data(edges);
  if (edges > 0) {
    NT_CHECK_CUDA(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &edges));
  }
  std::vector<std::vector<int64_t>> before(count), after(count);  // by listed position
  for (size_t e = 0; e < edges; ++e) {
    const int64_t a = listed_at.at(from[e]), b = listed_at.at(to[e]);
    before[size_t(b)].push_back(a);
    after[size_t(a)].push_back(b);
  }

  // Kahn's algorithm, the ready node listed first taken first.
  std::vector<int64_t> waiting(count);
  std::priority_queue<int64_t, std::vector<int64_t>, std::greater<>> ready;
  for (size_t i = 0; i < count; ++i) {
    waiting[i] = int64_t(before[i].size());
    if (waiting[i] == 0) ready.push(int64_t(i));
  }
  std::vector<int64_t> position(count, -1);
  Ordered out;
  out.nodes.reserve(count);
  while (!ready.empty()) {
    const int64_t i = ready.top();
    ready.pop();
    position[size_t(i)] = int64_t(out.nodes.size());
    out.nodes.push_back(listed[size_t(i)]);
    for (int64_t j : after[size_t(i)]) {
      if (--waiting[size_t(j)] == 0) ready.push(j);
    }
  }
  NT_CHECK(out.nodes.size() == count, "graph_structure: the graph has a cycle (", count -
           out.nodes.size(), " of ", count, " nodes never became ready)");
  out.dependencies.resize(count);
  for (size_t i = 0; i < count; ++i) {
    auto& deps = out.dependencies[size_t(position[i])];
    for (int64_t a : before[i]) deps.push_back(position[size_t(a)]);
    std::sort(deps.begin(), deps.end());
  }
  return out;
}

}  // namespace

GraphStructure graph_structure(cudaGraph_t graph) {
  NT_CHECK(graph != nullptr, "graph_structure: no graph (a torch.cuda.CUDAGraph keeps its "
           "cudaGraph_t only when made with keep_graph=True)");
  Ordered ordered = topological(graph);
  GraphStructure s;
  s.kinds.reserve(ordered.nodes.size());
  for (cudaGraphNode_t node : ordered.nodes) {
    cudaGraphNodeType type;
    NT_CHECK_CUDA(cudaGraphNodeGetType(node, &type));
    s.kinds.emplace_back(kind_name(type));
  }
  s.dependencies = std::move(ordered.dependencies);
  return s;
}

SerialGraph::SerialGraph(cudaGraph_t graph, int device) : device_(device) {
  NT_CHECK(graph != nullptr, "SerialGraph: no graph (a torch.cuda.CUDAGraph keeps its "
           "cudaGraph_t only when made with keep_graph=True)");
  const DeviceGuard guard(device);
  const Ordered ordered = topological(graph);
  cudaGraph_t clone = nullptr;
  NT_CHECK_CUDA(cudaGraphClone(&clone, graph));
  try {
    cudaGraphNode_t previous = nullptr;
    for (size_t i = 0; i < ordered.nodes.size(); ++i) {
      cudaGraphNode_t node = nullptr;
      NT_CHECK_CUDA(cudaGraphNodeFindInClone(&node, ordered.nodes[i], clone));
      const auto& deps = ordered.dependencies[i];
      // An edge already there would be refused; the previous node is the last one listed.
      if (previous != nullptr && (deps.empty() || deps.back() != int64_t(i) - 1)) {
        NT_CHECK_CUDA(cudaGraphAddDependencies(clone, &previous, &node, nullptr, 1));
        ++added_edges_;
      }
      previous = node;
    }
    NT_CHECK_CUDA(cudaGraphInstantiate(&exec_, clone, 0));
  } catch (...) {
    (void)cudaGraphDestroy(clone);
    throw;
  }
  NT_CHECK_CUDA(cudaGraphDestroy(clone));  // the executable graph is independent of it
}

SerialGraph::~SerialGraph() {
  if (exec_ == nullptr) return;
  try {
    const DeviceGuard guard(device_);
    (void)cudaGraphExecDestroy(exec_);
  } catch (const std::exception&) {
  }
}

void SerialGraph::launch(cudaStream_t stream) {
  const DeviceGuard guard(device_);
  NT_CHECK_CUDA(cudaGraphLaunch(exec_, stream));
}

}  // namespace nimble_train::capture
