// The transitive reduction of a DAG: the fewest edges with the same reachability.
#pragma once

#include <cstdint>

#include "streams/dag.h"
#include "streams/reachability.h"

namespace nimble_train::streams {

// Keeps edge (u, v) unless v is also reachable from u by a path of two or more edges. For a
// DAG the result is unique and is also its minimum equivalent graph (Nimble's G'). Runs in
// O(num_edges * num_nodes / 64) word operations, with at most `max_bytes` of bitsets.
Dag transitive_reduction(const Dag& dag, int64_t max_bytes = kDefaultSweepBytes);

}  // namespace nimble_train::streams
