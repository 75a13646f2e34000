// CUDA kernels of small_conv.h: the forward, and the weight gradient in two kernels (partial
// sums per block, then their sum in a fixed order).
//
// Both stage a tile of pixels' windows in shared memory, one thread per pixel: its coordinates
// computed once, the window's loads issued together, each row zero-padded to a multiple of 4
// columns (the bias's 1 after the last) so that the arithmetic reads 4 columns in one access.
// The arithmetic is blocked in registers: a forward thread holds 4 output channels of kPixels
// pixels, a weight-gradient thread 4 columns x 4 output channels, so that each value read from
// shared memory feeds several multiplies.
#include <algorithm>
#include <cstdint>

#include "common/check.h"
#include "common/cuda_check.h"
#include "common/pack.cuh"
#include "ops/small_conv.h"

namespace nimble_train::ops {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;
constexpr int kPixels = 4;     // pixels per forward thread
constexpr int kMaxTile = 256;  // pixels per tile: at most one per thread when staging
// Blocks per multiprocessor the grids are sized for (what the kernels' registers let reside
// at once); further tiles are taken in turn.
constexpr int kForwardBlocksPerSm = 4;
constexpr int kGradBlocksPerSm = 2;
// Shared floats a block uses at most besides the column table (under 48 KiB with it): the
// forward's weight and a tile's windows, or the weight gradient's windows and output gradients.
constexpr int kSharedFloats = 10240;
constexpr int kMaxRow = (kSmallConvMaxColumns + 1 + 3) / 4 * 4;
// Accumulator blocks of 4 columns x kVec channels a weight-gradient thread may hold.
template <int kVec>
constexpr int kMaxBlocksPerThread =
    (kMaxRow / 4 * (kSmallConvMaxOutChannels / kVec) + kThreads - 1) / kThreads;
// Loads of a thread issued before their stores.
constexpr int kInFlight = 8;
constexpr int kPacksInFlight = 4;

// A window's row in shared memory: the columns, the bias's 1, zeros up to a multiple of 4.
__host__ __device__ int window_row(const SmallConvShape& s) {
  return (s.columns() + 1 + 3) / 4 * 4;
}

// Pixels per forward tile: kPixels per thread of a pack of channels, in what the weight leaves.
int forward_tile(const SmallConvShape& s, int vec) {
  const int lanes = std::max(1, kThreads / (s.out_channels / vec));
  const int left = kSharedFloats - window_row(s) * s.out_channels;
  return std::max(1, std::min({lanes * kPixels, left / window_row(s), kMaxTile}));
}

// The most pixels a weight-gradient tile holds.
int grad_tile_max(const SmallConvShape& s) {
  return std::max(1, std::min(kSharedFloats / (window_row(s) + s.out_channels), kMaxTile));
}

// Pixels per weight-gradient tile for `blocks` blocks: every block takes the same number of
// tiles (the last one fewer pixels), so that none has a tile more than the others.
int grad_tile(const SmallConvShape& s, int blocks) {
  const int64_t tiles = (s.pixels() + grad_tile_max(s) - 1) / grad_tile_max(s);
  const int64_t rounds = (tiles + blocks - 1) / blocks;
  return static_cast<int>((s.pixels() + rounds * blocks - 1) / (rounds * blocks));
}

template <int kVec>
__device__ Pack<float, kVec> load_floats(const float* p) {  // 16-byte aligned for 4
  return *reinterpret_cast<const Pack<float, kVec>*>(p);
}

// Where each column of a window reads, relative to the window's corner: the element offset in
// an image, and the row and column offsets. Staged once per block.
struct Columns {
  int64_t offset[kSmallConvMaxColumns];
  int64_t weight[kSmallConvMaxColumns];  // the column's element in an output channel's weight
  int dh[kSmallConvMaxColumns];
  int dw[kSmallConvMaxColumns];
};

__device__ void stage_columns(const SmallConvShape& s, Columns& cols) {
  for (int k = threadIdx.x; k < s.columns(); k += blockDim.x) {
    const int j = k % s.kernel_w;
    const int i = (k / s.kernel_w) % s.kernel_h;
    const int c = k / (s.kernel_w * s.kernel_h);
    cols.dh[k] = i * s.dilation_h;
    cols.dw[k] = j * s.dilation_w;
    cols.offset[k] = c * s.x_stride[1] + cols.dh[k] * s.x_stride[2] + cols.dw[k] * s.x_stride[3];
    cols.weight[k] = c * s.w_stride[1] + i * s.w_stride[2] + j * s.w_stride[3];
  }
  __syncthreads();
}

// Tile pixels [first, first + count)'s windows into win[count][window_row]; thread p stages
// pixel p (count <= blockDim.x), kInFlight loads at a time.
template <typename Traits>
__device__ void stage_windows(const typename Traits::Storage* x, const SmallConvShape& s,
                              const Columns& cols, int64_t first, int count, float* win) {
  const int p = threadIdx.x;
  if (p >= count) return;
  const int columns = s.columns();
  const int row = window_row(s);
  const int pixel = static_cast<int>(first) + p;  // pixels < 2^31 (small_conv_shape)
  const int ow = pixel % s.out_width;
  const int rest = pixel / s.out_width;
  const int oh = rest % s.out_height;
  const int n = rest / s.out_height;
  const int h0 = oh * s.stride_h - s.pad_h;
  const int w0 = ow * s.stride_w - s.pad_w;
  const int64_t corner = n * s.x_stride[0] + h0 * s.x_stride[2] + w0 * s.x_stride[3];
  float* out = win + p * row;
#pragma unroll
  for (int k0 = 0; k0 < kMaxRow; k0 += kInFlight) {
    if (k0 >= row) break;
    float v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int k = k0 + u;
      v[u] = k == columns ? 1.0f : 0.0f;
      if (k < columns) {
        const int ih = h0 + cols.dh[k];
        const int iw = w0 + cols.dw[k];
        if (ih >= 0 && ih < s.height && iw >= 0 && iw < s.width) {
          v[u] = Traits::load(x[corner + cols.offset[k]]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (k0 + u < row) out[k0 + u] = v[u];
    }
  }
}

// n elements of the output's gradient into g_s as floats, kVec to a load (the channels are a
// multiple of kVec and the launcher checked g's alignment).
template <typename Traits, int kVec>
__device__ void stage_grads(const typename Traits::Storage* g, int n, float* g_s) {
  using S = typename Traits::Storage;
  const int packs = n / kVec;
  for (int base = threadIdx.x; base < packs; base += blockDim.x * kPacksInFlight) {
    Pack<S, kVec> v[kPacksInFlight];
#pragma unroll
    for (int u = 0; u < kPacksInFlight; ++u) {
      const int i = base + u * int(blockDim.x);
      if (i < packs) v[u] = load_pack<kVec>(g, int64_t(i) * kVec);
    }
#pragma unroll
    for (int u = 0; u < kPacksInFlight; ++u) {
      const int i = base + u * int(blockDim.x);
      if (i >= packs) break;
      Pack<float, kVec> f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) f.v[e] = Traits::load(v[u].v[e]);
      *reinterpret_cast<Pack<float, kVec>*>(g_s + int64_t(i) * kVec) = f;
    }
  }
}

template <typename Traits, int kVec>
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    forward_kernel(const typename Traits::Storage* x, const typename Traits::Storage* w,
                   const typename Traits::Storage* bias, typename Traits::Storage* y,
                   SmallConvShape s, int tile) {
  using S = typename Traits::Storage;
  extern __shared__ __align__(16) float smem[];
  __shared__ Columns cols;
  const int columns = s.columns();
  const int oc = s.out_channels;
  const int row = window_row(s);
  float* w_s = smem;             // [row][out channels]: the weight, the bias, zeros
  float* win = smem + row * oc;  // [tile][row]
  stage_columns(s, cols);
  for (int i = threadIdx.x; i < row * oc; i += blockDim.x) {
    const int k = i / oc;
    const int o = i - k * oc;
    float v = 0.0f;
    if (k < columns) {
      v = Traits::load(w[o * s.w_stride[0] + cols.weight[k]]);
    } else if (k == columns && bias != nullptr) {
      v = Traits::load(bias[o]);
    }
    w_s[i] = v;
  }
  // Thread t: channels [o, o + kVec) of pixels lane, lane + lanes, ... of the tile.
  const int packs = oc / kVec;
  const int lanes = max(1, int(blockDim.x) / packs);
  const int lane = int(threadIdx.x) / packs;
  const int o = (int(threadIdx.x) - lane * packs) * kVec;
  const bool active = lane < lanes;
  const int64_t pixels = s.pixels();
  for (int64_t first = int64_t(blockIdx.x) * tile; first < pixels;
       first += int64_t(gridDim.x) * tile) {
    const int count = static_cast<int>(pixels - first < tile ? pixels - first : tile);
    __syncthreads();  // the previous tile's windows are read (and the weight staged)
    stage_windows<Traits>(x, s, cols, first, count, win);
    __syncthreads();
    if (!active) continue;
    for (int base = lane; base < count; base += lanes * kPixels) {
      float acc[kPixels][kVec];
#pragma unroll
      for (int q = 0; q < kPixels; ++q) {
#pragma unroll
        for (int v = 0; v < kVec; ++v) acc[q][v] = 0.0f;
      }
      for (int k = 0; k < row; k += 4) {
        Pack<float, 4> a[kPixels];
#pragma unroll
        for (int q = 0; q < kPixels; ++q) {
          const int p = base + q * lanes;
          if (p < count) {
            a[q] = load_floats<4>(win + p * row + k);
          } else {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) a[q].v[kk] = 0.0f;
          }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const auto wk = load_floats<kVec>(w_s + (k + kk) * oc + o);
#pragma unroll
          for (int q = 0; q < kPixels; ++q) {
#pragma unroll
            for (int v = 0; v < kVec; ++v) acc[q][v] += a[q].v[kk] * wk.v[v];
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kPixels; ++q) {
        const int p = base + q * lanes;
        if (p >= count) break;
        Pack<S, kVec> out;
#pragma unroll
        for (int v = 0; v < kVec; ++v) out.v[v] = Traits::store(acc[q][v]);
        store_pack<kVec>(y, (first + p) * oc + o, out);
      }
    }
  }
}

// Each block's sums of window value x output gradient over its tiles, per (column, output
// channel): partial[block][(columns + 1) x out channels]. grad_y is channels-last contiguous.
// A thread owns blocks of 4 columns x kVec channels; where the block has fewer of them than
// threads, groups of threads take every groups-th pixel of a tile, and their sums are added
// in group order at the end.
template <typename Traits, int kVec>
__global__ void __launch_bounds__(kThreads, kGradBlocksPerSm)
    weight_grad_partial_kernel(const typename Traits::Storage* grad_y,
                               const typename Traits::Storage* x, float* partial,
                               SmallConvShape s, int tile) {
  constexpr int kMax = kMaxBlocksPerThread<kVec>;
  extern __shared__ __align__(16) float smem[];
  __shared__ Columns cols;
  stage_columns(s, cols);
  const int k1 = s.columns() + 1;
  const int oc = s.out_channels;
  const int row = window_row(s);
  const int packs = oc / kVec;
  const int owned = row / 4 * packs;
  const int groups = owned < int(blockDim.x) ? int(blockDim.x) / owned : 1;
  const int group = groups > 1 ? int(threadIdx.x) / owned : 0;
  const bool active = int(threadIdx.x) < groups * owned;
  const int first_owned = groups > 1 ? int(threadIdx.x) % owned : int(threadIdx.x);
  const int next_owned = groups > 1 ? owned : int(blockDim.x);
  float* win = smem;              // [tile][row]
  float* g_s = smem + tile * row;  // [tile][out channels]
  float acc[kMax][4][kVec];
#pragma unroll
  for (int j = 0; j < kMax; ++j) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[j][kk][v] = 0.0f;
    }
  }
  const int64_t pixels = s.pixels();
  for (int64_t first = int64_t(blockIdx.x) * tile; first < pixels;
       first += int64_t(gridDim.x) * tile) {
    const int count = static_cast<int>(pixels - first < tile ? pixels - first : tile);
    __syncthreads();
    stage_windows<Traits>(x, s, cols, first, count, win);
    stage_grads<Traits, kVec>(grad_y + first * oc, count * oc, g_s);
    __syncthreads();
    if (!active) continue;
#pragma unroll
    for (int j = 0; j < kMax; ++j) {
      const int m = first_owned + j * next_owned;
      if (m >= owned || (groups > 1 && j > 0)) break;
      const int kb = m / packs;
      const int o = (m - kb * packs) * kVec;
      for (int p = group; p < count; p += groups) {
        const auto a = load_floats<4>(win + p * row + kb * 4);
        const auto g = load_floats<kVec>(g_s + p * oc + o);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
          for (int v = 0; v < kVec; ++v) acc[j][kk][v] += a.v[kk] * g.v[v];
        }
      }
    }
  }
  float* out = partial + int64_t(blockIdx.x) * k1 * oc;
  if (groups == 1) {
#pragma unroll
    for (int j = 0; j < kMax; ++j) {
      const int m = first_owned + j * next_owned;
      if (m >= owned) break;
      const int kb = m / packs;
      const int o = (m - kb * packs) * kVec;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kb * 4 + kk >= k1) break;
#pragma unroll
        for (int v = 0; v < kVec; ++v) out[(kb * 4 + kk) * oc + o + v] = acc[j][kk][v];
      }
    }
    return;
  }
  // The groups' sums through shared memory: sums[group][owned][4][kVec], added in group order.
  __syncthreads();  // every tile is read
  const int per = 4 * kVec;
  if (active) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) smem[threadIdx.x * per + kk * kVec + v] = acc[0][kk][v];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < owned * per; idx += blockDim.x) {
    const int m = idx / per;
    const int kk = (idx - m * per) / kVec;
    const int v = idx - m * per - kk * kVec;
    const int kb = m / packs;
    const int k = kb * 4 + kk;
    if (k >= k1) continue;
    float sum = 0.0f;
    for (int gi = 0; gi < groups; ++gi) sum += smem[(gi * owned + m) * per + kk * kVec + v];
    out[k * oc + (m - kb * packs) * kVec + v] = sum;
  }
}

