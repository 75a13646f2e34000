// CUDA kernels and launchers for fused_update.h: one block per chunk, 16-byte loads, the
// per-element math of the *Math structs (shared with the CPU reference).
#include <cstdint>
#include <type_traits>

#include "common/check.h"
#include "common/cuda_check.h"
#include "common/pack.cuh"
#include "optim/fused_update.h"

namespace nimble_train::optim {
namespace {

constexpr int kThreads = 256;

template <typename T, int kThreadsInBlock>
__device__ T block_sum(T v, T* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int width = kThreadsInBlock / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
    __syncthreads();
  }
  const T total = shared[0];
  __syncthreads();
  return total;
}

// This block's chunk: [begin, begin + count) of the flat buffers, and its group's hyper row.
struct Chunk {
  int64_t begin, count, tensor;
  const float* hyper;
};

__device__ Chunk this_chunk(const UpdateTables& t) {
  const int64_t* row = t.chunks + int64_t(blockIdx.x) * kChunkColumns;
  return {row[kChunkBegin], row[kChunkCount], row[kChunkTensor],
          t.hyper + row[kChunkGroup] * kHyperColumns};
}

// Calls body(i, width) over the chunk: width kVec (16-byte packs) where the chunk starts on a
// pack boundary, then width 1 for the tail (and for a chunk that does not; the builders of the
// chunk table align every chunk, so that is only for callers with other layouts).
template <int kVec, typename Body>
__device__ void for_each_pack(const Chunk& c, Body&& body) {
  const int64_t packs = c.begin % kVec == 0 ? c.count / kVec : 0;
  for (int64_t j = threadIdx.x; j < packs; j += blockDim.x) {
    body(c.begin + j * kVec, std::integral_constant<int, kVec>{});
  }
  for (int64_t j = packs * kVec + threadIdx.x; j < c.count; j += blockDim.x) {
    body(c.begin + j, std::integral_constant<int, 1>{});
  }
}

template <typename Traits, int kVec>
__global__ void __launch_bounds__(kThreads) sgd_kernel(FlatBuffers b, UpdateTables t) {
  using S = typename Traits::Storage;
  if (t.control[kSkipUpdate] != 0.0f) return;
  const Chunk c = this_chunk(t);
  const SgdMath math = SgdMath::load(c.hyper);
  const float factor = t.control[kGradFactor];
  S* param = static_cast<S*>(b.param);
  const S* grad = static_cast<const S*>(b.grad);
  S* mom = static_cast<S*>(b.state[0]);
  const bool uses_momentum = math.uses_momentum();  // no momentum: its buffer is not touched
  for_each_pack<kVec>(c, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    Pack<S, W> p = load_pack<W>(param, i);
    const Pack<S, W> g = load_pack<W>(grad, i);
    Pack<S, W> buf{};
    if (uses_momentum) buf = load_pack<W>(mom, i);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      float pf = Traits::load(p.v[e]);
      float bf = uses_momentum ? Traits::load(buf.v[e]) : 0.0f;
      math.apply(pf, Traits::load(g.v[e]) * factor, bf);
      p.v[e] = Traits::store(pf);
      buf.v[e] = Traits::store(bf);
    }
    store_pack<W>(param, i, p);
    if (uses_momentum) store_pack<W>(mom, i, buf);
  });
}

