#include "streams/sync_plan.h"

#include <algorithm>

namespace nimble_train::streams {
namespace {

// predecessors[offsets[v] .. offsets[v + 1]) lists the u of each edge (u, v), ascending.
struct Predecessors {
  std::vector<int64_t> offsets;
  std::vector<int> nodes;
};

Predecessors predecessors_of(const Dag& dag) {
  Predecessors preds;
  preds.offsets.assign(static_cast<size_t>(dag.num_nodes) + 1, 0);
  for (int v : dag.targets) ++preds.offsets[v + 1];
  for (int v = 0; v < dag.num_nodes; ++v) preds.offsets[v + 1] += preds.offsets[v];
  preds.nodes.resize(dag.targets.size());
  std::vector<int64_t> fill(preds.offsets.begin(), preds.offsets.end() - 1);
  for (int u = 0; u < dag.num_nodes; ++u) {
    for (int v : dag.successors(u)) preds.nodes[fill[v]++] = u;
  }
  return preds;
}

}  // namespace

std::vector<std::pair<int, int>> cross_stream_edges(const Dag& reduced,
                                                    const std::vector<int>& stream_of) {
  std::vector<std::pair<int, int>> syncs;
  for (int u = 0; u < reduced.num_nodes; ++u) {
    for (int v : reduced.successors(u)) {
      if (stream_of[u] != stream_of[v]) syncs.emplace_back(u, v);
    }
  }
  return syncs;  // CSR order is sorted order
}

std::vector<std::pair<int, int>> minimal_syncs(const Dag& reduced,
                                               const std::vector<int>& stream_of, int num_streams,
                                               int64_t max_clock_bytes) {
  const int n = reduced.num_nodes;
  const int64_t clock_entries = static_cast<int64_t>(n) * num_streams;
  if (clock_entries * static_cast<int64_t>(sizeof(int)) > max_clock_bytes) {
    return cross_stream_edges(reduced, stream_of);
  }

  std::vector<int> position(n);
  std::vector<int> stream_length(num_streams, 0);
  for (int v = 0; v < n; ++v) position[v] = stream_length[stream_of[v]]++;

  const Predecessors preds = predecessors_of(reduced);
  std::vector<int> clock(static_cast<size_t>(clock_entries));
  std::vector<int> last_on_stream(num_streams, -1);
  std::vector<std::pair<int, int>> syncs;
  for (int v = 0; v < n; ++v) {
    const int s = stream_of[v];
    int* known = clock.data() + static_cast<size_t>(v) * num_streams;
    if (last_on_stream[s] >= 0) {
      const int* previous = clock.data() + static_cast<size_t>(last_on_stream[s]) * num_streams;
      std::copy(previous, previous + num_streams, known);
    } else {
      std::fill(known, known + num_streams, -1);
    }
    for (int64_t i = preds.offsets[v + 1] - 1; i >= preds.offsets[v]; --i) {
      const int u = preds.nodes[i];
      if (stream_of[u] == s || known[stream_of[u]] >= position[u]) continue;
      syncs.emplace_back(u, v);
      const int* from_u = clock.data() + static_cast<size_t>(u) * num_streams;
      for (int t = 0; t < num_streams; ++t) known[t] = std::max(known[t], from_u[t]);
    }
    known[s] = position[v];
    last_on_stream[s] = v;
  }
  std::sort(syncs.begin(), syncs.end());
  return syncs;
}

}  // namespace nimble_train::streams
