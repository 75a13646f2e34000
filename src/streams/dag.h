// A directed acyclic graph in compressed sparse row form, validated from an edge list.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace nimble_train::streams {

// The successors of one node: a contiguous, ascending run of node ids.
struct NodeRange {
  const int* first = nullptr;
  const int* last = nullptr;
  const int* begin() const { return first; }
  const int* end() const { return last; }
  int64_t size() const { return last - first; }
};

// Nodes are numbered topologically (every edge (u, v) has u < v); each node's successors are
// sorted and free of duplicates.
struct Dag {
  int num_nodes = 0;
  std::vector<int64_t> offsets;  // [num_nodes + 1] index into `targets` of each node's first edge
  std::vector<int> targets;      // [num_edges] successor ids

  int64_t num_edges() const { return static_cast<int64_t>(targets.size()); }
  NodeRange successors(int u) const {
    const int* base = targets.data();
    return {base + offsets[u], base + offsets[u + 1]};
  }
};

// Checks the edge list and builds the graph; duplicate edges collapse into one. Throws
// InvalidArgument (a std::invalid_argument; see common/check.h), naming the offending edge,
// for a negative node count, an id outside [0, num_nodes) or an edge that does not go
// forward (u < v; self-loops included).
Dag build_dag(int num_nodes, const std::vector<std::pair<int, int>>& edges);

// The edges as (u, v) pairs, in CSR order (by u, then v).
std::vector<std::pair<int, int>> edge_list(const Dag& dag);

}  // namespace nimble_train::streams
