// Memset nodes as kernel nodes (see graph_nodes.h). The kernel writes each row's 16-byte-
// aligned middle with 16-byte stores, striding over it, and its unaligned head and tail (fewer
// than 16 bytes each) a byte at a time in the first block.
#include "capture/graph_nodes.h"

#include <algorithm>
#include <vector>

#include "common/cuda_check.h"

namespace nimble_train::capture {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    memset_kernel(unsigned char* dst, size_t pitch, uint32_t pattern, size_t row_bytes,
                  size_t height) {
  const uint4 pack = make_uint4(pattern, pattern, pattern, pattern);
  for (size_t r = blockIdx.y; r < height; r += gridDim.y) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(dst + r * pitch);
    const uintptr_t end = begin + row_bytes;
    const uintptr_t middle = std::min(end, (begin + 15) & ~uintptr_t(15));
    const uintptr_t tail = std::max(middle, end & ~uintptr_t(15));
    if (blockIdx.x == 0 && threadIdx.x < 32) {
      const uintptr_t at = threadIdx.x < 16 ? begin + threadIdx.x : tail + threadIdx.x - 16;
      if (at < (threadIdx.x < 16 ? middle : end)) {
        *reinterpret_cast<unsigned char*>(at) =
            static_cast<unsigned char>(pattern >> (8 * (at & 3)));
      }
    }
    uint4* packs = reinterpret_cast<uint4*>(middle);
    const size_t count = (tail - middle) / 16;
    for (size_t i = blockIdx.x * size_t(kThreads) + threadIdx.x; i < count;
         i += size_t(gridDim.x) * kThreads) {
      packs[i] = pack;
    }
  }
}

// The kernel's launch for `m`: its grid and its arguments, kept together because a kernel
// node copies the arguments from the addresses it is given.
struct MemsetLaunch {
  unsigned char* dst;
  size_t pitch;
  uint32_t pattern;
  size_t row_bytes;
  size_t height;
  dim3 grid;
  void* args[5];

  MemsetLaunch(const MemsetShape& m, int device)
      : dst(static_cast<unsigned char*>(m.dst)),
        pitch(m.pitch),
        pattern(memset_pattern(m.value, m.element_size)),
        row_bytes(m.width * m.element_size),
        height(m.height),
        args{&dst, &pitch, &pattern, &row_bytes, &height} {
    const size_t packs = row_bytes / 16;
    const size_t most = size_t(4) * multiprocessors(device);
    grid = dim3(static_cast<unsigned>(std::clamp<size_t>((packs + kThreads - 1) / kThreads, 1,
                                                         most)),
                static_cast<unsigned>(std::clamp<size_t>(height, 1, 65535)));
  }
  MemsetLaunch(const MemsetLaunch&) = delete;  // args point into this object
  MemsetLaunch& operator=(const MemsetLaunch&) = delete;
};

std::vector<cudaGraphNode_t> dependencies(cudaGraphNode_t node) {
  size_t count = 0;
  NT_CHECK_CUDA(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  if (count > 0) NT_CHECK_CUDA(cudaGraphNodeGetDependencies(node, nodes.data(), nullptr, &count));
  return nodes;
}

std::vector<cudaGraphNode_t> dependents(cudaGraphNode_t node) {
  size_t count = 0;
  NT_CHECK_CUDA(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  if (count > 0) {
    NT_CHECK_CUDA(cudaGraphNodeGetDependentNodes(node, nodes.data(), nullptr, &count));
  }
  return nodes;
}

}  // namespace

uint32_t memset_pattern(uint32_t value, uint32_t element_size) {
  NT_CHECK(element_size == 1 || element_size == 2 || element_size == 4,
           "memset_pattern: a memset's elements are 1, 2 or 4 bytes; got ", element_size);
  if (element_size == 1) return (value & 0xFFu) * 0x01010101u;
  if (element_size == 2) return (value & 0xFFFFu) * 0x00010001u;
  return value;
}

void launch_memset_kernel(const MemsetShape& m, cudaStream_t stream) {
  if (m.width == 0 || m.height == 0) return;
  int device = 0;
  NT_CHECK_CUDA(cudaGetDevice(&device));
  const MemsetLaunch l(m, device);
  memset_kernel<<<l.grid, kThreads, 0, stream>>>(l.dst, l.pitch, l.pattern, l.row_bytes,
                                                 l.height);
  NT_CHECK_LAUNCH();
}

int64_t memsets_as_kernels(cudaGraph_t graph, int device) {
  const DeviceGuard guard(device);  // kernel nodes run on the device current when added
  size_t count = 0;
  NT_CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  if (count > 0) NT_CHECK_CUDA(cudaGraphGetNodes(graph, nodes.data(), &count));
  int64_t replaced = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    NT_CHECK_CUDA(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeMemset) continue;
    cudaMemsetParams p{};
    NT_CHECK_CUDA(cudaGraphMemsetNodeGetParams(node, &p));
    MemsetLaunch l(MemsetShape::of(p), device);
    cudaKernelNodeParams k{};
    k.func = reinterpret_cast<void*>(&memset_kernel);
    k.gridDim = l.grid;
    k.blockDim = dim3(kThreads);
    k.kernelParams = l.args;
    const std::vector<cudaGraphNode_t> before = dependencies(node);
    const std::vector<cudaGraphNode_t> after = dependents(node);
    cudaGraphNode_t kernel;
    NT_CHECK_CUDA(cudaGraphAddKernelNode(&kernel, graph, before.data(), before.size(), &k));
    for (cudaGraphNode_t next : after) {
      NT_CHECK_CUDA(cudaGraphAddDependencies(graph, &kernel, &next, nullptr, 1));
    }
    NT_CHECK_CUDA(cudaGraphDestroyNode(node));  // and its edges
    ++replaced;
  }
  return replaced;
}

}  // namespace nimble_train::capture