template <typename Traits, int kVec, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads) adam_kernel(FlatBuffers b, UpdateTables t) {
  using S = typename Traits::Storage;
  if (t.control[kSkipUpdate] != 0.0f) return;
  const Chunk c = this_chunk(t);
  const auto math = AdamMath<kAmsgrad>::load(c.hyper);
  const float factor = t.control[kGradFactor];
  S* param = static_cast<S*>(b.param);
  const S* grad = static_cast<const S*>(b.grad);
  S* exp_avg = static_cast<S*>(b.state[0]);
  S* exp_avg_sq = static_cast<S*>(b.state[1]);
  S* max_exp_avg_sq = static_cast<S*>(b.state[2]);
  for_each_pack<kVec>(c, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    Pack<S, W> p = load_pack<W>(param, i);
    const Pack<S, W> g = load_pack<W>(grad, i);
    Pack<S, W> m = load_pack<W>(exp_avg, i);
    Pack<S, W> v = load_pack<W>(exp_avg_sq, i);
    Pack<S, W> vmax{};
    if constexpr (kAmsgrad) vmax = load_pack<W>(max_exp_avg_sq, i);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      float pf = Traits::load(p.v[e]), mf = Traits::load(m.v[e]), vf = Traits::load(v.v[e]);
      float vmaxf = kAmsgrad ? Traits::load(vmax.v[e]) : 0.0f;
      math.apply(pf, Traits::load(g.v[e]) * factor, mf, vf, vmaxf);
      p.v[e] = Traits::store(pf);
      m.v[e] = Traits::store(mf);
      v.v[e] = Traits::store(vf);
      if constexpr (kAmsgrad) vmax.v[e] = Traits::store(vmaxf);
    }
    store_pack<W>(param, i, p);
    store_pack<W>(exp_avg, i, m);
    store_pack<W>(exp_avg_sq, i, v);
    if constexpr (kAmsgrad) store_pack<W>(max_exp_avg_sq, i, vmax);
  });
}

// LAMB pass 1: moments, and per chunk the sums of p^2 and update^2 (fixed-order block sums
// into [num_chunks][2], so the per-tensor norms are deterministic without atomics). Without
// kStore (a sharded step's kNorms) the moments are computed and not written: nothing changes
// before the ranks have added their norms, and pass 3 computes them again.
template <typename Traits, int kVec, bool kStore>
__global__ void __launch_bounds__(kThreads)
    lamb_moments_kernel(FlatBuffers b, UpdateTables t, LambTables l) {
  using S = typename Traits::Storage;
  __shared__ float shared[kThreads];
  if (t.control[kSkipUpdate] != 0.0f) return;
  const Chunk c = this_chunk(t);
  const LambMath math = LambMath::load(c.hyper);
  const float factor = t.control[kGradFactor];
  const S* param = static_cast<const S*>(b.param);
  const S* grad = static_cast<const S*>(b.grad);
  S* exp_avg = static_cast<S*>(b.state[0]);
  S* exp_avg_sq = static_cast<S*>(b.state[1]);
  float p_sq = 0.0f, u_sq = 0.0f;
  for_each_pack<kVec>(c, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    const Pack<S, W> p = load_pack<W>(param, i);
    const Pack<S, W> g = load_pack<W>(grad, i);
    Pack<S, W> m = load_pack<W>(exp_avg, i);
    Pack<S, W> v = load_pack<W>(exp_avg_sq, i);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const float pf = Traits::load(p.v[e]);
      float mf = Traits::load(m.v[e]), vf = Traits::load(v.v[e]);
      math.moments(Traits::load(g.v[e]) * factor, mf, vf);
      m.v[e] = Traits::store(mf);
      v.v[e] = Traits::store(vf);
      const float u = math.direction(pf, Traits::load(m.v[e]), Traits::load(v.v[e]));
      p_sq += pf * pf;
      u_sq += u * u;
    }
    if constexpr (kStore) {
      store_pack<W>(exp_avg, i, m);
      store_pack<W>(exp_avg_sq, i, v);
    }
  });
  const float p_total = block_sum<float, kThreads>(p_sq, shared);
  const float u_total = block_sum<float, kThreads>(u_sq, shared);
  if (threadIdx.x == 0) {
    l.chunk_norms[2 * int64_t(blockIdx.x)] = p_total;
    l.chunk_norms[2 * int64_t(blockIdx.x) + 1] = u_total;
  }
}

