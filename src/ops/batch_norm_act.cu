// CUDA kernels of batch_norm_act.h. Statistics: the backward's two-kernel sums (below), of
// x - shift and its square. Forward: one thread per pack of channels of one row (16 bytes when
// the channels and the pointers allow it), striding over the rows; block 0 also updates the
// running averages. Backward: (1) blocks of packs of channels x a share of the rows
// sum gz and gz * (x - mean) per channel, over the block's rows in a fixed tree, into per-block
// partials; (2) 32 threads per channel add the blocks' partials, each a fixed subset in order,
// then in a fixed tree, and write the weight's and bias's gradients; (3) the element-wise
// gradients, as the forward. The ReLU's mask: the forward's lanes OR their packs' bits into
// words (a warp's packs are consecutive); the backward reads them, or the output without.
// Launched early (common/early_launch.cuh), the first two kernels of the statistics' and of the
// backward's chains each let the next start once past their own wait: the next one's blocks are
// resident and waiting when it ends, where the GPU's launch latency would otherwise lie between
// them. Every kernel waits for the one before it first, whichever that is.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/early_launch.cuh"
#include "common/pack.cuh"
#include "ops/batch_norm_act.h"
#include "ops/packs.cuh"

namespace nimble_train::ops {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // then each thread strides over the rest

// The ReLU mask's word of 32 / kVec packs: lane l of a warp (consecutive packs from a multiple
// of 32) holds the kVec bits of pack i; the lanes of each word OR theirs together and the first
// writes it. Every lane of the warp calls this (those past the end with no bits).
template <int kVec>
__device__ void write_mask(uint32_t* mask, int64_t i, int64_t total, uint32_t bits) {
  constexpr int kLanes = 32 / kVec;  // packs per word
  const int lane = threadIdx.x & 31;
  uint32_t word = bits << ((lane % kLanes) * kVec);
#pragma unroll
  for (int d = 1; d < kLanes; d <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, d);
  if (lane % kLanes == 0 && i < total) mask[(i * kVec) >> 5] = word;
}

template <typename Traits, int kVec, bool kResidual, bool kMask>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const typename Traits::Storage* x, const typename Traits::Storage* residual,
                   typename Traits::Storage* y, uint32_t* mask, BatchNormActParams p,
                   BatchNormActShape s) {
  using S = typename Traits::Storage;
  wait_for_previous();
  if (blockIdx.x == 0 && p.running_mean != nullptr) {
    for (int64_t c = threadIdx.x; c < s.channels; c += blockDim.x) {
      BatchNormActMath::update_running(p.mean[c], p.invstd[c], p.momentum, p.eps, s.rows,
                                       p.running_mean + c, p.running_var + c);
    }
  }
  const int64_t packs = s.channels / kVec;
  const int64_t total = s.rows * packs;
  // The whole block steps together (the mask's words are a warp's).
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x; base < total;
       base += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = base + threadIdx.x;
    uint32_t kept = 0;
    if (i < total) {
      const int64_t c = (i % packs) * kVec;
      const int64_t at = i * kVec;  // == row * channels + c
      const auto v = load_pack<kVec>(x, at);
      Pack<S, kVec> r;
      if constexpr (kResidual) r = load_pack<kVec>(residual, at);
      Pack<S, kVec> out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float res = kResidual ? Traits::load(r.v[k]) : 0.0f;
        out.v[k] = Traits::store(BatchNormActMath::apply(
            Traits::load(v.v[k]), __ldg(p.mean + c + k), __ldg(p.invstd + c + k),
            __ldg(p.weight + c + k), __ldg(p.bias + c + k), res, p.activation));
        if constexpr (kMask) kept |= BatchNormActBackwardMath::kept(Traits::load(out.v[k])) << k;
      }
      store_pack<kVec>(y, at, out);
    }
    if constexpr (kMask) write_mask<kVec>(mask, i, total, kept);
  }
}

template <typename Traits, int kVec>
void launch(const void* x, const void* residual, void* y, uint32_t* mask,
            const BatchNormActParams& p, const BatchNormActShape& s, cudaStream_t stream,
            bool early) {
  using S = typename Traits::Storage;
  const int64_t total = s.rows * (s.channels / kVec);
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks)));
  const S* xs = static_cast<const S*>(x);
  const S* rs = static_cast<const S*>(residual);
  S* ys = static_cast<S*>(y);
  const auto run = [&](auto residual_, auto mask_) {
    launch_kernel(early, forward_kernel<Traits, kVec, decltype(residual_)::value,
                                        decltype(mask_)::value>,
                  blocks, kThreads, stream, xs, rs, ys, mask, p, s);
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (residual != nullptr) {
    mask != nullptr ? run(Yes{}, Yes{}) : run(Yes{}, No{});
  } else {
    mask != nullptr ? run(No{}, Yes{}) : run(No{}, No{});
  }
}

