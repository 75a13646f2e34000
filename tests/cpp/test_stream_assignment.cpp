// Stream assignment, checked against brute-force oracles that share no code with it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "streams/bipartite_matching.h"
#include "streams/chain_cover.h"
#include "streams/dag.h"
#include "streams/reachability.h"
#include "streams/stream_assignment.h"
#include "streams/sync_plan.h"
#include "streams/transitive_reduction.h"

namespace nimble_train::streams {
namespace {

using Edge = std::pair<int, int>;
using Edges = std::vector<Edge>;
using Matrix = std::vector<std::vector<char>>;

// ---------------------------------------------------------------------------------------------
// Oracles: plain loops, O(n^3), written from the definitions.

// reach[u][v]: a path of one or more edges leads from u to v (Warshall).
Matrix closure(int n, const Edges& edges) {
  Matrix reach(n, std::vector<char>(n, 0));
  for (const auto& [u, v] : edges) reach[u][v] = 1;
  for (int k = 0; k < n; ++k) {
    for (int i = 0; i < n; ++i) {
      if (!reach[i][k]) continue;
      for (int j = 0; j < n; ++j) reach[i][j] |= reach[k][j];
    }
  }
  return reach;
}

// Edge (u, v) stays unless some w lies on another path from u to v.
Edges brute_reduction(int n, const Edges& edges) {
  const Matrix reach = closure(n, edges);
  std::set<Edge> kept;
  for (const auto& [u, v] : edges) {
    bool bypassed = false;
    for (int w = 0; w < n && !bypassed; ++w) bypassed = reach[u][w] && reach[w][v];
    if (!bypassed) kept.insert({u, v});
  }
  return Edges(kept.begin(), kept.end());
}

// Size of a maximum matching, by one augmenting-path search per left vertex (Kuhn).
bool kuhn_augment(int u, const std::vector<std::vector<int>>& adj, std::vector<int>& match_right,
                  std::vector<char>& seen) {
  for (int v : adj[u]) {
    if (seen[v]) continue;
    seen[v] = 1;
    if (match_right[v] < 0 || kuhn_augment(match_right[v], adj, match_right, seen)) {
      match_right[v] = u;
      return true;
    }
  }
  return false;
}

int kuhn_matching_size(int num_right, const std::vector<std::vector<int>>& adj) {
  std::vector<int> match_right(num_right, -1);
  int size = 0;
  for (int u = 0; u < static_cast<int>(adj.size()); ++u) {
    std::vector<char> seen(num_right, 0);
    size += kuhn_augment(u, adj, match_right, seen);
  }
  return size;
}

int matching_size_of_edges(int n, const Edges& edges) {
  std::vector<std::vector<int>> adj(n);
  for (const auto& [u, v] : edges) adj[u].push_back(v);
  return kuhn_matching_size(n, adj);
}

bool independent(const Matrix& reach, int a, int b) { return !reach[a][b] && !reach[b][a]; }

// The ordering a plan enforces: consecutive nodes of each stream, plus the syncs.
Edges execution_edges(const StreamPlan& plan) {
  Edges edges = plan.syncs;
  std::vector<int> last(plan.num_streams, -1);
  for (int v = 0; v < static_cast<int>(plan.stream_of.size()); ++v) {
    int& previous = last[plan.stream_of[v]];
    if (previous >= 0) edges.emplace_back(previous, v);
    previous = v;
  }
  return edges;
}

bool reaches(int n, const Edges& edges, int from, int to) {
  std::vector<std::vector<int>> out(n);
  for (const auto& [u, v] : edges) out[u].push_back(v);
  std::vector<char> seen(n, 0);
  std::vector<int> stack = {from};
  while (!stack.empty()) {
    const int u = stack.back();
    stack.pop_back();
    for (int v : out[u]) {
      if (v == to) return true;
      if (!seen[v]) {
        seen[v] = 1;
        stack.push_back(v);
      }
    }
  }
  return false;
}

std::vector<std::vector<int>> nodes_by_stream(const StreamPlan& plan) {
  std::vector<std::vector<int>> members(plan.num_streams);
  for (int v = 0; v < static_cast<int>(plan.stream_of.size()); ++v) {
    members[plan.stream_of[v]].push_back(v);
  }
  return members;
}

// ---------------------------------------------------------------------------------------------
// Checks. Each states one property of the contract in stream_assignment.h.

std::string describe(const StreamPlan& plan) {
  std::string s = "stream_of=[";
  for (int x : plan.stream_of) s += std::to_string(x) + " ";
  s += "] syncs=[";
  for (const auto& [u, v] : plan.syncs) {
    s += "(" + std::to_string(u) + "," + std::to_string(v) + ")";
  }
  return s + "]";
}

void expect_well_formed(int n, const StreamPlan& plan) {
  ASSERT_EQ(static_cast<int>(plan.stream_of.size()), n);
  if (n == 0) {
    EXPECT_EQ(plan.num_streams, 0);
  }
  // Streams are numbered by first node: scanning nodes in order meets 0, 1, 2, ... in turn.
  int next_new = 0;
  for (int s : plan.stream_of) {
    ASSERT_GE(s, 0);
    ASSERT_LE(s, next_new) << "streams must be numbered by their first node";
    if (s == next_new) ++next_new;
  }
  EXPECT_EQ(next_new, plan.num_streams) << "every stream must hold a node";
  EXPECT_TRUE(std::is_sorted(plan.syncs.begin(), plan.syncs.end()));
  EXPECT_EQ(std::adjacent_find(plan.syncs.begin(), plan.syncs.end()), plan.syncs.end());
  for (const auto& [u, v] : plan.syncs) {
    ASSERT_TRUE(u >= 0 && u < v && v < n) << "sync (" << u << ", " << v << ")";
    EXPECT_NE(plan.stream_of[u], plan.stream_of[v])
        << "sync (" << u << ", " << v << ") joins a stream to itself";
  }
}

void expect_syncs_are_reduction_edges(const StreamPlan& plan, const Edges& reduction) {
  const std::set<Edge> allowed(reduction.begin(), reduction.end());
  for (const Edge& e : plan.syncs) {
    EXPECT_TRUE(allowed.count(e)) << "sync (" << e.first << ", " << e.second
                                  << ") is not an edge of the transitive reduction";
  }
}

void expect_enforces_every_edge(int n, const Edges& edges, const StreamPlan& plan) {
  const Matrix order = closure(n, execution_edges(plan));
  for (const auto& [u, v] : edges) {
    EXPECT_TRUE(order[u][v]) << "edge (" << u << ", " << v << ") is not enforced; "
                             << describe(plan);
  }
}

void expect_every_sync_needed(int n, const StreamPlan& plan) {
  const Edges all = execution_edges(plan);
  for (size_t i = 0; i < plan.syncs.size(); ++i) {
    Edges without = all;
    without.erase(without.begin() + static_cast<std::ptrdiff_t>(i));  // syncs come first
    const auto [u, v] = plan.syncs[i];
    EXPECT_FALSE(reaches(n, without, u, v))
        << "sync (" << u << ", " << v << ") is implied by the others; " << describe(plan);
  }
}

// The full contract without a limit.
void expect_optimal_unlimited(int n, const Edges& edges, const StreamPlan& plan) {
  expect_well_formed(n, plan);
  const Matrix reach = closure(n, edges);
  const Edges reduction = brute_reduction(n, edges);

  // Maximum logical concurrency: nodes on one stream are ordered by the graph.
  for (const auto& members : nodes_by_stream(plan)) {
    for (size_t i = 0; i < members.size(); ++i) {
      for (size_t j = i + 1; j < members.size(); ++j) {
        EXPECT_FALSE(independent(reach, members[i], members[j]))
            << "independent nodes " << members[i] << " and " << members[j]
            << " share a stream; " << describe(plan);
      }
    }
  }
  // Exactly the graph's ordering: nothing missing, nothing added.
  EXPECT_EQ(closure(n, execution_edges(plan)), reach) << describe(plan);

  // Fewest syncs: the cross-stream edges of the reduction, |E'| - |M| of them.
  Edges cross;
  for (const auto& [u, v] : reduction) {
    if (plan.stream_of[u] != plan.stream_of[v]) cross.emplace_back(u, v);
  }
  EXPECT_EQ(plan.syncs, cross);
  EXPECT_EQ(static_cast<int>(plan.syncs.size()),
            static_cast<int>(reduction.size()) - matching_size_of_edges(n, reduction));

  // No two streams could share one without serialising independent nodes.
  const auto members = nodes_by_stream(plan);
  for (int a = 0; a < plan.num_streams; ++a) {
    for (int b = a + 1; b < plan.num_streams; ++b) {
      bool some_independent = false;
      for (int x : members[a]) {
        for (int y : members[b]) some_independent |= independent(reach, x, y);
      }
      EXPECT_TRUE(some_independent) << "streams " << a << " and " << b
                                    << " are totally ordered and could merge; "
                                    << describe(plan);
    }
  }
}

// The contract with a limit, given the plan without one. A correct set of syncs drawn from the
// reduction's edges, none implied by the others, is the smallest such set (sync_plan.h shows
// it is contained in every correct one).
void expect_valid_limited(int n, const Edges& edges, int max_streams, const StreamPlan& unlimited,
                          const StreamPlan& plan) {
  expect_well_formed(n, plan);
  EXPECT_EQ(plan.num_streams, std::min(max_streams, unlimited.num_streams));
  if (unlimited.num_streams <= max_streams) {
    EXPECT_EQ(plan.stream_of, unlimited.stream_of);
    EXPECT_EQ(plan.syncs, unlimited.syncs);
  }
  expect_enforces_every_edge(n, edges, plan);
  expect_syncs_are_reduction_edges(plan, brute_reduction(n, edges));
  expect_every_sync_needed(n, plan);
}

// ---------------------------------------------------------------------------------------------
// Graphs.

// Each forward pair with probability density_percent / 100; a tenth of the edges repeated;
// edges in random order.
Edges random_dag(int n, int density_percent, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> percent(0, 99);
  Edges edges;
  for (int u = 0; u < n; ++u) {
    for (int v = u + 1; v < n; ++v) {
      if (percent(rng) < density_percent) edges.emplace_back(u, v);
    }
  }
  const size_t unique_count = edges.size();
  for (size_t i = 0; i < unique_count; ++i) {
    if (percent(rng) < 10) edges.push_back(edges[i]);
  }
  std::shuffle(edges.begin(), edges.end(), rng);
  return edges;
}

// Inception-like cells: a stem node forks into 2-4 branches of 1-3 nodes that join in a
// concat node; sometimes a residual edge skips a cell, sometimes one branch feeds another.
Edges fork_join_cells(int cells, uint32_t seed, int* num_nodes) {
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Edges edges;
  int n = 1;
  int stem = 0;
  int previous_stem = -1;
  for (int c = 0; c < cells; ++c) {
    std::vector<int> branch_ends;
    std::vector<int> branch_nodes;
    const int branches = uniform(2, 4);
    for (int b = 0; b < branches; ++b) {
      int at = stem;
      for (int k = uniform(1, 3); k > 0; --k) {
        edges.emplace_back(at, n);
        branch_nodes.push_back(n);
        at = n++;
      }
      branch_ends.push_back(at);
    }
    if (uniform(0, 2) == 0) {  // a cross link from an earlier branch node to a later one
      const int a = branch_nodes[uniform(0, static_cast<int>(branch_nodes.size()) - 1)];
      const int b = branch_nodes[uniform(0, static_cast<int>(branch_nodes.size()) - 1)];
      if (a != b) edges.emplace_back(std::min(a, b), std::max(a, b));
    }
    const int concat = n++;
    for (int end : branch_ends) edges.emplace_back(end, concat);
    if (previous_stem >= 0 && uniform(0, 1) == 0) edges.emplace_back(previous_stem, concat);
    previous_stem = stem;
    stem = concat;
  }
  *num_nodes = n;
  return edges;
}

struct GraphCase {
  std::string name;
  int num_nodes = 0;
  Edges edges;
};

std::vector<GraphCase> random_cases() {
  std::vector<GraphCase> cases;
  for (int n : {1, 2, 3, 5, 8, 13, 24, 40, 64}) {
    for (int density : {5, 15, 35, 70}) {
      for (uint32_t seed = 1; seed <= 5; ++seed) {
        cases.push_back({"random_n" + std::to_string(n) + "_density" + std::to_string(density) +
                             "_seed" + std::to_string(seed),
                         n, random_dag(n, density, seed * 7919 + static_cast<uint32_t>(n))});
      }
    }
  }
  for (int cells : {1, 2, 3, 5, 8, 12}) {
    for (uint32_t seed = 1; seed <= 4; ++seed) {
      GraphCase c{"cells" + std::to_string(cells) + "_seed" + std::to_string(seed), 0, {}};
      c.edges = fork_join_cells(cells, seed * 104729 + static_cast<uint32_t>(cells), &c.num_nodes);
      cases.push_back(c);
    }
  }
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    cases.push_back({"random_n120_density4_seed" + std::to_string(seed), 120,
                     random_dag(120, 4, seed)});
    cases.push_back({"random_n200_density2_seed" + std::to_string(seed), 200,
                     random_dag(200, 2, seed)});
  }
  return cases;
}

std::string case_name(const testing::TestParamInfo<GraphCase>& info) { return info.param.name; }
void PrintTo(const GraphCase& c, std::ostream* os) { *os << c.name; }

// ---------------------------------------------------------------------------------------------
// Hand-written graphs with known answers.

struct HandCase {
  std::string name;
  int num_nodes;
  Edges edges;
  int streams;                 // expected num_streams without a limit
  int syncs;                   // expected number of syncs without a limit
  std::vector<int> stream_of;  // expected exactly, when not empty
};

std::vector<HandCase> hand_cases() {
  return {
      {"empty", 0, {}, 0, 0, {}},
      {"one_node", 1, {}, 1, 0, {0}},
      {"no_edges", 4, {}, 4, 0, {0, 1, 2, 3}},
      // A path with every shortcut: the reduction is the path; one stream, no syncs.
      {"chain_with_shortcuts", 4, {{0, 1}, {1, 2}, {2, 3}, {0, 2}, {0, 3}, {1, 3}}, 1, 0,
       {0, 0, 0, 0}},
      // Two branches: four reduced edges, two matched, so two syncs.
      {"diamond", 4, {{0, 1}, {0, 2}, {1, 3}, {2, 3}}, 2, 2, {}},
      {"diamond_duplicate_edges", 4, {{2, 3}, {0, 1}, {0, 2}, {1, 3}, {0, 1}, {2, 3}, {0, 2}},
       2, 2, {}},
      // Greedy matching of x0 to y2 first leaves x1 unmatched; the maximum matches x0-y3 and
      // x1-y2: two streams and one sync, where greedy would give three streams.
      {"needs_maximum_matching", 4, {{0, 2}, {0, 3}, {1, 2}}, 2, 1, {0, 1, 1, 0}},
      // Bowtie: two edges into node 2, two out. Three matched paths; the two lone nodes are
      // ordered (through 2) and merge, so two streams (the width), with 4 - 2 syncs.
      {"bowtie_paths_merge", 5, {{0, 2}, {1, 2}, {2, 3}, {2, 4}}, 2, 2, {}},
      // Inception cell: stem 0; branches 1, 2->3, 4->5->6, 7; concat 8.
      {"inception_cell", 9,
       {{0, 1}, {0, 2}, {2, 3}, {0, 4}, {4, 5}, {5, 6}, {0, 7}, {1, 8}, {3, 8}, {6, 8}, {7, 8}},
       4, 6, {}},
      // Two inception cells of three branches in a row: five matched paths, but each side
      // branch of the second cell runs after one of the first, so three streams.
      {"two_inception_cells", 11,
       {{0, 1}, {0, 2}, {0, 3}, {1, 4}, {2, 4}, {3, 4}, {4, 5}, {4, 6}, {6, 7}, {4, 8},
        {5, 9}, {7, 9}, {8, 9}, {9, 10}},
       3, 8, {}},
      // Three diamonds sharing end points: the matched paths are the trunk and one lone side
      // node per diamond; the side nodes are ordered and merge into one stream.
      {"chain_of_diamonds", 10,
       {{0, 1}, {0, 2}, {1, 3}, {2, 3}, {3, 4}, {3, 5}, {4, 6}, {5, 6}, {6, 7}, {6, 8}, {7, 9},
        {8, 9}},
       2, 6, {}},
  };
}

void PrintTo(const HandCase& c, std::ostream* os) { *os << c.name; }

class HandCases : public testing::TestWithParam<HandCase> {};

TEST_P(HandCases, MatchesKnownAnswerAndOracles) {
  const HandCase& c = GetParam();
  const StreamPlan plan = assign_streams(c.num_nodes, c.edges);
  EXPECT_EQ(plan.num_streams, c.streams) << describe(plan);
  EXPECT_EQ(static_cast<int>(plan.syncs.size()), c.syncs) << describe(plan);
  if (!c.stream_of.empty()) {
    EXPECT_EQ(plan.stream_of, c.stream_of);
  }
  expect_optimal_unlimited(c.num_nodes, c.edges, plan);
  for (int k = 1; k <= c.num_nodes + 1; ++k) {
    SCOPED_TRACE("max_streams=" + std::to_string(k));
    expect_valid_limited(c.num_nodes, c.edges, k, plan, assign_streams(c.num_nodes, c.edges, k));
  }
}

INSTANTIATE_TEST_SUITE_P(StreamAssignment, HandCases, testing::ValuesIn(hand_cases()),
                         [](const testing::TestParamInfo<HandCase>& info) {
                           return info.param.name;
                         });

// The worked example of stream_limit.h, end to end.
TEST(StreamLimit, WorkedExampleKeepsTheTrunkAlone) {
  const Edges edges = {{0, 1}, {1, 2}, {2, 3}, {3, 7}, {0, 4}, {4, 5}, {5, 7}, {2, 6}, {6, 7}};
  const StreamPlan unlimited = assign_streams(8, edges);
  ASSERT_EQ(unlimited.stream_of, (std::vector<int>{0, 0, 0, 0, 1, 1, 2, 0}));
  const StreamPlan plan = assign_streams(8, edges, 2);
  EXPECT_EQ(plan.stream_of, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 0}));
  expect_valid_limited(8, edges, 2, unlimited, plan);
}