// LAMB pass 2: one block per tensor sums its chunks' partials (double, fixed order) into its
// trust ratio; kNorms: into l.sums instead; kApply: the ratio from l.sums.
__global__ void __launch_bounds__(kThreads)
    lamb_trust_kernel(UpdateTables t, LambTables l, LambPasses passes) {
  __shared__ double shared[kThreads];
  if (t.control[kSkipUpdate] != 0.0f) return;
  const int64_t tensor = blockIdx.x;
  const int64_t c0 = l.first_chunk[tensor], c1 = l.first_chunk[tensor + 1];
  double p_total = 0.0, u_total = 0.0;
  if (passes == LambPasses::kApply) {
    p_total = l.sums[2 * tensor];
    u_total = l.sums[2 * tensor + 1];
  } else {
    double p_sq = 0.0, u_sq = 0.0;
    for (int64_t c = c0 + threadIdx.x; c < c1; c += kThreads) {
      p_sq += l.chunk_norms[2 * c];
      u_sq += l.chunk_norms[2 * c + 1];
    }
    p_total = block_sum<double, kThreads>(p_sq, shared);
    u_total = block_sum<double, kThreads>(u_sq, shared);
  }
  if (threadIdx.x == 0 && passes == LambPasses::kNorms) {
    l.sums[2 * tensor] = static_cast<float>(p_total);
    l.sums[2 * tensor + 1] = static_cast<float>(u_total);
  } else if (threadIdx.x == 0) {
    const int64_t group = c1 > c0 ? t.chunks[c0 * kChunkColumns + kChunkGroup] : 0;
    const LambMath math = LambMath::load(t.hyper + group * kHyperColumns);
    l.trust[tensor] = math.trust(static_cast<float>(sqrt(p_total)),
                                 static_cast<float>(sqrt(u_total)));
  }
}

// LAMB pass 3: p -= lr * trust * update, the update recomputed from the stored moments (reading
// m and v again costs less than writing the update out and reading it back). kMoments (a
// sharded step's kApply): the moments computed from the gradient first, as pass 1 computed
// them, and written.
template <typename Traits, int kVec, bool kMoments>
__global__ void __launch_bounds__(kThreads)
    lamb_apply_kernel(FlatBuffers b, UpdateTables t, LambTables l) {
  using S = typename Traits::Storage;
  if (t.control[kSkipUpdate] != 0.0f) return;
  const Chunk c = this_chunk(t);
  const LambMath math = LambMath::load(c.hyper);
  const float trust = l.trust[c.tensor];
  const float factor = t.control[kGradFactor];
  S* param = static_cast<S*>(b.param);
  const S* grad = static_cast<const S*>(b.grad);
  S* exp_avg = static_cast<S*>(b.state[0]);
  S* exp_avg_sq = static_cast<S*>(b.state[1]);
  for_each_pack<kVec>(c, [&](int64_t i, auto width) {
    constexpr int W = decltype(width)::value;
    Pack<S, W> p = load_pack<W>(param, i);
    Pack<S, W> m = load_pack<W>(exp_avg, i);
    Pack<S, W> v = load_pack<W>(exp_avg_sq, i);
    if constexpr (kMoments) {
      const Pack<S, W> g = load_pack<W>(grad, i);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        float mf = Traits::load(m.v[e]), vf = Traits::load(v.v[e]);
        math.moments(Traits::load(g.v[e]) * factor, mf, vf);
        m.v[e] = Traits::store(mf);
        v.v[e] = Traits::store(vf);
      }
      store_pack<W>(exp_avg, i, m);
      store_pack<W>(exp_avg_sq, i, v);
    }
#pragma unroll
    for (int e = 0; e < W; ++e) {
      const float pf = Traits::load(p.v[e]);
      const float u = math.direction(pf, Traits::load(m.v[e]), Traits::load(v.v[e]));
      p.v[e] = Traits::store(math.apply(pf, u, trust));
    }
    store_pack<W>(param, i, p);
  });
}

// 16-byte packs need every base pointer 16-byte aligned; otherwise one element at a time.
bool all_aligned(const FlatBuffers& b) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return aligned(b.param) && aligned(b.grad) && aligned(b.state[0]) && aligned(b.state[1]) &&
         aligned(b.state[2]);  // null is aligned
}

