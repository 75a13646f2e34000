#include "streams/stream_assignment.h"

#include <utility>

#include "common/check.h"
#include "streams/chain_cover.h"
#include "streams/dag.h"
#include "streams/stream_limit.h"
#include "streams/sync_plan.h"
#include "streams/transitive_reduction.h"

namespace nimble_train::streams {

StreamPlan assign_streams(int num_nodes, const std::vector<std::pair<int, int>>& edges,
                          int max_streams) {
  NT_CHECK(max_streams >= 0, "max_streams must be >= 0 (0 means no limit); got ", max_streams);
  const Dag reduced = transitive_reduction(build_dag(num_nodes, edges));
  Cover streams = merge_ordered_paths(reduced, path_cover(reduced));

  StreamPlan plan;
  if (max_streams > 0 && streams.num_groups > max_streams) {
    streams = fold_into_streams(reduced, streams, max_streams);
    plan.syncs = minimal_syncs(reduced, streams.group_of, streams.num_groups);
  } else {
    plan.syncs = cross_stream_edges(reduced, streams.group_of);
  }
  plan.stream_of = std::move(streams.group_of);
  plan.num_streams = streams.num_groups;
  return plan;
}

}  // namespace nimble_train::streams