// ---------------------------------------------------------------------------------------------
// Random graphs against the oracles.

class RandomGraphs : public testing::TestWithParam<GraphCase> {};

TEST_P(RandomGraphs, UnlimitedPlanIsOptimal) {
  const GraphCase& c = GetParam();
  expect_optimal_unlimited(c.num_nodes, c.edges, assign_streams(c.num_nodes, c.edges));
}

TEST_P(RandomGraphs, LimitedPlansAreCorrectWithFewestNeededSyncs) {
  const GraphCase& c = GetParam();
  const StreamPlan unlimited = assign_streams(c.num_nodes, c.edges);
  std::set<int> limits = {1, 2, 3, 5};
  if (unlimited.num_streams > 1) limits.insert(unlimited.num_streams - 1);
  limits.insert(unlimited.num_streams + 1);
  for (int k : limits) {
    SCOPED_TRACE("max_streams=" + std::to_string(k));
    expect_valid_limited(c.num_nodes, c.edges, k, unlimited,
                         assign_streams(c.num_nodes, c.edges, k));
  }
}

TEST_P(RandomGraphs, StreamsAreAtLeastTheWidth) {
  // Dilworth: the fewest chains covering the nodes is the largest antichain, computed as
  // n - (maximum matching in the closure). No plan with maximum concurrency can go below it.
  const GraphCase& c = GetParam();
  const Matrix reach = closure(c.num_nodes, c.edges);
  std::vector<std::vector<int>> adj(c.num_nodes);
  for (int u = 0; u < c.num_nodes; ++u) {
    for (int v = 0; v < c.num_nodes; ++v) {
      if (reach[u][v]) adj[u].push_back(v);
    }
  }
  const int width = c.num_nodes - kuhn_matching_size(c.num_nodes, adj);
  EXPECT_GE(assign_streams(c.num_nodes, c.edges).num_streams, width);
}