// The ReLU's mask of a pack of kVec elements from element `at` on (bit k: element k passes):
// from the forward's bits (mask), else from the output y.
template <typename Traits, int kVec>
__device__ uint32_t pack_kept(const uint32_t* mask, const typename Traits::Storage* y,
                              int64_t at) {
  if (mask != nullptr) return (__ldg(mask + (at >> 5)) >> (at & 31)) & ((1u << kVec) - 1u);
  const auto o = load_pack<kVec>(y, at);
  uint32_t kept = 0;
#pragma unroll
  for (int k = 0; k < kVec; ++k) kept |= BatchNormActBackwardMath::kept(Traits::load(o.v[k])) << k;
  return kept;
}

// The gradient through the activation of element k of a pack: the ReLU's from its mask bits,
// the GELU's at the normalised value z.
__device__ inline float through(float gy, uint32_t kept, int k, float z, Activation a) {
  if (a == Activation::kGelu) return BatchNormActBackwardMath::gelu_through(gy, z);
  return (kept >> k) & 1u ? gy : 0.0f;
}

// ---------------------------------------------------------------------------- backward

constexpr int kBlocksPerSm = 2;  // of the backward's reduction
constexpr int kMaxSplits = 256;

struct ReduceGrid {
  int lanes = 1;   // packs of channels side by side in a block (threadIdx.x)
  int depth = 1;   // rows side by side in a block (threadIdx.y): kThreads / lanes
  int columns = 1;  // blocks across the channels (blockIdx.x)
  int splits = 1;   // blocks across the rows (blockIdx.y)
};

// `rows_per_thread`: the fewest rows each thread of a block should get (fewer blocks, and so
// fewer parts to add after, where that many rows would leave them idle).
ReduceGrid reduce_grid(const BatchNormActShape& s, int vec, int device,
                       int64_t rows_per_thread = 1) {
  ReduceGrid g;
  const int64_t packs = s.channels / vec;
  while (g.lanes * 2 <= std::min<int64_t>(packs, 32)) g.lanes *= 2;
  g.depth = kThreads / g.lanes;
  g.columns = static_cast<int>((packs + g.lanes - 1) / g.lanes);
  const int64_t wanted = (int64_t(kBlocksPerSm) * multiprocessors(device) + g.columns - 1) /
                         g.columns;
  const int64_t most = (s.rows + g.depth * rows_per_thread - 1) / (g.depth * rows_per_thread);
  g.splits = static_cast<int>(std::clamp<int64_t>(std::min(wanted, most), 1, kMaxSplits));
  return g;
}

// ---------------------------------------------------------------------------- statistics

// A block's part of two per-channel sums: each thread's (a, b) for its kVec channels from c
// on, added over the block's rows of threads (threadIdx.y) in a fixed tree (in the shared
// arrays sa, sb: [kThreads * kVec]), written by row 0 to parts[blockIdx.y] ([2][channels]).
template <int kVec>
__device__ void write_block_part(const float (&a)[kVec], const float (&b)[kVec], float* sa,
                                 float* sb, bool active, int64_t c, int64_t channels,
                                 float* parts) {
  const int slot = (threadIdx.y * blockDim.x + threadIdx.x) * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    sa[slot + k] = a[k];
    sb[slot + k] = b[k];
  }
  __syncthreads();
  for (int stride = blockDim.y / 2; stride > 0; stride /= 2) {
    if (threadIdx.y < stride) {
      const int other = slot + stride * blockDim.x * kVec;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        sa[slot + k] += sa[other + k];
        sb[slot + k] += sb[other + k];
      }
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && active) {
    float* out = parts + int64_t(blockIdx.y) * 2 * channels;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      out[c + k] = sa[slot + k];
      out[channels + c + k] = sb[slot + k];
    }
  }
}