// The blocks' partial sums added into the weight's gradient (at s.w_stride) and the bias's
// (contiguous, if asked for). A block takes kSumOutputs outputs; each of its kSlices slices of
// threads adds every kSlices-th block's partials, and the slices' sums are added in slice
// order: a fixed order, the same on every run.
constexpr int kSumOutputs = 32;
constexpr int kSlices = kThreads / kSumOutputs;

template <typename GradTraits>
__global__ void __launch_bounds__(kThreads)
    weight_grad_sum_kernel(const float* partial, int blocks, typename GradTraits::Storage* gw,
                           typename GradTraits::Storage* gb, SmallConvShape s) {
  __shared__ float sums[kSlices][kSumOutputs];
  const int k1 = s.columns() + 1;
  const int oc = s.out_channels;
  const int64_t row = int64_t(k1) * oc;
  const int slice = threadIdx.x / kSumOutputs;
  const int idx = blockIdx.x * kSumOutputs + int(threadIdx.x) % kSumOutputs;
  float sum = 0.0f;
  if (idx < row) {
#pragma unroll 8
    for (int b = slice; b < blocks; b += kSlices) sum += partial[b * row + idx];
  }
  sums[slice][threadIdx.x % kSumOutputs] = sum;
  __syncthreads();
  if (slice != 0 || idx >= row) return;
  float total = 0.0f;
  for (int i = 0; i < kSlices; ++i) total += sums[i][threadIdx.x];
  const int k = idx / oc;
  const int o = idx - k * oc;
  if (k < k1 - 1) {
    gw[SmallConvMath::weight_offset(s, o, k)] = GradTraits::store(total);
  } else if (gb != nullptr) {
    gb[o] = GradTraits::store(total);
  }
}

}  // namespace

