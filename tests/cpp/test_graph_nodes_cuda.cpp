// Memset nodes as kernel nodes (src/capture/graph_nodes.h) on a GPU: the kernel writes the
// bytes a memset writes (every element size, unaligned rows, 2-D rows with a pitch, the bytes
// around left alone), and a graph's memset nodes become kernels with the same dependencies, so
// that memsets ordered one after another still land in order. The reference is the host
// applying the same memsets to a copy of the buffer. Skipped, with the reason, where there is
// no CUDA GPU.
#include <gtest/gtest.h>

#include "nimble_train/build_config.h"

#if NT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <vector>

#include "capture/graph_nodes.h"
#include "common/check.h"

namespace nimble_train::capture {
namespace {

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

class GraphNodesTest : public testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "needs a CUDA GPU; none is visible";
    }
    ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&buffer), kBytes));
    std::vector<unsigned char> noise(kBytes);
    std::mt19937 gen(3);
    for (auto& b : noise) b = static_cast<unsigned char>(gen());
    ASSERT_CUDA(cudaMemcpy(buffer, noise.data(), kBytes, cudaMemcpyHostToDevice));
    host = noise;
  }
  void TearDown() override {
    if (buffer != nullptr) (void)cudaFree(buffer);
  }

  // What the memset `m` (inside `buffer`) writes, applied to the host copy.
  void apply(const MemsetShape& m) {
    const size_t start = static_cast<unsigned char*>(m.dst) - buffer;
    for (size_t r = 0; r < m.height; ++r) {
      for (size_t i = 0; i < m.width; ++i) {
        for (uint32_t k = 0; k < m.element_size; ++k) {
          host[start + r * m.pitch + i * m.element_size + k] =
              static_cast<unsigned char>(m.value >> (8 * k));
        }
      }
    }
  }

  void expect_device_is_host() {
    std::vector<unsigned char> got(kBytes);
    ASSERT_CUDA(cudaMemcpy(got.data(), buffer, kBytes, cudaMemcpyDeviceToHost));
    size_t wrong = 0, first = kBytes;
    for (size_t i = 0; i < kBytes; ++i) {
      if (got[i] != host[i]) {
        ++wrong;
        first = std::min(first, i);
      }
    }
    EXPECT_EQ(wrong, 0u) << "bytes differ from the memsets', the first at " << first;
  }

  static constexpr size_t kBytes = (size_t(1) << 22) + 4096;
  unsigned char* buffer = nullptr;
  std::vector<unsigned char> host;
};

// A memset node's parameters.
cudaMemsetParams memset_node(unsigned char* at, uint32_t element_size, uint32_t value,
                             size_t width, size_t height = 1, size_t pitch = 0) {
  cudaMemsetParams p{};
  p.dst = at;
  p.elementSize = element_size;
  p.value = value;
  p.width = width;
  p.height = height;
  p.pitch = pitch != 0 ? pitch : width * element_size;
  return p;
}

TEST(MemsetPattern, RepeatsTheElementAndRefusesOtherSizes) {
  EXPECT_EQ(memset_pattern(0x1AB, 1), 0xABABABABu);  // the low byte only
  EXPECT_EQ(memset_pattern(0xFF1234, 2), 0x12341234u);
  EXPECT_EQ(memset_pattern(0xDEADBEEF, 4), 0xDEADBEEFu);
  EXPECT_THROW(memset_pattern(1, 3), InvalidArgument);
}

