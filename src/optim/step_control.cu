// CUDA kernels and launchers for step_control.h: grad_stats (norm and overflow partials) and
// prepare_step (one block: norm, clip factor, skip flag, staged hyper-parameters, step counts).
#include <cstdint>

#include "common/check.h"
#include "common/cuda_check.h"
#include "optim/step_control.h"

namespace nimble_train::optim {
namespace {

constexpr int kStatsThreads = 256;
constexpr int kPrepareThreads = 256;

// Block-wide sum of v (any arithmetic type) in a fixed order: deterministic.
template <typename T, int kThreads>
__device__ T block_sum(T v, T* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
    __syncthreads();
  }
  const T total = shared[0];
  __syncthreads();
  return total;
}

// Grid-stride over 16-byte packs of kVec elements; four packs in flight per thread, since only
// one buffer is read (2 MB must be in flight to keep 3 TB/s busy at ~0.7 us latency).
template <typename Traits, int kVec>
__global__ void __launch_bounds__(kStatsThreads)
    grad_stats_kernel(const typename Traits::Storage* __restrict__ grads, int64_t n,
                      const float* __restrict__ inv_scale, float* __restrict__ partials) {
  using S = typename Traits::Storage;
  struct alignas(sizeof(S) * kVec) Pack { S v[kVec]; };
  __shared__ float shared[kStatsThreads];
  const float s = inv_scale ? *inv_scale : 1.0f;
  float sum = 0.0f;
  bool nonfinite = false;
  auto visit = [&](S x) {
    const float g = Traits::load(x);
    nonfinite |= !isfinite(g);
    const float u = g * s;
    sum += u * u;
  };
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_packs = n / kVec;
  const Pack* packs = reinterpret_cast<const Pack*>(grads);
  int64_t i = first;
  for (; i + 3 * stride < num_packs; i += 4 * stride) {
    Pack p[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = packs[i + k * stride];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) visit(p[k].v[e]);
    }
  }
  for (; i < num_packs; i += stride) {
    const Pack p = packs[i];
#pragma unroll
    for (int e = 0; e < kVec; ++e) visit(p.v[e]);
  }
  for (int64_t j = num_packs * kVec + first; j < n; j += stride) visit(grads[j]);
  const float total = block_sum<float, kStatsThreads>(sum, shared);
  const int any = __syncthreads_or(nonfinite);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = total;
    partials[2 * blockIdx.x + 1] = any ? 1.0f : 0.0f;
  }
}

template <typename Traits>
void launch_grad_stats(const void* grads, int64_t n, const float* inv_scale, float* partials,
                       cudaStream_t stream) {
  using S = typename Traits::Storage;
  constexpr int kVec = 16 / sizeof(S);
  const int blocks = static_cast<int>(grad_stats_rows(n));
  const auto* g = static_cast<const S*>(grads);
  if (reinterpret_cast<uintptr_t>(grads) % 16 == 0) {
    grad_stats_kernel<Traits, kVec><<<blocks, kStatsThreads, 0, stream>>>(g, n, inv_scale,
                                                                          partials);
  } else {
    grad_stats_kernel<Traits, 1><<<blocks, kStatsThreads, 0, stream>>>(g, n, inv_scale, partials);
  }
  NT_CHECK_LAUNCH();
}

__global__ void __launch_bounds__(kPrepareThreads) prepare_step_kernel(PrepareArgs a) {
  __shared__ double shared[kPrepareThreads];
  __shared__ bool skip;
  // Partials summed in double, in an order fixed by the row count: the same norm every replay.
  double sum = 0.0;
  bool nonfinite = false;
  const int64_t rows = a.partials ? a.num_partials : 0;
  for (int64_t i = threadIdx.x; i < rows; i += kPrepareThreads) {
    sum += a.partials[2 * i];
    nonfinite |= a.partials[2 * i + 1] != 0.0f;
  }
  const double total = block_sum<double, kPrepareThreads>(sum, shared);
  const int any = __syncthreads_or(nonfinite);
  if (threadIdx.x == 0) {
    decide_step(a, total, any != 0);
    skip = a.control[kSkipUpdate] != 0.0f;
  }
  __syncthreads();
  for (int64_t g = threadIdx.x; g < a.num_groups; g += kPrepareThreads) {
    float* row = a.hyper + g * kHyperColumns;
    for (int k = 0; k < kNumStagedHyper; ++k) row[k] = a.staged[g * kNumStagedHyper + k];
    if (!skip) row[kStep] += 1.0f;
    derive_hyper(row);
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < a.num_params; i += kPrepareThreads) {
    a.param_steps[i] = a.hyper[a.param_group[i] * kHyperColumns + kStep];
  }
}

}  // namespace

void grad_stats_cuda(const void* grads, DType dtype, int64_t n, const float* inv_scale,
                     float* partials, cudaStream_t stream) {
  NT_CHECK(n >= 0, "grad_stats: element count must be >= 0; got ", n);
  dispatch_dtype(dtype, [&](auto traits) {
    launch_grad_stats<decltype(traits)>(grads, n, inv_scale, partials, stream);
  });
}

void prepare_step_cuda(const PrepareArgs& a, cudaStream_t stream) {
  NT_CHECK(a.staged != nullptr, "prepare_step: no staged hyper-parameters were given");
  prepare_step_kernel<<<1, kPrepareThreads, 0, stream>>>(a);
  NT_CHECK_LAUNCH();
}

}  // namespace nimble_train::optim