TEST_P(RandomGraphs, TransitiveReductionMatchesOracleInAnyBlockSize) {
  const GraphCase& c = GetParam();
  const Edges expected = brute_reduction(c.num_nodes, c.edges);
  const Dag dag = build_dag(c.num_nodes, c.edges);
  EXPECT_EQ(edge_list(transitive_reduction(dag)), expected);
  // One byte of budget forces blocks of 64 columns.
  EXPECT_EQ(edge_list(transitive_reduction(dag, 1)), expected);
}

TEST_P(RandomGraphs, PlanIsDeterministicAndIgnoresEdgeOrder) {
  const GraphCase& c = GetParam();
  Edges shuffled = c.edges;
  std::reverse(shuffled.begin(), shuffled.end());
  const StreamPlan a = assign_streams(c.num_nodes, c.edges, 3);
  const StreamPlan b = assign_streams(c.num_nodes, shuffled, 3);
  EXPECT_EQ(a.stream_of, b.stream_of);
  EXPECT_EQ(a.syncs, b.syncs);
}

INSTANTIATE_TEST_SUITE_P(StreamAssignment, RandomGraphs, testing::ValuesIn(random_cases()),
                         case_name);

// ---------------------------------------------------------------------------------------------
// Components on their own.

TEST(BipartiteMatching, MatchesOracleOnRandomBitsetGraphs) {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    const int left = 1 + trial % 37;
    const int right = 1 + (trial * 7) % 41;
    const int density = 1 + trial % 60;
    const int64_t words = (right + 63) / 64;
    std::vector<uint64_t> rows(static_cast<size_t>(left * words), 0);
    std::vector<std::vector<int>> adj(left);
    for (int u = 0; u < left; ++u) {
      for (int v = 0; v < right; ++v) {
        if (static_cast<int>(rng() % 100) < density) {
          rows[u * words + v / 64] |= uint64_t{1} << (v % 64);
          adj[u].push_back(v);
        }
      }
    }
    const std::vector<int> match =
        max_bipartite_matching(left, right, BitsetAdjacency{rows.data(), words});
    int size = 0;
    std::vector<char> used(right, 0);
    for (int u = 0; u < left; ++u) {
      const int v = match[u];
      if (v < 0) continue;
      ++size;
      ASSERT_TRUE(std::count(adj[u].begin(), adj[u].end(), v)) << "not an edge";
      ASSERT_FALSE(used[v]) << "right vertex matched twice";
      used[v] = 1;
    }
    EXPECT_EQ(size, kuhn_matching_size(right, adj)) << "trial " << trial;
  }
}

