// CUDA kernel and launcher for flat_scale: x *= *scale over a flat buffer.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "optim/flat_scale.h"

namespace nimble_train::optim {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill an H100 (132 SMs x 8 resident blocks of 256 threads) several times over;
// the grid-stride loop covers the rest.
constexpr int64_t kMaxBlocks = 4096;

// kVec elements per thread per iteration: 16 / sizeof(T) for a 16-byte aligned buffer (one
// 128-bit load and store), 1 otherwise.
template <typename T, int kVec>
__global__ void flat_scale_kernel(T* __restrict__ x, int64_t n, const float* __restrict__ scale) {
  struct alignas(sizeof(T) * kVec) Pack { T v[kVec]; };
  const float s = *scale;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_packs = n / kVec;
  Pack* packs = reinterpret_cast<Pack*>(x);
  for (int64_t i = first; i < num_packs; i += stride) {
    Pack p = packs[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) p.v[k] = T(float(p.v[k]) * s);
    packs[i] = p;
  }
  for (int64_t i = num_packs * kVec + first; i < n; i += stride) x[i] = T(float(x[i]) * s);
}

template <typename T>
void launch(T* x, int64_t n, const float* scale, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t work = aligned ? std::max<int64_t>(n / kVec, 1) : n;
  const int blocks = static_cast<int>(std::min(kMaxBlocks, (work + kThreads - 1) / kThreads));
  if (aligned) {
    flat_scale_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(x, n, scale);
  } else {
    flat_scale_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(x, n, scale);
  }
  NT_CHECK_LAUNCH();
}

}  // namespace

void flat_scale_cuda(void* x, DType dtype, int64_t n, const float* scale, cudaStream_t stream) {
  NT_CHECK(n >= 0, "flat_scale: element count must be >= 0; got ", n);
  if (n == 0) return;
  switch (dtype) {
    case DType::kFloat32: return launch(static_cast<float*>(x), n, scale, stream);
    case DType::kFloat16: return launch(static_cast<__half*>(x), n, scale, stream);
    case DType::kBFloat16: return launch(static_cast<__nv_bfloat16*>(x), n, scale, stream);
  }
  NT_CHECK(false, "flat_scale: unsupported dtype ", dtype_name(dtype));
}

}  // namespace nimble_train::optim
