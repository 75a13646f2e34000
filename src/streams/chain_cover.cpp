#include "streams/chain_cover.h"

#include <vector>

#include "streams/bipartite_matching.h"
#include "streams/reachability.h"

namespace nimble_train::streams {
namespace {

// Follows `next` links (-1 ends a run) from every item no link points at, in increasing order
// of item, and numbers the runs in that order: group_of[item] is its run.
Cover follow_links(const std::vector<int>& next) {
  const int n = static_cast<int>(next.size());
  std::vector<char> has_previous(n, 0);
  for (int item : next) {
    if (item >= 0) has_previous[item] = 1;
  }
  Cover cover;
  cover.group_of.assign(n, -1);
  for (int first = 0; first < n; ++first) {
    if (has_previous[first]) continue;
    for (int item = first; item >= 0; item = next[item]) cover.group_of[item] = cover.num_groups;
    ++cover.num_groups;
  }
  return cover;
}

}  // namespace

Cover path_cover(const Dag& reduced, int64_t* matched_edges) {
  const int n = reduced.num_nodes;
  // match[u] = v links u to its successor on the same path.
  const std::vector<int> match = max_bipartite_matching(n, n, DagAdjacency{&reduced});
  if (matched_edges != nullptr) {
    *matched_edges = 0;
    for (int v : match) *matched_edges += v >= 0;
  }
  // Paths start at nodes without a matched predecessor, and those are visited in increasing
  // order, so run numbers already follow the first node.
  return follow_links(match);
}

Cover merge_ordered_paths(const Dag& reduced, const Cover& paths, int64_t max_relation_bytes) {
  const int n = reduced.num_nodes;
  const int p = paths.num_groups;
  const int64_t words = (static_cast<int64_t>(p) + 63) / 64;
  if (p <= 1 || p * words * 8 > max_relation_bytes) return paths;

  // Paths are numbered by first node, so the first nodes, in path order, ascend.
  std::vector<int> first_node(p, -1), last_node(p, -1);
  for (int v = 0; v < n; ++v) {
    const int g = paths.group_of[v];
    if (first_node[g] < 0) first_node[g] = v;
    last_node[g] = v;
  }
  std::vector<char> is_last(n, 0);
  for (int v : last_node) is_last[v] = 1;

  // before[a] has bit b set when the last node of path a reaches the first node of path b.
  // The sweep gives reachability by two or more edges; the successors add the one-edge paths.
  std::vector<uint64_t> before(static_cast<size_t>(p) * words, 0);
  sweep_reachable_targets(reduced, first_node, [&](int u, const ColumnBlock& block) {
    if (!is_last[u]) return;
    uint64_t* row = before.data() + static_cast<size_t>(paths.group_of[u]) * words;
    const int block_words = (block.end - block.begin + 63) / 64;
    for (int k = 0; k < block_words; ++k) row[block.begin / 64 + k] |= block.words[k];
    for (int w : reduced.successors(u)) {
      const int b = paths.group_of[w];
      if (first_node[b] == w) row[b >> 6] |= uint64_t{1} << (b & 63);
    }
  });

  const std::vector<int> next = max_bipartite_matching(p, p, BitsetAdjacency{before.data(), words});
  // A merged group starts with its earliest path, and runs are numbered by their first path,
  // so merged groups are numbered by first node too.
  const Cover runs = follow_links(next);
  Cover merged;
  merged.num_groups = runs.num_groups;
  merged.group_of.resize(n);
  for (int v = 0; v < n; ++v) merged.group_of[v] = runs.group_of[paths.group_of[v]];
  return merged;
}

Cover numbered_by_first_node(const std::vector<int>& group_of) {
  Cover cover;
  cover.group_of.resize(group_of.size());
  std::vector<int> new_id;
  for (size_t v = 0; v < group_of.size(); ++v) {
    const int g = group_of[v];
    if (g >= static_cast<int>(new_id.size())) new_id.resize(g + 1, -1);
    if (new_id[g] < 0) new_id[g] = cover.num_groups++;
    cover.group_of[v] = new_id[g];
  }
  return cover;
}

}  // namespace nimble_train::streams
