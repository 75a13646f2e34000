// Which of a chosen set of target nodes each node reaches, swept in memory-bounded blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "streams/dag.h"

namespace nimble_train::streams {

// Bitset rows of this many bytes in all, at most, for one block of target columns: 32 MiB
// holds all 10,000 columns of a 10,000-node graph at once (12.5 MB), and keeps a 100,000-node
// graph to blocks of 2,624 columns instead of 1.25 GB.
constexpr int64_t kDefaultSweepBytes = int64_t{32} << 20;

// One block of target columns [begin, end) of one node's row. Columns are indices into the
// target list; `begin` is a multiple of 64, so bit c - begin of the row is word (c - begin) / 64.
struct ColumnBlock {
  const uint64_t* words = nullptr;
  int begin = 0;
  int end = 0;

  bool covers(int column) const { return column >= begin && column < end; }
  // Requires covers(column).
  bool test(int column) const {
    const int bit = column - begin;
    return (words[bit >> 6] >> (bit & 63)) & 1;
  }
};

// For every block of target columns, and every node u before the block's last target (later
// nodes reach none of its targets), in decreasing order of u, calls visit(u, block) where
// `block` holds the targets that u reaches by a path of two or more edges. Adding the targets
// among u's own successors gives everything u reaches.
//
// `targets` must be ascending node ids; a target's column is its index in `targets`. Rows are
// built in reverse topological order, row(u) = OR of row(w) | {w} over successors w, so one
// block costs O(num_edges * block_columns / 64) word operations. A successor w's row is zero
// below the first column that can follow w, so those words are skipped: on average that
// halves the work.
template <class Visit>
void sweep_reachable_targets(const Dag& dag, const std::vector<int>& targets, Visit&& visit,
                             int64_t max_bytes = kDefaultSweepBytes) {
  const int n = dag.num_nodes;
  const int num_columns = static_cast<int>(targets.size());
  if (n == 0 || num_columns == 0) return;

  // column_of[v]: v's column, or -1. first_column_after[v]: the lowest column whose node can be
  // reached from v, i.e. the number of targets <= v.
  std::vector<int> column_of(n, -1);
  for (int c = 0; c < num_columns; ++c) column_of[targets[c]] = c;
  std::vector<int> first_column_after(n);
  for (int v = 0, c = 0; v < n; ++v) {
    while (c < num_columns && targets[c] <= v) ++c;
    first_column_after[v] = c;
  }

  const int64_t budget_columns = std::max<int64_t>(64, max_bytes * 8 / n / 64 * 64);
  const int block_columns =
      static_cast<int>(std::min<int64_t>(budget_columns, (num_columns + 63) / 64 * 64));
  const int words = block_columns / 64;
  std::vector<uint64_t> rows(static_cast<size_t>(n) * words);

  for (int begin = 0; begin < num_columns; begin += block_columns) {
    const int end = std::min(num_columns, begin + block_columns);
    // Only nodes before the block's last target can reach any target of the block.
    const int last_target = targets[end - 1];
    std::fill(rows.begin(), rows.begin() + static_cast<size_t>(last_target) * words, 0);
    for (int u = last_target - 1; u >= 0; --u) {
      uint64_t* row = rows.data() + static_cast<size_t>(u) * words;
      for (int w : dag.successors(u)) {
        if (w >= last_target) break;  // successors ascend; later rows are empty in this block
        const uint64_t* from = rows.data() + static_cast<size_t>(w) * words;
        for (int k = std::max(0, first_column_after[w] - begin) / 64; k < words; ++k) {
          row[k] |= from[k];
        }
      }
      visit(u, ColumnBlock{row, begin, end});
      for (int w : dag.successors(u)) {
        const int c = column_of[w];
        if (c >= begin && c < end) row[(c - begin) >> 6] |= uint64_t{1} << ((c - begin) & 63);
      }
    }
  }
}

}  // namespace nimble_train::streams
