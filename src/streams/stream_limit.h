// Folding a plan's streams into at most a given number, serialising as little as it can.
#pragma once

#include "streams/chain_cover.h"
#include "streams/dag.h"

namespace nimble_train::streams {

// Merges the groups of `chains` (streams of a plan with maximum logical concurrency, each a
// chain of `reduced`) into exactly min(max_streams, chains.num_groups) groups, numbered by
// first node. Requires max_streams >= 1.
//
// What a merge loses. Give every node its level, the length of the longest path that ends at
// it: with one time unit per operator and unlimited streams, the node runs during step `level`.
// Two nodes on one level never depend on each other, and in that schedule they run at the same
// time, so each pair of same-level nodes put on one stream is a step of overlap the merge
// gives up. The cost of adding a group to a stream is the number of such pairs it creates: the
// number of the stream's nodes that share a level with one of the group's nodes. (Pairs on
// different levels that could overlap in another schedule are not counted: the measure is of
// the schedule the plan would otherwise run.)
//
// How the merge is chosen. Groups are placed largest first (ties: earliest first node), each
// onto the stream where it costs least; ties go to the stream with fewer nodes, which keeps
// the long trunk of a network free of side branches, and then to the lower stream. The first
// max_streams groups each open a stream of their own, at no cost.
//
// Worked example, max_streams = 2, a fork-join cell whose streams without a limit are
//   A = {0, 1, 2, 3, 7} on levels 0 1 2 3 4   (the trunk: 0 -> 1 -> 2 -> 3 -> 7)
//   B = {4, 5}          on levels   1 2       (0 -> 4 -> 5 -> 7)
//   C = {6}             on level        3     (2 -> 6 -> 7)
// A opens stream 0 and B stream 1, at no cost. C would share level 3 with node 3 on stream 0
// (cost 1) and no level with stream 1 (cost 0), so C joins B: stream 1 runs 4, 5, 6, which in
// the unit-time schedule run at steps 1, 2, 3 anyway, whereas on stream 0, 3 and 6 (both ready
// at step 3) would wait for each other.
//
// O(num_nodes * max_streams) time, O(num_nodes + num_edges) memory.
Cover fold_into_streams(const Dag& reduced, const Cover& chains, int max_streams);

}  // namespace nimble_train::streams