// Every element size, at offsets that leave the row's head and tail unaligned (and rows shorter
// than 16 bytes, inside one 16-byte block), rows long enough for several blocks, and 2-D memsets
// whose pitch leaves bytes between the rows untouched.
TEST_F(GraphNodesTest, TheKernelWritesWhatTheMemsetWrites) {
  uint32_t value = 0x9C3E5A71u;
  for (uint32_t size : {1u, 2u, 4u}) {
    for (size_t offset : {0, 1, 2, 3, 4, 6, 8, 12, 15}) {
      if (offset % size != 0) continue;  // memsets write aligned elements
      for (size_t width : {1, 3, 7, 8, 17, 64, 1000, 65541, 262147}) {
        for (size_t height : {1, 3}) {
          const size_t pitch = width * size + (height > 1 ? 20 * size : 0);
          if (offset + pitch * height > kBytes) continue;
          const MemsetShape m = MemsetShape::of(
              memset_node(buffer + offset, size, value, width, height, pitch));
          launch_memset_kernel(m, nullptr);
          apply(m);
          value = value * 1664525u + 1013904223u;
        }
      }
    }
    ASSERT_CUDA(cudaDeviceSynchronize());
    expect_device_is_host();
  }
  launch_memset_kernel(MemsetShape::of(memset_node(buffer, 4, 7, 0)), nullptr);  // no bytes
  ASSERT_CUDA(cudaDeviceSynchronize());
  expect_device_is_host();
}

// Three memsets over overlapping bytes, each after the one before, and an empty node after
// them: rewritten, the graph has kernels where the memsets were, the same edges, and writes the
// bytes in the same order.
TEST_F(GraphNodesTest, AGraphsMemsetNodesBecomeKernelsThatKeepTheirOrder) {
  cudaGraph_t graph;
  ASSERT_CUDA(cudaGraphCreate(&graph, 0));
  const std::vector<cudaMemsetParams> memsets = {
      memset_node(buffer, 4, 0x11223344u, kBytes / 4),
      memset_node(buffer + 6, 2, 0xA5B6u, 100003),
      memset_node(buffer + 33, 1, 0x7Eu, 999, 5, 4096)};
  std::vector<cudaGraphNode_t> nodes;
  for (const cudaMemsetParams& p : memsets) {
    cudaGraphNode_t node;
    ASSERT_CUDA(cudaGraphAddMemsetNode(&node, graph, nodes.empty() ? nullptr : &nodes.back(),
                                       nodes.empty() ? 0 : 1, &p));
    nodes.push_back(node);
  }
  cudaGraphNode_t last;
  ASSERT_CUDA(cudaGraphAddEmptyNode(&last, graph, &nodes.back(), 1));
  size_t edges_before = 0;
  ASSERT_CUDA(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &edges_before));

  EXPECT_EQ(memsets_as_kernels(graph, 0), 3);
  size_t count = 0;
  ASSERT_CUDA(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> after(count);
  ASSERT_CUDA(cudaGraphGetNodes(graph, after.data(), &count));
  int kernels = 0;
  for (cudaGraphNode_t node : after) {
    cudaGraphNodeType type;
    ASSERT_CUDA(cudaGraphNodeGetType(node, &type));
    EXPECT_NE(type, cudaGraphNodeTypeMemset);
    kernels += type == cudaGraphNodeTypeKernel;
  }
  EXPECT_EQ(count, 4u);
  EXPECT_EQ(kernels, 3);
  size_t edges_after = 0;
  ASSERT_CUDA(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &edges_after));
  EXPECT_EQ(edges_after, edges_before);
  size_t roots = 0;
  ASSERT_CUDA(cudaGraphGetRootNodes(graph, nullptr, &roots));
  EXPECT_EQ(roots, 1u);  // still one chain: memset, memset, memset, empty

  cudaGraphExec_t exec;
  ASSERT_CUDA(cudaGraphInstantiateWithFlags(&exec, graph, 0));
  for (const cudaMemsetParams& p : memsets) apply(MemsetShape::of(p));
  for (int launch = 0; launch < 3; ++launch) ASSERT_CUDA(cudaGraphLaunch(exec, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  expect_device_is_host();
  ASSERT_CUDA(cudaGraphExecDestroy(exec));
  ASSERT_CUDA(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace nimble_train::capture

#else
TEST(GraphNodesTest, NeedsACudaBuild) { GTEST_SKIP() << "this build has no CUDA"; }
#endif
