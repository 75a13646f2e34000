// CUDA kernel of batch_norm_act.h: one thread per pack of channels of one row (16 bytes when
// the channels and the pointers allow it), striding over the rows; block 0 also updates the
// running averages.
#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/pack.cuh"
#include "ops/batch_norm_act.h"

namespace nimble_train::ops {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // then each thread strides over the rest

template <typename Traits, int kVec, bool kResidual>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const typename Traits::Storage* x, const typename Traits::Storage* residual,
                   typename Traits::Storage* y, BatchNormActParams p, BatchNormActShape s) {
  using S = typename Traits::Storage;
  if (blockIdx.x == 0 && p.running_mean != nullptr) {
    for (int64_t c = threadIdx.x; c < s.channels; c += blockDim.x) {
      BatchNormActMath::update_running(p.mean[c], p.invstd[c], p.momentum, p.eps, s.rows,
                                       p.running_mean + c, p.running_var + c);
    }
  }
  const int64_t packs = s.channels / kVec;
  const int64_t total = s.rows * packs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
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
          __ldg(p.weight + c + k), __ldg(p.bias + c + k), res));
    }
    store_pack<kVec>(y, at, out);
  }
}

template <typename Traits, int kVec>
void launch(const void* x, const void* residual, void* y, const BatchNormActParams& p,
            const BatchNormActShape& s, cudaStream_t stream) {
  using S = typename Traits::Storage;
  const int64_t total = s.rows * (s.channels / kVec);
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks)));
  const S* xs = static_cast<const S*>(x);
  const S* rs = static_cast<const S*>(residual);
  S* ys = static_cast<S*>(y);
  if (residual != nullptr) {
    forward_kernel<Traits, kVec, true><<<blocks, kThreads, 0, stream>>>(xs, rs, ys, p, s);
  } else {
    forward_kernel<Traits, kVec, false><<<blocks, kThreads, 0, stream>>>(xs, rs, ys, p, s);
  }
  NT_CHECK_LAUNCH();
}

bool aligned(const void* ptr, int bytes) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

void batch_norm_relu_forward_cuda(const void* x, const void* residual, void* y,
                                  const BatchNormActParams& p, const BatchNormActShape& s,
                                  DType dtype, cudaStream_t stream) {
  if (s.rows == 0 || s.channels == 0) return;
  optim::dispatch_dtype(dtype, [&](auto traits) {
    using Traits = decltype(traits);
    constexpr int kVec = 16 / sizeof(typename Traits::Storage);  // 4 floats, 8 halves
    const bool packed = s.channels % kVec == 0 && aligned(x, 16) && aligned(residual, 16) &&
                        aligned(y, 16);
    if (packed) {
      launch<Traits, kVec>(x, residual, y, p, s, stream);
    } else {
      launch<Traits, 1>(x, residual, y, p, s, stream);
    }
  });
}

}  // namespace nimble_train::ops
