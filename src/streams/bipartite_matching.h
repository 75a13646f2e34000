// Maximum bipartite matching (Hopcroft–Karp) over any adjacency that can list neighbours.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "streams/dag.h"

namespace nimble_train::streams {

// Adjacency concept: `int neighbour(int u, int64_t& cursor) const` returns the first neighbour
// of left vertex u at or after position `cursor` of u's list and moves `cursor` onto it, or
// returns -1 when there is none. Starting at cursor 0 and stepping ++cursor lists each
// neighbour once. A cursor lets one DFS resume where it stopped without copying lists.

// A Dag's successor lists: left vertex u is adjacent to right vertex v for each edge (u, v).
struct DagAdjacency {
  const Dag* dag;
  int neighbour(int u, int64_t& cursor) const {
    const NodeRange next = dag->successors(u);
    return cursor < next.size() ? next.first[cursor] : -1;
  }
};

// Bitset rows: left vertex u is adjacent to right vertex v when bit v of row u is set.
struct BitsetAdjacency {
  const uint64_t* rows;  // [num_left * words_per_row]
  int64_t words_per_row;
  int neighbour(int u, int64_t& cursor) const {
    const uint64_t* row = rows + u * words_per_row;
    int64_t k = cursor >> 6;
    if (k >= words_per_row) return -1;
    uint64_t word = row[k] & (~uint64_t{0} << (cursor & 63));
    while (word == 0) {
      if (++k == words_per_row) return -1;
      word = row[k];
    }
    cursor = k * 64 + __builtin_ctzll(word);
    return static_cast<int>(cursor);
  }
};

// Returns match[u] = the right vertex matched to left vertex u, or -1, for a matching of
// maximum size. O(E * sqrt(V)): each phase finds a maximal set of vertex-disjoint shortest
// augmenting paths; there are O(sqrt(V)) phases. The search is iterative, so paths as long as
// the graph (10^4 nodes and more) cannot overflow the call stack.
template <class Adjacency>
std::vector<int> max_bipartite_matching(int num_left, int num_right, const Adjacency& adj) {
  constexpr int kUnreached = std::numeric_limits<int>::max();
  std::vector<int> match_left(num_left, -1);
  std::vector<int> match_right(num_right, -1);

  // A greedy start usually matches most vertices, leaving few phases.
  for (int u = 0; u < num_left; ++u) {
    int64_t cursor = 0;
    for (int v; (v = adj.neighbour(u, cursor)) >= 0; ++cursor) {
      if (match_right[v] < 0) {
        match_left[u] = v;
        match_right[v] = u;
        break;
      }
    }
  }

  std::vector<int> dist(num_left);
  std::vector<int> queue;
  std::vector<int64_t> cursor(num_left);
  std::vector<int> stack;
  for (;;) {
    // Layer the left vertices by their distance from a free left vertex along alternating
    // paths; `free_dist` is the length of the shortest augmenting path.
    queue.clear();
    for (int u = 0; u < num_left; ++u) {
      dist[u] = match_left[u] < 0 ? 0 : kUnreached;
      if (dist[u] == 0) queue.push_back(u);
    }
    int free_dist = kUnreached;
    for (size_t head = 0; head < queue.size(); ++head) {
      const int u = queue[head];
      if (dist[u] >= free_dist) continue;
      int64_t c = 0;
      for (int v; (v = adj.neighbour(u, c)) >= 0; ++c) {
        const int w = match_right[v];
        if (w < 0) {
          if (free_dist == kUnreached) free_dist = dist[u] + 1;
        } else if (dist[w] == kUnreached) {
          dist[w] = dist[u] + 1;
          queue.push_back(w);
        }
      }
    }
    if (free_dist == kUnreached) break;

    // Depth-first search along the layers from every free left vertex. The stack holds the
    // left vertices of the current path; cursor[u] points at the edge the path leaves u by.
    std::fill(cursor.begin(), cursor.end(), 0);
    for (int root = 0; root < num_left; ++root) {
      if (match_left[root] >= 0) continue;
      stack.assign(1, root);
      while (!stack.empty()) {
        const int u = stack.back();
        const int v = adj.neighbour(u, cursor[u]);
        if (v < 0) {  // dead end: no augmenting path passes through u in this phase
          dist[u] = kUnreached;
          stack.pop_back();
          if (!stack.empty()) ++cursor[stack.back()];
          continue;
        }
        const int w = match_right[v];
        if (w < 0 && dist[u] + 1 == free_dist) {
          // Flip the path: each left vertex on the stack takes the right vertex it leads to.
          for (int u_on_path : stack) {
            const int v_next = adj.neighbour(u_on_path, cursor[u_on_path]);
            match_left[u_on_path] = v_next;
            match_right[v_next] = u_on_path;
          }
          stack.clear();
        } else if (w >= 0 && dist[w] == dist[u] + 1) {
          stack.push_back(w);
        } else {
          ++cursor[u];
        }
      }
    }
  }
  return match_left;
}

}  // namespace nimble_train::streams
