#include "streams/dag.h"

#include <algorithm>

#include "common/check.h"

namespace nimble_train::streams {
namespace {

void check_edges(int num_nodes, const std::vector<std::pair<int, int>>& edges) {
  NT_CHECK(num_nodes >= 0, "num_nodes must be >= 0; got ", num_nodes);
  for (size_t i = 0; i < edges.size(); ++i) {
    const auto [u, v] = edges[i];
    for (int id : {u, v}) {
      NT_CHECK(id >= 0 && id < num_nodes, "edge ", i, " (", u, ", ", v,
               ") has a node id out of range: ids must be in [0, ", num_nodes, "); got ", id);
    }
    NT_CHECK(u < v, "edge ", i, " (", u, ", ", v,
             ") must go forward in the topological numbering (u < v); got u=", u, " >= v=", v);
  }
}

// Builds the CSR form of edges already checked, in any order.
Dag dag_from_valid_edges(int num_nodes, const std::vector<std::pair<int, int>>& edges) {
  Dag dag;
  dag.num_nodes = num_nodes;
  // Counting sort by source, then sort and deduplicate each node's successors.
  std::vector<int64_t> count(static_cast<size_t>(num_nodes) + 1, 0);
  for (const auto& [u, v] : edges) ++count[u + 1];
  for (int u = 0; u < num_nodes; ++u) count[u + 1] += count[u];
  std::vector<int> targets(edges.size());
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (const auto& [u, v] : edges) targets[fill[u]++] = v;

  dag.offsets.assign(static_cast<size_t>(num_nodes) + 1, 0);
  dag.targets.reserve(targets.size());
  for (int u = 0; u < num_nodes; ++u) {
    auto first = targets.begin() + count[u];
    auto last = targets.begin() + count[u + 1];
    std::sort(first, last);
    last = std::unique(first, last);
    dag.targets.insert(dag.targets.end(), first, last);
    dag.offsets[u + 1] = dag.num_edges();
  }
  return dag;
}

}  // namespace

Dag build_dag(int num_nodes, const std::vector<std::pair<int, int>>& edges) {
  check_edges(num_nodes, edges);
  return dag_from_valid_edges(num_nodes, edges);
}

std::vector<std::pair<int, int>> edge_list(const Dag& dag) {
  std::vector<std::pair<int, int>> edges;
  edges.reserve(dag.targets.size());
  for (int u = 0; u < dag.num_nodes; ++u) {
    for (int v : dag.successors(u)) edges.emplace_back(u, v);
  }
  return edges;
}

}  // namespace nimble_train::streams
