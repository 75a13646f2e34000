// Nimble's stream assignment: which CUDA stream runs each operator, and where streams wait.
#pragma once

#include <utility>
#include <vector>

namespace nimble_train::streams {

struct StreamPlan {
  std::vector<int> stream_of;              // one entry per node, in [0, num_streams)
  int num_streams = 0;
  std::vector<std::pair<int, int>> syncs;  // edges (u, v): v's stream waits on u's event
};

// Nodes are numbered in a topological order: every edge (u, v) has u < v.
// On each stream, nodes run in increasing number. max_streams == 0: no limit.
//
// The plan (Nimble, NeurIPS 2020, section 4.2, then one step further):
//  1. G' = the transitive reduction of the graph (its minimum equivalent graph), E' its edges.
//  2. A maximum matching M, by Hopcroft-Karp, of the bipartite graph with an edge x_u -> y_v
//     for each edge (u, v) of G'. The matched edges link the nodes into |V| - |M| paths of G'.
//  3. Paths that are totally ordered (the last node of one reaches the first of the other)
//     share a stream: a second maximum matching, over the "comes before" order of the paths,
//     merges them into the fewest such streams (Dilworth; chain_cover.h).
//  4. syncs = the edges of G' whose ends are on different streams.
//
// Without a limit, or with one that is not below the number of streams of step 3:
//  - maximum logical concurrency: two nodes share a stream only if one reaches the other;
//  - stream order plus syncs order exactly the pairs the graph orders, nothing more;
//  - syncs is exactly E' \ M, so |syncs| = |E'| - |M| (Theorem 3): the fewest of any plan with
//    maximum logical concurrency (Theorem 4). Merging in step 3 leaves this unchanged: a G'
//    edge between two merged paths would have to run from the last node of one to the first
//    of the other, and M plus that edge would be a larger matching; and no sync becomes
//    redundant, since stream order still only orders pairs that the graph orders;
//  - no two streams could be merged without serialising two independent nodes. That is
//    usually, but not always, the graph's width (its largest set of pairwise independent
//    nodes): step 3 keeps whole the paths of the one maximum matching that step 2 found.
//  - streams are numbered by their first node (node 0 is on stream 0).
//
// With a limit below that number, the streams of step 3 are folded into exactly max_streams
// streams, serialising as few node pairs that would otherwise run at the same time as the
// greedy of stream_limit.h can (see there for the measure and a worked example). syncs is
// then the smallest set of G' edges that, with stream order, orders every edge of the graph
// (sync_plan.h): every dependency is enforced, no sync is implied by the others, and each is
// a real dependency (an edge of G'), never one that folding created.
//
// Input: num_nodes >= 0, max_streams >= 0, every edge within [0, num_nodes) and going forward
// (u < v, so no self-loops). Duplicate edges count once. Anything else throws
// std::invalid_argument (nimble_train::InvalidArgument) naming the offending value. syncs is
// sorted. An empty graph gives an empty plan with num_streams == 0.
//
// Cost: step 1 takes O(|E| |V| / 64) word operations on bitsets of at most 32 MiB (a
// 10^4-node graph fits in one 12.5 MB pass); step 2 O(|E'| sqrt(|V|)); step 3 a relation of
// (number of paths)^2 / 8 bytes, skipped above 64 MiB (about 23,000 paths), where the plan keeps
// the unmerged paths. A random 10^4-node, 5 * 10^4-edge graph takes about 15 ms
// (bench/bench_stream_assignment.cpp).
StreamPlan assign_streams(int num_nodes, const std::vector<std::pair<int, int>>& edges,
                          int max_streams = 0);

}  // namespace nimble_train::streams