// Adjacency lists for the matching template, as in the concept of bipartite_matching.h.
struct ListAdjacency {
  const std::vector<std::vector<int>>* lists;
  int neighbour(int u, int64_t& cursor) const {
    const auto& list = (*lists)[u];
    return cursor < static_cast<int64_t>(list.size()) ? list[cursor] : -1;
  }
};

TEST(BipartiteMatching, LongAugmentingPathsDoNotOverflowTheStack) {
  // Left i < m is adjacent to rights i and i + 1, left m only to right 0. The greedy start
  // matches left i to right i, so the last augmenting path runs through all 2m + 1 vertices.
  const int m = 200000;
  std::vector<std::vector<int>> lists(m + 1);
  for (int i = 0; i < m; ++i) lists[i] = {i, i + 1};
  lists[m] = {0};
  const std::vector<int> match = max_bipartite_matching(m + 1, m + 1, ListAdjacency{&lists});
  EXPECT_EQ(match[m], 0);
  EXPECT_EQ(match[m - 1], m);
  EXPECT_EQ(std::count(match.begin(), match.end(), -1), 0);
}

TEST(Reachability, SweepFindsTargetsTwoOrMoreEdgesAwayInAnyBlockSize) {
  // A subset of the nodes as targets, so columns are not node ids; 150 targets and a budget
  // of one byte make three blocks of 64 columns.
  const int n = 300;
  const Edges edges = random_dag(n, 3, 99);
  const Dag dag = build_dag(n, edges);
  const Matrix reach = closure(n, edges);
  std::vector<int> targets;
  for (int v = 0; v < n; v += 2) targets.push_back(v);
  for (int64_t budget : {int64_t{1}, kDefaultSweepBytes}) {
    std::vector<std::set<int>> found(n);
    std::vector<int> visits(n, 0);
    sweep_reachable_targets(
        dag, targets,
        [&](int u, const ColumnBlock& block) {
          ++visits[u];
          for (int c = block.begin; c < block.end; ++c) {
            if (block.test(c)) found[u].insert(targets[c]);
          }
        },
        budget);
    for (int u = 0; u < n; ++u) {
      std::set<int> expected;
      for (int w : dag.successors(u)) {
        for (int t : targets) {
          if (reach[w][t]) expected.insert(t);
        }
      }
      EXPECT_EQ(found[u], expected) << "node " << u << ", budget " << budget;
    }
    EXPECT_EQ(*std::max_element(visits.begin(), visits.end()), budget == 1 ? 3 : 1);
  }
}

