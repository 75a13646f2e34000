// Times assign_streams on large graphs: a random 10,000-node, 50,000-edge DAG and a deep
// stack of wide inception-style cells. Prints the median of several runs; not a test.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "streams/chain_cover.h"
#include "streams/dag.h"
#include "streams/stream_assignment.h"
#include "streams/transitive_reduction.h"

namespace {

using Edges = std::vector<std::pair<int, int>>;
namespace streams = nimble_train::streams;

struct Graph {
  const char* name;
  int num_nodes;
  Edges edges;
};

// num_edges distinct forward pairs, uniform over all pairs.
Graph random_dag(int num_nodes, int num_edges, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> node(0, num_nodes - 1);
  std::set<std::pair<int, int>> chosen;
  while (static_cast<int>(chosen.size()) < num_edges) {
    const int a = node(rng);
    const int b = node(rng);
    if (a != b) chosen.emplace(std::min(a, b), std::max(a, b));
  }
  return {"random DAG", num_nodes, Edges(chosen.begin(), chosen.end())};
}

// `cells` cells; each forks its input into `branches` branches of 1-4 operators, joins them in
// a concat, and adds the cell input back (a residual edge), like an Inception/NASNet stack.
Graph inception_stack(int cells, int branches, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> depth(1, 4);
  Graph g{"inception stack", 1, {}};
  int input = 0;
  for (int c = 0; c < cells; ++c) {
    std::vector<int> ends;
    for (int b = 0; b < branches; ++b) {
      int at = input;
      for (int k = depth(rng); k > 0; --k) {
        g.edges.emplace_back(at, g.num_nodes);
        at = g.num_nodes++;
      }
      ends.push_back(at);
    }
    const int concat = g.num_nodes++;
    for (int end : ends) g.edges.emplace_back(end, concat);
    g.edges.emplace_back(input, concat);
    input = concat;
  }
  return g;
}

// What the steps make of the graph: reduced edges, and the paths before and after merging.
void describe(const Graph& g) {
  const streams::Dag reduced =
      streams::transitive_reduction(streams::build_dag(g.num_nodes, g.edges));
  int64_t matched = 0;
  const streams::Cover paths = streams::path_cover(reduced, &matched);
  const streams::Cover merged = streams::merge_ordered_paths(reduced, paths);
  std::printf("%s: |E'| = %lld reduced edges, |M| = %lld matched, %d paths (one stream each in "
              "Nimble) merged into %d streams\n",
              g.name, static_cast<long long>(reduced.num_edges()), static_cast<long long>(matched),
              paths.num_groups, merged.num_groups);
}

void bench(const Graph& g, int max_streams, int repeats) {
  std::vector<double> ms;
  streams::StreamPlan plan;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    plan = streams::assign_streams(g.num_nodes, g.edges, max_streams);
    const auto stop = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%-16s %6d nodes %6zu edges  max_streams %-3d  %9.2f ms (median of %d)  "
              "%5d streams  %6zu syncs\n",
              g.name, g.num_nodes, g.edges.size(), max_streams, ms[ms.size() / 2], repeats,
              plan.num_streams, plan.syncs.size());
}

}  // namespace

int main() {
  const int repeats = 5;
  const Graph random = random_dag(10000, 50000, 1);
  const Graph inception = inception_stack(500, 8, 1);
  for (const Graph* g : {&random, &inception}) {
    describe(*g);
    for (int max_streams : {0, 8, 4}) bench(*g, max_streams, repeats);
  }
  return 0;
}
