// A captured graph's memset nodes as kernel nodes.
//
// cudaGraphLaunch hands a graph whose nodes are all kernels to the GPU in one cheap submission.
// A graph that mixes kernel nodes with memset nodes it launches at a cost of microseconds of
// host time per node: cuDNN's convolutions and batch norms enqueue memsets between their
// kernels (zeroing workspaces), so the launch of a captured ResNet-18 step took the host about
// as long as the step took the GPU, and the GPU waited for it between steps. Measured on an
// H100 (driver 580, CUDA 13, torch 2.11.0+cu130; host microseconds per cudaGraphLaunch, 50
// launches back to back): 20 cuDNN convolutions, 40 nodes (20 of them memsets), 232 µs, the
// same graph with the memsets as kernels 14 µs; 20 memsets alone 4 µs, 20 kernels alone 3 µs;
// torch's hand-written whole-step ResNet-18 graph (b32) 2015 µs, against 2367 µs per step on
// the GPU.
//
// memsets_as_kernels() replaces each memset node of a graph, before it is instantiated, with a
// kernel node that writes the same bytes (a row at a time, 16-byte stores where the row allows)
// and has the same dependencies and dependents. Nodes inside child graphs are left as they are
// (a capture makes none).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace nimble_train::capture {

// What a memset node writes (cudaMemsetParams): `height` rows of `width` elements of
// `element_size` bytes (1, 2 or 4), `pitch` bytes apart, each the low element_size bytes of
// `value`.
struct MemsetShape {
  void* dst = nullptr;
  size_t pitch = 0;
  uint32_t value = 0;
  uint32_t element_size = 1;
  size_t width = 0;
  size_t height = 1;

  static MemsetShape of(const cudaMemsetParams& p) {
    return {p.dst, p.pitch, p.value, p.elementSize, p.width, p.height};
  }
};

// The 32-bit pattern whose byte k (little-endian) is the byte a memset writes at any address
// a with a % 4 == k: the element's bytes repeated (elements are aligned to their size).
uint32_t memset_pattern(uint32_t value, uint32_t element_size);

// Enqueues the kernel that writes `m` on `stream` (outside a graph: for the tests).
void launch_memset_kernel(const MemsetShape& m, cudaStream_t stream);

// Replaces the memset nodes of `graph` (not instantiated yet) with kernel nodes; returns how
// many it replaced. `device`: the graph's device. Throws (NimbleError) when CUDA refuses an
// edit; the graph is then only fit to be destroyed.
int64_t memsets_as_kernels(cudaGraph_t graph, int device);

}  // namespace nimble_train::capture