TEST(ChainCover, MergeFallsBackToPathsAboveItsMemoryBudget) {
  const Dag reduced = transitive_reduction(build_dag(5, {{0, 2}, {1, 2}, {2, 3}, {2, 4}}));
  const Cover paths = path_cover(reduced);
  ASSERT_EQ(paths.num_groups, 3);
  EXPECT_EQ(merge_ordered_paths(reduced, paths, 0).group_of, paths.group_of);
  EXPECT_EQ(merge_ordered_paths(reduced, paths).num_groups, 2);
}

TEST(SyncPlan, WithoutRoomForClocksAllCrossStreamEdgesAreKept) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const int n = 30;
    const Edges edges = random_dag(n, 20, seed);
    const Dag reduced = transitive_reduction(build_dag(n, edges));
    StreamPlan plan;
    plan.num_streams = 3;
    for (int v = 0; v < n; ++v) plan.stream_of.push_back(v % 3 == 0 ? 0 : 1 + (v * 7 + 3) % 2);
    plan.syncs = minimal_syncs(reduced, plan.stream_of, plan.num_streams, 0);
    EXPECT_EQ(plan.syncs, cross_stream_edges(reduced, plan.stream_of));
    expect_enforces_every_edge(n, edges, plan);
    // With room, the same assignment needs only the syncs that are not implied.
    plan.syncs = minimal_syncs(reduced, plan.stream_of, plan.num_streams);
    expect_enforces_every_edge(n, edges, plan);
    expect_every_sync_needed(n, plan);
  }
}