void check_chunks(const UpdateTables& t, const char* op) {
  NT_CHECK(t.num_chunks >= 0 && t.num_chunks < (int64_t(1) << 31), op,
           ": chunk count must be in [0, 2^31); got ", t.num_chunks);
}

// Calls launch(traits, vector width) for the dtype and the alignment of the buffers.
template <typename Launch>
void dispatch(const FlatBuffers& b, Launch&& launch) {
  const bool aligned = all_aligned(b);
  dispatch_dtype(b.dtype, [&](auto traits) {
    using Traits = decltype(traits);
    constexpr int kVec = 16 / sizeof(typename Traits::Storage);
    if (aligned) {
      launch(traits, std::integral_constant<int, kVec>{});
    } else {
      launch(traits, std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace

void sgd_update_cuda(const FlatBuffers& b, const UpdateTables& t, cudaStream_t stream) {
  check_chunks(t, "sgd_update");
  if (t.num_chunks == 0) return;
  dispatch(b, [&](auto traits, auto vec) {
    sgd_kernel<decltype(traits), decltype(vec)::value>
        <<<static_cast<unsigned>(t.num_chunks), kThreads, 0, stream>>>(b, t);
  });
  NT_CHECK_LAUNCH();
}

void adam_update_cuda(const FlatBuffers& b, const UpdateTables& t, bool amsgrad,
                      cudaStream_t stream) {
  check_chunks(t, "adam_update");
  if (t.num_chunks == 0) return;
  dispatch(b, [&](auto traits, auto vec) {
    using Traits = decltype(traits);
    constexpr int kVec = decltype(vec)::value;
    const unsigned grid = static_cast<unsigned>(t.num_chunks);
    if (amsgrad) {
      adam_kernel<Traits, kVec, true><<<grid, kThreads, 0, stream>>>(b, t);
    } else {
      adam_kernel<Traits, kVec, false><<<grid, kThreads, 0, stream>>>(b, t);
    }
  });
  NT_CHECK_LAUNCH();
}

void lamb_update_cuda(const FlatBuffers& b, const UpdateTables& t, const LambTables& l,
                      LambPasses passes, cudaStream_t stream) {
  check_chunks(t, "lamb_update");
  NT_CHECK(l.num_tensors >= 0 && l.num_tensors < (int64_t(1) << 31),
           "lamb_update: tensor count must be in [0, 2^31); got ", l.num_tensors);
  if (t.num_chunks == 0) return;
  const unsigned grid = static_cast<unsigned>(t.num_chunks);
  if (passes == LambPasses::kAll) {
    dispatch(b, [&](auto traits, auto vec) {
      lamb_moments_kernel<decltype(traits), decltype(vec)::value, true>
          <<<grid, kThreads, 0, stream>>>(b, t, l);
    });
    NT_CHECK_LAUNCH();
  } else if (passes == LambPasses::kNorms) {
    dispatch(b, [&](auto traits, auto vec) {
      lamb_moments_kernel<decltype(traits), decltype(vec)::value, false>
          <<<grid, kThreads, 0, stream>>>(b, t, l);
    });
    NT_CHECK_LAUNCH();
  }
  if (l.num_tensors > 0) {
    lamb_trust_kernel<<<static_cast<unsigned>(l.num_tensors), kThreads, 0, stream>>>(t, l,
                                                                                     passes);
    NT_CHECK_LAUNCH();
  }
  if (passes == LambPasses::kNorms) return;
  dispatch(b, [&](auto traits, auto vec) {
    if (passes == LambPasses::kApply) {
      lamb_apply_kernel<decltype(traits), decltype(vec)::value, true>
          <<<grid, kThreads, 0, stream>>>(b, t, l);
    } else {
      lamb_apply_kernel<decltype(traits), decltype(vec)::value, false>
          <<<grid, kThreads, 0, stream>>>(b, t, l);
    }
  });
  NT_CHECK_LAUNCH();
}

}  // namespace nimble_train::optim