int small_conv_weight_grad_blocks(const SmallConvShape& s, int device) {
  const int64_t tiles = (s.pixels() + grad_tile_max(s) - 1) / grad_tile_max(s);
  return static_cast<int>(
      std::clamp<int64_t>(tiles, 1, int64_t(kGradBlocksPerSm) * multiprocessors(device)));
}

void small_conv_forward_cuda(const void* x, const void* weight, const void* bias, void* y,
                             const SmallConvShape& s, DType dtype, cudaStream_t stream) {
  int device = 0;
  NT_CHECK_CUDA(cudaGetDevice(&device));
  optim::dispatch_dtype(dtype, [&](auto traits) {
    using Traits = decltype(traits);
    using S = typename Traits::Storage;
    const auto* xs = static_cast<const S*>(x);
    const auto* ws = static_cast<const S*>(weight);
    const auto* bs = static_cast<const S*>(bias);
    auto* ys = static_cast<S*>(y);
    const bool packs = s.out_channels % 4 == 0 && aligned(y, 4 * sizeof(S));
    const int tile = forward_tile(s, packs ? 4 : 1);
    const size_t shared =
        sizeof(float) * size_t(window_row(s)) * (size_t(s.out_channels) + size_t(tile));
    const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(
        (s.pixels() + tile - 1) / tile, 1,
        std::min<int64_t>(kMaxBlocks, int64_t(kForwardBlocksPerSm) * multiprocessors(device))));
    if (packs) {
      forward_kernel<Traits, 4><<<blocks, kThreads, shared, stream>>>(xs, ws, bs, ys, s, tile);
    } else {
      forward_kernel<Traits, 1><<<blocks, kThreads, shared, stream>>>(xs, ws, bs, ys, s, tile);
    }
  });
  NT_CHECK_LAUNCH();
}

