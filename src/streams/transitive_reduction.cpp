#include "streams/transitive_reduction.h"

#include <numeric>
#include <vector>

namespace nimble_train::streams {

Dag transitive_reduction(const Dag& dag, int64_t max_bytes) {
  std::vector<int> all_nodes(dag.num_nodes);
  std::iota(all_nodes.begin(), all_nodes.end(), 0);

  // Every node is a target and its column is its id.
  std::vector<char> redundant(dag.targets.size(), 0);
  sweep_reachable_targets(
      dag, all_nodes,
      [&](int u, const ColumnBlock& long_paths) {
        for (int64_t e = dag.offsets[u]; e < dag.offsets[u + 1]; ++e) {
          const int v = dag.targets[e];
          if (long_paths.covers(v) && long_paths.test(v)) redundant[e] = 1;
        }
      },
      max_bytes);

  Dag reduced;
  reduced.num_nodes = dag.num_nodes;
  reduced.offsets.assign(dag.offsets.size(), 0);
  for (int u = 0; u < dag.num_nodes; ++u) {
    for (int64_t e = dag.offsets[u]; e < dag.offsets[u + 1]; ++e) {
      if (!redundant[e]) reduced.targets.push_back(dag.targets[e]);
    }
    reduced.offsets[u + 1] = reduced.num_edges();
  }
  return reduced;
}

}  // namespace nimble_train::streams