TEST(StreamAssignment, LargeGraphKeepsTheContract) {
  // Too big for the O(n^3) oracles; checks what is cheap: a valid partition, one stream per
  // chain, and |syncs| = |E'| - |M| with E' and M from the components.
  const int n = 3000;
  std::mt19937 rng(7);
  Edges edges;
  for (int i = 0; i < 15000; ++i) {
    const int u = static_cast<int>(rng() % (n - 1));
    const int v = u + 1 + static_cast<int>(rng() % std::min(n - 1 - u, 60));
    edges.emplace_back(u, v);
  }
  const StreamPlan plan = assign_streams(n, edges);
  expect_well_formed(n, plan);
  const Dag reduced = transitive_reduction(build_dag(n, edges));
  int64_t matched = 0;
  path_cover(reduced, &matched);
  EXPECT_EQ(static_cast<int64_t>(plan.syncs.size()), reduced.num_edges() - matched);
  const StreamPlan limited = assign_streams(n, edges, 4);
  expect_well_formed(n, limited);
  EXPECT_EQ(limited.num_streams, std::min(4, plan.num_streams));
}

// ---------------------------------------------------------------------------------------------
// Bad input.

struct ErrorCase {
  std::string name;
  int num_nodes;
  Edges edges;
  int max_streams;
  std::string message;  // must appear in what()
};