void small_conv_weight_grad_cuda(const void* grad_y, const void* x, float* workspace,
                                 int blocks, void* grad_w, void* grad_b, const SmallConvShape& s,
                                 DType dtype, DType grad_dtype, cudaStream_t stream) {
  const int tile = grad_tile(s, blocks);
  // The tiles, and then the thread groups' sums (up to 4 x 4 floats a thread).
  const size_t shared =
      sizeof(float) * std::max<size_t>(size_t(tile) * (window_row(s) + s.out_channels),
                                       size_t(kThreads) * 16);
  optim::dispatch_dtype(dtype, [&](auto traits) {
    using Traits = decltype(traits);
    using S = typename Traits::Storage;
    const auto* gs = static_cast<const S*>(grad_y);
    const auto* xs = static_cast<const S*>(x);
    if (s.out_channels % 4 == 0 && aligned(grad_y, 4 * sizeof(S))) {
      weight_grad_partial_kernel<Traits, 4>
          <<<blocks, kThreads, shared, stream>>>(gs, xs, workspace, s, tile);
    } else {
      weight_grad_partial_kernel<Traits, 1>
          <<<blocks, kThreads, shared, stream>>>(gs, xs, workspace, s, tile);
    }
  });
  NT_CHECK_LAUNCH();
  const int outputs = (s.columns() + 1) * s.out_channels;
  optim::dispatch_dtype(grad_dtype, [&](auto traits) {
    using GradTraits = decltype(traits);
    using G = typename GradTraits::Storage;
    weight_grad_sum_kernel<GradTraits>
        <<<(outputs + kSumOutputs - 1) / kSumOutputs, kThreads, 0, stream>>>(
            workspace, blocks, static_cast<G*>(grad_w), static_cast<G*>(grad_b), s);
  });
  NT_CHECK_LAUNCH();
}

}  // namespace nimble_train::ops
