// The synchronisations a stream assignment needs: which edges get an event wait.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "streams/dag.h"

namespace nimble_train::streams {

// The edges of `reduced` whose ends lie on different streams, sorted: waiting on all of them
// is always enough. When every stream is a chain of the graph (a plan with maximum logical
// concurrency), each of them is also needed: stream order then orders only pairs the graph
// orders, so any other route from u to v would be a path of two or more edges, and (u, v)
// would not be in the transitive reduction.
std::vector<std::pair<int, int>> cross_stream_edges(const Dag& reduced,
                                                    const std::vector<int>& stream_of);

// The fewest edges of `reduced` to wait on so that stream order (each stream runs its nodes
// in increasing number) plus the waits order every edge of the graph; sorted. Ordering the
// edges of the transitive reduction orders all edges, and waiting only on them adds no
// ordering the graph does not already have.
//
// Nodes are visited in increasing number, with a vector clock each: clock[v][s] is the last
// position on stream s known to finish before v starts, through stream order and the waits
// chosen so far. An edge (u, v) across streams needs a wait unless v's clock already covers u.
// v's incoming edges are tried from the latest u down, because a wait on u brings in u's whole
// clock and only a later node's clock can cover u (edges go forward). By induction over v,
// every wait chosen this way is in every valid set of waits on reduced edges, so the result is
// the unique smallest such set: no wait can be dropped, and no other choice needs fewer.
//
// The clocks take num_nodes * num_streams * 4 bytes; beyond `max_clock_bytes` the result is
// cross_stream_edges (correct, but without pruning).
std::vector<std::pair<int, int>> minimal_syncs(const Dag& reduced,
                                               const std::vector<int>& stream_of, int num_streams,
                                               int64_t max_clock_bytes = int64_t{64} << 20);

}  // namespace nimble_train::streams