// Blocks (columns of packs of channels) x (splits of the rows); each thread sums d = x - shift
// and d * d over its rows of the block's share (shift: the channel's first value, so that the
// sums do not cancel), and the block adds them in a fixed tree into its part.
template <typename Traits, int kVec>
__global__ void __launch_bounds__(kThreads)
    stats_kernel(const typename Traits::Storage* x, float* parts, BatchNormActShape s) {
  __shared__ float sum[kThreads * kVec], squares[kThreads * kVec];
  wait_for_previous();
  let_next_start();  // the finishing kernel: a few blocks
  const int64_t packs = s.channels / kVec;
  const int64_t pack = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = pack < packs;
  const int64_t c = pack * kVec;
  const int64_t share = (s.rows + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * share;
  const int64_t end = std::min<int64_t>(s.rows, begin + share);
  float shift[kVec], t1[kVec], t2[kVec];
  Pack<typename Traits::Storage, kVec> first{};
  if (active) first = load_pack<kVec>(x, c);
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    shift[k] = Traits::load(first.v[k]);
    t1[k] = t2[k] = 0.0f;
  }
  if (active) {
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += blockDim.y) {
      const auto v = load_pack<kVec>(x, r * s.channels + c);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float d = Traits::load(v.v[k]) - shift[k];
        t1[k] += d;
        t2[k] = fmaf(d, d, t2[k]);
      }
    }
  }
  write_block_part<kVec>(t1, t2, sum, squares, active, c, s.channels, parts);
}

template <typename Traits, int kVec>
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(const typename Traits::Storage* grad_y, const typename Traits::Storage* y,
                  const uint32_t* mask, const typename Traits::Storage* x, BatchNormActParams p,
                  float* partials, BatchNormActShape s) {
  __shared__ float sums[2][kThreads * kVec];
  wait_for_previous();
  let_next_start();  // the finishing kernel: a few blocks
  const int64_t packs = s.channels / kVec;
  const int64_t pack = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = pack < packs;
  const int64_t c = pack * kVec;
  float dy[kVec], dy_xmu[kVec], m[kVec], scale[kVec], shift[kVec];
  const bool gelu = p.activation == Activation::kGelu;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    dy[k] = dy_xmu[k] = 0.0f;
    m[k] = active ? __ldg(p.mean + c + k) : 0.0f;
    // z's terms, for the GELU's derivative: z = weight * (x - mean) * invstd + bias
    scale[k] = active && gelu ? __ldg(p.weight + c + k) : 0.0f;
    shift[k] = active && gelu ? __ldg(p.bias + c + k) : 0.0f;
  }
  const float* invstd = p.invstd;
  const int64_t share = (s.rows + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * share;
  const int64_t end = std::min<int64_t>(s.rows, begin + share);
  if (active) {
    for (int64_t r = begin + threadIdx.y; r < end; r += blockDim.y) {
      const int64_t at = r * s.channels + c;
      const auto g = load_pack<kVec>(grad_y, at);
      // the ReLU's mask; the GELU's derivative needs z
      const uint32_t kept = gelu ? 0u : pack_kept<Traits, kVec>(mask, y, at);
      const auto v = load_pack<kVec>(x, at);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float xv = Traits::load(v.v[k]);
        const float z = gelu ? BatchNormActMath::normalised(xv, m[k], __ldg(invstd + c + k),
                                                            scale[k], shift[k], 0.0f)
                             : 0.0f;
        const float gz = through(Traits::load(g.v[k]), kept, k, z, p.activation);
        dy[k] += gz;
        dy_xmu[k] += gz * (xv - m[k]);
      }
    }
  }
  write_block_part<kVec>(dy, dy_xmu, sums[0], sums[1], active, c, s.channels, partials);
}

constexpr int kFinishChannels = 32;  // per block of the second kernels (threadIdx.x)
constexpr int kFinishLanes = 32;     // threads adding one channel's partials (threadIdx.y)

