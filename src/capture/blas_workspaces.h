// The cuBLAS workspaces a step's captures use, owned by the step graph for its lifetime.
//
// cuBLAS and cuBLASLt work in a workspace that torch allocates once per (handle, stream) and
// keeps in a map; a captured matrix product's kernels read and write that workspace at every
// replay. Torch frees the map's workspaces in torch._C._cuda_clearCublasWorkspaces(), which
// torch.compile's reduce-overhead mode (cudagraph trees) calls around each of its warm-ups and
// recordings. A live step graph then wrote into memory the allocator had handed to other
// tensors (H200, torch 2.11: a 3-layer MLP's graph overwrote 2 M elements of tensors allocated
// after the clearing, a BERT-base graph 96) or that empty_cache() had returned to the driver
// (ResNet-18: an illegal memory access at the next replay).
//
// So the step graph takes them: at the end of each capture (while it is open, when streams
// still say which capture they belong to) every workspace of a stream that took part moves out
// of torch's maps into the step graph, which frees them when it is released. Torch allocates a
// fresh workspace when such a stream next runs a product outside the graphs. Before the next
// capture the held workspaces are lent back under their keys (where torch holds none), so that
// the graphs of one step share them as they shared torch's: they never run at once.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace nimble_train::capture {

class BlasWorkspaces {
 public:
  BlasWorkspaces();
  ~BlasWorkspaces();
  BlasWorkspaces(const BlasWorkspaces&) = delete;
  BlasWorkspaces& operator=(const BlasWorkspaces&) = delete;

  // Before a capture: every held workspace back into its map, unless torch holds one under
  // its key already.
  void lend();
  // At the end of capture `capture_id`, while it is still open: takes back what was lent and
  // takes every workspace of a stream in that capture.
  void take(unsigned long long capture_id);
  // After a capture that failed (it may have ended): takes back what was lent.
  void take_lent();
  // Frees them; only once no graph that may use them can run.
  void clear();

  size_t size() const { return held_.size(); }
  std::vector<void*> addresses() const;  // where each held workspace lies

 private:
  struct Held;  // a workspace, its map and key (torch's types stay in the .cpp)

  void take_from(int map, const unsigned long long* capture_id);
  void forget_lost();

  std::vector<std::unique_ptr<Held>> held_;
};

}  // namespace nimble_train::capture
