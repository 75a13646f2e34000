// Covers of a DAG's nodes by chains, the streams of a plan with maximum logical concurrency.
#pragma once

#include <cstdint>
#include <vector>

#include "streams/dag.h"

namespace nimble_train::streams {

// A partition of the nodes into groups; each group is meant to run on one stream.
struct Cover {
  std::vector<int> group_of;  // [num_nodes] group id in [0, num_groups)
  int num_groups = 0;
};

// Nimble's steps 2-5 on the transitive reduction `reduced` (G'): a maximum matching of the
// bipartite graph with an edge x_u -> y_v per edge (u, v) of G' links each node to at most one
// successor and one predecessor, and the links form vertex-disjoint paths of G'. Each path is a
// group. Every path of G' is a chain (its nodes are totally ordered), and no cover by paths of
// G' has fewer groups: there are num_nodes - |matching| of them. Groups are numbered by their
// first node. `matched_edges` receives the size of the matching.
Cover path_cover(const Dag& reduced, int64_t* matched_edges = nullptr);

// Merges groups of `paths` (the result of path_cover on `reduced`) whose union stays a chain,
// so the plan keeps its concurrency on fewer streams.
//
// Path A must come before path B (A < B) when the last node of A reaches the first node of B;
// then every node of A reaches every node of B. Two paths of G' can share a stream without
// serialising anything only if one comes before the other: a node of B between two
// consecutive nodes of A would contradict that the edge between them is in G'. "Comes
// before" is a partial order on the paths, so by Dilworth's theorem the fewest merged streams
// is the number of paths minus a maximum matching in the bipartite graph with an edge A -> B
// for every A < B; each matched edge chains B after A.
//
// The relation takes (number of paths)^2 / 8 bytes; above `max_relation_bytes` the paths are
// returned unmerged (still a correct plan, only with more streams). Groups are numbered by
// their first node.
Cover merge_ordered_paths(const Dag& reduced, const Cover& paths,
                          int64_t max_relation_bytes = int64_t{64} << 20);

// Renumbers groups in order of their first node (node 0 is in group 0), dropping unused ids.
Cover numbered_by_first_node(const std::vector<int>& group_of);

}  // namespace nimble_train::streams