// Channel c's two totals over the blocks' partial sums ([splits][2][channels]), in the threads
// of row 0 (threadIdx.y == 0): lane l adds the partials of blocks l, l + lanes, ... in order,
// then a fixed tree over the lanes: the same order on every run.
__device__ void add_partials(const float* partials, int splits, int64_t channels, int64_t c,
                             float& a, float& b) {
  __shared__ float sums[2][kFinishLanes][kFinishChannels];
  a = b = 0.0f;
  if (c < channels) {
    for (int j = threadIdx.y; j < splits; j += kFinishLanes) {
      a += partials[int64_t(j) * 2 * channels + c];
      b += partials[int64_t(j) * 2 * channels + channels + c];
    }
  }
  sums[0][threadIdx.y][threadIdx.x] = a;
  sums[1][threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  for (int stride = kFinishLanes / 2; stride > 0; stride /= 2) {
    if (threadIdx.y < stride) {
      sums[0][threadIdx.y][threadIdx.x] += sums[0][threadIdx.y + stride][threadIdx.x];
      sums[1][threadIdx.y][threadIdx.x] += sums[1][threadIdx.y + stride][threadIdx.x];
    }
    __syncthreads();
  }
  a = sums[0][0][threadIdx.x];
  b = sums[1][0][threadIdx.x];
}

__global__ void __launch_bounds__(kFinishChannels * kFinishLanes)
    finish_kernel(const float* partials, int splits, float* totals, const float* invstd,
                  float* grad_weight, float* grad_bias, int64_t channels) {
  wait_for_previous();
  let_next_start();  // the element-wise gradients
  const int64_t c = int64_t(blockIdx.x) * kFinishChannels + threadIdx.x;
  float dy, dy_xmu;
  add_partials(partials, splits, channels, c, dy, dy_xmu);
  if (threadIdx.y == 0 && c < channels) {
    totals[c] = dy;
    totals[channels + c] = dy_xmu;
    grad_weight[c] = dy_xmu * invstd[c];
    grad_bias[c] = dy;
  }
}

template <typename Traits>
__global__ void __launch_bounds__(kFinishChannels * kFinishLanes)
    stats_finish_kernel(const typename Traits::Storage* x, const float* parts, int splits,
                        BatchNormStats out, BatchNormActShape s) {
  wait_for_previous();
  let_next_start();  // the forward
  const int64_t c = int64_t(blockIdx.x) * kFinishChannels + threadIdx.x;
  float sum_d, sum_dd;
  add_partials(parts, splits, s.channels, c, sum_d, sum_dd);
  if (threadIdx.y == 0 && c < s.channels) {
    BatchNormStatsMath::finish(Traits::load(x[c]), sum_d, sum_dd, s.rows, out.eps,
                               out.mean + c, out.invstd + c);
  }
}

template <typename Traits, int kVec>
__global__ void __launch_bounds__(kThreads)
    grad_input_kernel(const typename Traits::Storage* grad_y, const typename Traits::Storage* y,
                      const uint32_t* mask, const typename Traits::Storage* x,
                      const float* totals,
                      BatchNormActParams p, typename Traits::Storage* grad_x,
                      typename Traits::Storage* grad_residual, BatchNormActShape s) {
  using S = typename Traits::Storage;
  wait_for_previous();
  const int64_t packs = s.channels / kVec;
  const int64_t total = s.rows * packs;
  const float inv_rows = 1.0f / static_cast<float>(s.rows);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = (i % packs) * kVec;
    const int64_t at = i * kVec;
    const bool gelu = p.activation == Activation::kGelu;
    const auto g = load_pack<kVec>(grad_y, at);
    const uint32_t kept = gelu ? 0u : pack_kept<Traits, kVec>(mask, y, at);
    Pack<S, kVec> v{}, gx, gr;
    if (grad_x != nullptr || gelu) v = load_pack<kVec>(x, at);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float xv = Traits::load(v.v[k]);
      const float z = gelu ? BatchNormActMath::normalised(xv, __ldg(p.mean + c + k),
                                                          __ldg(p.invstd + c + k),
                                                          __ldg(p.weight + c + k),
                                                          __ldg(p.bias + c + k), 0.0f)
                           : 0.0f;
      const float gz = through(Traits::load(g.v[k]), kept, k, z, p.activation);
      gr.v[k] = Traits::store(gz);
      if (grad_x != nullptr) {
        gx.v[k] = Traits::store(BatchNormActBackwardMath::grad_input(
            gz, xv, __ldg(p.mean + c + k), __ldg(p.invstd + c + k), __ldg(p.weight + c + k),
            __ldg(totals + c + k), __ldg(totals + s.channels + c + k), inv_rows));
      }
    }
    if (grad_x != nullptr) store_pack<kVec>(grad_x, at, gx);
    if (grad_residual != nullptr) store_pack<kVec>(grad_residual, at, gr);
  }
}

template <typename Traits, int kVec>
void backward(const void* grad_y, const void* y, const uint32_t* mask, const void* x,
              const BatchNormActParams& p, const BatchNormActGrads& g, float* workspace,
              const BatchNormActShape& s, const ReduceGrid& grid, cudaStream_t stream,
              bool early) {
  using S = typename Traits::Storage;
  const S* gys = static_cast<const S*>(grad_y);
  const S* ys = static_cast<const S*>(y);
  const S* xs = static_cast<const S*>(x);
  float* partials = workspace;
  float* totals = workspace + int64_t(grid.splits) * 2 * s.channels;
  launch_kernel(early, reduce_kernel<Traits, kVec>, dim3(grid.columns, grid.splits),
                dim3(grid.lanes, grid.depth), stream, gys, ys, mask, xs, p, partials, s);
  const int finish_blocks =
      static_cast<int>((s.channels + kFinishChannels - 1) / kFinishChannels);
  launch_kernel(early, finish_kernel, finish_blocks, dim3(kFinishChannels, kFinishLanes), stream,
                partials, grid.splits, totals, p.invstd, g.grad_weight, g.grad_bias,
                s.channels);
  if (g.grad_x == nullptr && g.grad_residual == nullptr) return;
  const int64_t total = s.rows * (s.channels / kVec);
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks)));
  launch_kernel(early, grad_input_kernel<Traits, kVec>, blocks, kThreads, stream, gys, ys, mask,
                xs, totals, p, static_cast<S*>(g.grad_x), static_cast<S*>(g.grad_residual), s);
}