void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }

class BadInput : public testing::TestWithParam<ErrorCase> {};

TEST_P(BadInput, ThrowsInvalidArgumentSayingWhatWasWrong) {
  const ErrorCase& c = GetParam();
  try {
    assign_streams(c.num_nodes, c.edges, c.max_streams);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(
    StreamAssignment, BadInput,
    testing::Values(
        ErrorCase{"backward_edge", 10, {{0, 1}, {2, 3}, {1, 2}, {3, 4}, {7, 3}}, 0,
                  "edge 4 (7, 3) must go forward in the topological numbering (u < v); "
                  "got u=7 >= v=3"},
        ErrorCase{"self_loop", 3, {{1, 1}}, 0, "edge 0 (1, 1) must go forward"},
        ErrorCase{"target_out_of_range", 3, {{0, 1}, {1, 3}}, 0,
                  "edge 1 (1, 3) has a node id out of range: ids must be in [0, 3); got 3"},
        ErrorCase{"negative_id", 3, {{-1, 2}}, 0,
                  "edge 0 (-1, 2) has a node id out of range: ids must be in [0, 3); got -1"},
        ErrorCase{"edge_in_empty_graph", 0, {{0, 1}}, 0, "ids must be in [0, 0)"},
        ErrorCase{"negative_num_nodes", -2, {}, 0, "num_nodes must be >= 0; got -2"},
        ErrorCase{"negative_limit", 3, {{0, 1}}, -1,
                  "max_streams must be >= 0 (0 means no limit); got -1"}),
    [](const testing::TestParamInfo<ErrorCase>& info) { return info.param.name; });

}  // namespace
}  // namespace nimble_train::streams
