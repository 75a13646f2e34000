#include "streams/stream_limit.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace nimble_train::streams {
namespace {

// level[v]: the number of edges on the longest path that ends at v. The longest paths of a
// DAG and of its transitive reduction are equally long, so `reduced` gives the same levels.
std::vector<int> longest_path_levels(const Dag& dag) {
  std::vector<int> level(dag.num_nodes, 0);
  for (int u = 0; u < dag.num_nodes; ++u) {
    for (int w : dag.successors(u)) level[w] = std::max(level[w], level[u] + 1);
  }
  return level;
}

// How many nodes of each stream sit on each level: per level, (stream, count) pairs. A level
// holds few streams in practice, so a short list beats a num_levels x max_streams table.
class LevelOccupancy {
 public:
  explicit LevelOccupancy(int num_levels) : by_level_(num_levels) {}

  // Adds to cost[stream] the number of that stream's nodes on `level`.
  void add_costs(int level, std::vector<int64_t>& cost) const {
    for (const auto& [stream, count] : by_level_[level]) cost[stream] += count;
  }
  void place(int level, int stream) {
    for (auto& [s, count] : by_level_[level]) {
      if (s == stream) {
        ++count;
        return;
      }
    }
    by_level_[level].emplace_back(stream, 1);
  }

 private:
  std::vector<std::vector<std::pair<int, int>>> by_level_;
};

}  // namespace

Cover fold_into_streams(const Dag& reduced, const Cover& chains, int max_streams) {
  if (chains.num_groups <= max_streams) return chains;
  const int n = reduced.num_nodes;
  const std::vector<int> level = longest_path_levels(reduced);
  const int num_levels = n == 0 ? 0 : *std::max_element(level.begin(), level.end()) + 1;

  std::vector<std::vector<int>> members(chains.num_groups);
  for (int v = 0; v < n; ++v) members[chains.group_of[v]].push_back(v);
  // Largest first; groups are numbered by first node, so the stable sort breaks ties by it.
  std::vector<int> order(chains.num_groups);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return members[a].size() > members[b].size(); });

  LevelOccupancy occupancy(num_levels);
  std::vector<int64_t> stream_size(max_streams, 0);
  std::vector<int64_t> cost(max_streams);
  std::vector<int> stream_of_group(chains.num_groups);
  for (int g : order) {
    std::fill(cost.begin(), cost.end(), 0);
    for (int v : members[g]) occupancy.add_costs(level[v], cost);
    int best = 0;
    for (int s = 1; s < max_streams; ++s) {
      if (std::make_pair(cost[s], stream_size[s]) < std::make_pair(cost[best], stream_size[best])) {
        best = s;
      }
    }
    stream_of_group[g] = best;
    stream_size[best] += static_cast<int64_t>(members[g].size());
    for (int v : members[g]) occupancy.place(level[v], best);
  }

  std::vector<int> stream_of(n);
  for (int v = 0; v < n; ++v) stream_of[v] = stream_of_group[chains.group_of[v]];
  return numbered_by_first_node(stream_of);
}

}  // namespace nimble_train::streams