// The most blocks down the rows of reduce_grid for either pack width a launch may take
// (unaligned pointers: one): what a workspace of parts must hold.
int64_t most_splits(const BatchNormActShape& s, DType dtype, int device,
                    int64_t rows_per_thread = 1) {
  int64_t splits = reduce_grid(s, 1, device, rows_per_thread).splits;
  dispatch_packs(dtype, s.channels, true, [&](auto, auto vec) {
    splits = std::max<int64_t>(
        splits, reduce_grid(s, decltype(vec)::value, device, rows_per_thread).splits);
  });
  return splits;
}

}  // namespace

int64_t batch_norm_relu_backward_workspace(const BatchNormActShape& s, DType dtype, int device) {
  return (most_splits(s, dtype, device) + 1) * 2 * s.channels;
}

void batch_norm_relu_backward_cuda(const void* grad_y, const void* y, const uint32_t* mask,
                                   const void* x, const BatchNormActParams& p,
                                   const BatchNormActGrads& g, float* workspace,
                                   const BatchNormActShape& s, DType dtype, cudaStream_t stream,
                                   bool early) {
  if (s.rows == 0 || s.channels == 0) return;
  int device = 0;
  NT_CHECK_CUDA(cudaGetDevice(&device));
  const bool packs = aligned(grad_y, 16) && aligned(y, 16) && aligned(x, 16) &&
                     aligned(g.grad_x, 16) && aligned(g.grad_residual, 16);
  dispatch_packs(dtype, s.channels, packs, [&](auto traits, auto vec) {
    constexpr int kVec = decltype(vec)::value;
    backward<decltype(traits), kVec>(grad_y, y, mask, x, p, g, workspace, s,
                                     reduce_grid(s, kVec, device), stream, early);
  });
}

// Rows per thread of the statistics' blocks, at the least: fewer parts to add after.
constexpr int64_t kStatsRowsPerThread = 8;

int64_t batch_norm_stats_workspace(const BatchNormActShape& s, DType dtype, int device) {
  return most_splits(s, dtype, device, kStatsRowsPerThread) * 2 * s.channels;
}

void batch_norm_stats_cuda(const void* x, const BatchNormStats& out, float* workspace,
                           const BatchNormActShape& s, DType dtype, cudaStream_t stream,
                           bool early) {
  if (s.rows == 0 || s.channels == 0) return;
  int device = 0;
  NT_CHECK_CUDA(cudaGetDevice(&device));
  dispatch_packs(dtype, s.channels, aligned(x, 16), [&](auto traits, auto vec) {
    using Traits = decltype(traits);
    using S = typename Traits::Storage;
    constexpr int kVec = decltype(vec)::value;
    const ReduceGrid grid = reduce_grid(s, kVec, device, kStatsRowsPerThread);
    const S* xs = static_cast<const S*>(x);
    launch_kernel(early, stats_kernel<Traits, kVec>, dim3(grid.columns, grid.splits),
                  dim3(grid.lanes, grid.depth), stream, xs, workspace, s);
    const int blocks = static_cast<int>((s.channels + kFinishChannels - 1) / kFinishChannels);
    launch_kernel(early, stats_finish_kernel<Traits>, blocks,
                  dim3(kFinishChannels, kFinishLanes), stream, xs, workspace, grid.splits, out,
                  s);
  });
}

void batch_norm_relu_forward_cuda(const void* x, const void* residual, void* y, uint32_t* mask,
                                  const BatchNormActParams& p, const BatchNormActShape& s,
                                  DType dtype, cudaStream_t stream, bool early) {
  if (s.rows == 0 || s.channels == 0) return;
  const bool packs = aligned(x, 16) && aligned(residual, 16) && aligned(y, 16);
  dispatch_packs(dtype, s.channels, packs, [&](auto traits, auto vec) {
    launch<decltype(traits), decltype(vec)::value>(x, residual, y, mask, p, s, stream, early);
  });
}

}  // namespace nimble_train::ops
