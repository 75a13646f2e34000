// CUDA kernels of max_pool.h: one thread per output (forward) or input (backward) element and
// pack of channels, the per-element code of MaxPoolMath.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/check.h"
#include "common/cuda_check.h"
#include "common/pack.cuh"
#include "ops/max_pool.h"
#include "ops/packs.cuh"

namespace nimble_train::ops {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // then each thread strides over the rest

template <typename Traits, int kVec>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const typename Traits::Storage* x, typename Traits::Storage* y,
                   uint8_t* argmax, MaxPoolShape s) {
  using S = typename Traits::Storage;
  const int64_t packs = s.channels / kVec;
  const int64_t total = s.batch * s.out_height * s.out_width * packs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = (i % packs) * kVec;
    int64_t rest = i / packs;
    const int ow = static_cast<int>(rest % s.out_width);
    rest /= s.out_width;
    const int oh = static_cast<int>(rest % s.out_height);
    const int64_t n = rest / s.out_height;
    const auto w = MaxPoolMath::window(s, oh, ow);
    float best[kVec];
    Pack<S, kVec> out;
    Pack<uint8_t, kVec> codes;
    const S minus_inf = Traits::store(-INFINITY);
    const uint8_t initial = MaxPoolMath::initial_code(s, w);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      best[k] = -INFINITY;
      out.v[k] = minus_inf;
      codes.v[k] = initial;
    }
    for (int ih = w.h_begin; ih < w.h_end; ++ih) {
      for (int iw = w.w_begin; iw < w.w_end; ++iw) {
        const auto v = load_pack<kVec>(x, ((n * s.height + ih) * s.width + iw) * s.channels + c);
        const uint8_t here = MaxPoolMath::code(s, w, ih, iw);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float f = Traits::load(v.v[k]);
          if (MaxPoolMath::replaces(f, best[k])) {
            best[k] = f;
            out.v[k] = v.v[k];
            codes.v[k] = here;
          }
        }
      }
    }
    const int64_t o = ((n * s.out_height + oh) * s.out_width + ow) * s.channels + c;
    store_pack<kVec>(y, o, out);
    store_pack<kVec>(argmax, o, codes);
  }
}

template <typename Traits, int kVec>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const typename Traits::Storage* grad_y, const uint8_t* argmax,
                    typename Traits::Storage* grad_x, MaxPoolShape s) {
  using S = typename Traits::Storage;
  const int64_t packs = s.channels / kVec;
  const int64_t total = s.batch * s.height * s.width * packs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = (i % packs) * kVec;
    int64_t rest = i / packs;
    const int iw = static_cast<int>(rest % s.width);
    rest /= s.width;
    const int ih = static_cast<int>(rest % s.height);
    const int64_t n = rest / s.height;
    const int ph0 = MaxPoolMath::first_window(ih, s.pad_h, s.kernel_h, s.stride_h);
    const int ph1 = MaxPoolMath::last_window(ih, s.pad_h, s.stride_h, s.out_height);
    const int pw0 = MaxPoolMath::first_window(iw, s.pad_w, s.kernel_w, s.stride_w);
    const int pw1 = MaxPoolMath::last_window(iw, s.pad_w, s.stride_w, s.out_width);
    float sum[kVec];
    Pack<S, kVec> direct;
    const S zero = Traits::store(0.0f);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      sum[k] = 0.0f;
      direct.v[k] = zero;
    }
    for (int oh = ph0; oh < ph1; ++oh) {
      for (int ow = pw0; ow < pw1; ++ow) {
        const auto w = MaxPoolMath::window(s, oh, ow);
        const uint8_t here = MaxPoolMath::code(s, w, ih, iw);
        const int64_t o = ((n * s.out_height + oh) * s.out_width + ow) * s.channels + c;
        const auto codes = load_pack<kVec>(argmax, o);
        const auto g = load_pack<kVec>(grad_y, o);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (codes.v[k] == here) {
            sum[k] += Traits::load(g.v[k]);
            direct.v[k] = g.v[k];
          }
        }
      }
    }
    if (!(ph1 - ph0 == 1 && pw1 - pw0 == 1)) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) direct.v[k] = Traits::store(sum[k]);
    }
    store_pack<kVec>(grad_x, ((n * s.height + ih) * s.width + iw) * s.channels + c, direct);
  }
}

unsigned blocks_for(int64_t threads) {
  return static_cast<unsigned>(std::clamp<int64_t>((threads + kThreads - 1) / kThreads, 1,
                                                   kMaxBlocks));
}

}  // namespace

void max_pool_forward_cuda(const void* x, void* y, uint8_t* argmax, const MaxPoolShape& s,
                           DType dtype, cudaStream_t stream) {
  const bool packs = aligned(x, 16) && aligned(y, 16) && aligned(argmax, 16);
  dispatch_packs(dtype, s.channels, packs, [&](auto traits, auto vec) {
    using Traits = decltype(traits);
    using S = typename Traits::Storage;
    constexpr int kVec = decltype(vec)::value;
    const int64_t threads = s.batch * s.out_height * s.out_width * (s.channels / kVec);
    forward_kernel<Traits, kVec><<<blocks_for(threads), kThreads, 0, stream>>>(
        static_cast<const S*>(x), static_cast<S*>(y), argmax, s);
  });
  NT_CHECK_LAUNCH();
}

void max_pool_backward_cuda(const void* grad_y, const uint8_t* argmax, void* grad_x,
                            const MaxPoolShape& s, DType dtype, cudaStream_t stream) {
  const bool packs = aligned(grad_y, 16) && aligned(argmax, 16) && aligned(grad_x, 16);
  dispatch_packs(dtype, s.channels, packs, [&](auto traits, auto vec) {
    using Traits = decltype(traits);
    using S = typename Traits::Storage;
    constexpr int kVec = decltype(vec)::value;
    const int64_t threads = s.batch * s.height * s.width * (s.channels / kVec);
    backward_kernel<Traits, kVec><<<blocks_for(threads), kThreads, 0, stream>>>(
        static_cast<const S*>(grad_y), argmax, static_cast<S*>(grad_x), s);
  });
  NT_CHECK_LAUNCH();
}

}  // namespace nimble_train::ops
