// A captured graph's dependency structure, and the same graph run one node at a time: what a
// step's floor is measured with.
//
// On one stream a step can take no less than the sum of its kernels' times; on several, no
// less than its critical path, the longest chain of dependent nodes with each node timed as
// it runs alone. Both need each node's time without contention. A profile of the graph as
// captured gives times stretched by whatever ran beside each node, and a kernel's interval in
// it cannot be told from the same kernel's on another stream. So the graph is cloned with an
// edge added between each node and the next in one topological order: replayed, the clone
// runs every node alone, in that order, and its profile's activities are the nodes in order.
// The structure lists the nodes in the same order, so the two line up (bench/floor.py).
//
// Topological order: among the nodes whose dependencies are all placed, the one cudaGraph-
// GetNodes lists first (for a captured graph, creation order: the host's launch order), so a
// graph captured on one stream keeps its order and gains no edge.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace nimble_train::capture {

struct GraphStructure {
  // Per node, in topological order: "kernel", "memcpy", "memset" (the nodes that do work and
  // show in a profile), or "empty", "host", "child_graph", "event_record", "event_wait",
  // "mem_alloc", "mem_free", "conditional", "other".
  std::vector<std::string> kinds;
  // Per node, the positions (in the same order, so each below the node's own) of the nodes it
  // depends on.
  std::vector<std::vector<int64_t>> dependencies;
};

// `graph` (captured, instantiated or not) as above.
GraphStructure graph_structure(cudaGraph_t graph);

// `graph` replayed one node at a time, in graph_structure's order: an instantiated clone with
// an edge from each node to the next. The clone reads and writes the memory the graph does;
// replay it only where a replay of the graph itself would be right.
class SerialGraph {
 public:
  // `device`: the graph's.
  SerialGraph(cudaGraph_t graph, int device);
  ~SerialGraph();
  SerialGraph(const SerialGraph&) = delete;
  SerialGraph& operator=(const SerialGraph&) = delete;

  void launch(cudaStream_t stream);
  int64_t added_edges() const { return added_edges_; }  // 0: the graph was already serial

 private:
  cudaGraphExec_t exec_ = nullptr;
  int device_ = 0;
  int64_t added_edges_ = 0;
};

}  // namespace nimble_train::capture
