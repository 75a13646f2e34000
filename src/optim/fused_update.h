// Fused optimizer updates over flat buffers: SGD, Adam/AdamW and LAMB, one pass each.
//
// Parameters, gradients and state of one dtype live in flat buffers; a chunk table cuts them
// into pieces that never straddle a parameter group (hyper-parameters are per group) nor a
// tensor (LAMB's norms are per tensor). The CUDA kernels run one block per chunk with 16-byte
// loads; the CPU reference walks the same chunks with the same per-element code (the *Math
// structs below), so the two cannot drift. Learning rate, step count, gradient factor and the
// skip flag are read from the tables of device_tables.h when the kernels run.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/cuda_fwd.h"
#include "common/dtype.h"
#include "optim/device_tables.h"
#include "optim/dtype_traits.h"

namespace nimble_train::optim {

// 8192 elements: 32 KiB of float32 per buffer, 8 iterations of 256 threads x 4 elements. Small
// enough that the last wave of blocks leaves SMs idle for microseconds, not tens of them (an
// AdamW chunk moves 8192 x 28 B = 229 KB), large enough that the table stays small (BERT-base:
// 13.5 K chunks, 430 KB). A multiple of 8 keeps chunk starts 16-byte aligned in every dtype.
constexpr int64_t kDefaultChunkElems = 8192;

// Cuts segments into chunks. offsets: [num_tensors + 1] offsets into flat, elements (tensor t
// owns [offsets[t], offsets[t + 1])); tensor_group: [num_tensors] group of each tensor;
// chunk_elems: the longest chunk. Returns the chunk table, [num_chunks][kChunkColumns], and
// fills first_chunk: [num_tensors + 1] index of each tensor's first chunk.
// Host code, run once when the flat buffers are built.
inline std::vector<int64_t> build_chunk_table(const int64_t* offsets, const int64_t* tensor_group,
                                              int64_t num_tensors, int64_t chunk_elems,
                                              std::vector<int64_t>* first_chunk) {
  std::vector<int64_t> table;
  first_chunk->assign(1, 0);
  for (int64_t t = 0; t < num_tensors; ++t) {
    for (int64_t begin = offsets[t]; begin < offsets[t + 1]; begin += chunk_elems) {
      const int64_t count = offsets[t + 1] - begin < chunk_elems ? offsets[t + 1] - begin
                                                                 : chunk_elems;
      table.insert(table.end(), {begin, count, tensor_group[t], t});
    }
    first_chunk->push_back(static_cast<int64_t>(table.size()) / kChunkColumns);
  }
  return table;
}

// The flat buffers of one dtype. state: SGD {momentum}; Adam {exp_avg, exp_avg_sq,
// max_exp_avg_sq (amsgrad only)}; LAMB {exp_avg, exp_avg_sq}. Unused entries are null.
struct FlatBuffers {
  void* param = nullptr;
  const void* grad = nullptr;
  void* state[3] = {nullptr, nullptr, nullptr};
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
};

// Where the per-step values come from (device memory on CUDA).
struct UpdateTables {
  const int64_t* chunks = nullptr;  // [num_chunks][kChunkColumns]
  int64_t num_chunks = 0;
  const float* hyper = nullptr;     // [num_groups][kHyperColumns]
  const float* control = nullptr;   // [kControlSize]
};

// LAMB's per-tensor pass. chunk_norms: [num_chunks][2] float32 scratch (sum of p^2, sum of
// update^2 per chunk); first_chunk: [num_tensors + 1]; trust: [num_tensors] float32 scratch;
// sums: [num_tensors][2] float32, each tensor's two sums between kNorms and kApply (below).
struct LambTables {
  const int64_t* first_chunk = nullptr;
  int64_t num_tensors = 0;
  float* chunk_norms = nullptr;
  float* trust = nullptr;
  float* sums = nullptr;
};

// Which of LAMB's passes one call runs. kAll: the three. kNorms: each tensor's sums of p^2 and
// update^2 into LambTables::sums, where a sharded step adds every rank's part of a tensor before
// the ratios; it writes nothing else (the moments it computes are computed again by kApply), so
// that a step whose sum over the ranks fails leaves the state as it was. kApply: the trust
// ratios from LambTables::sums, then the moments and the parameters.
enum class LambPasses { kAll, kNorms, kApply };

// ------------------------------------------------------------------ per-element math
// float32 arithmetic in torch.optim's order of operations (its single-tensor implementation),
// so float32 results differ from torch only by contraction into FMAs and vectorisation.

struct SgdMath {
  float lr, weight_decay, momentum, one_minus_dampening;
  bool nesterov, maximize, first_step;

  NT_HOST_DEVICE static SgdMath load(const float* h) {
    return {h[kLr], h[kWeightDecay], h[kMomentum], h[kOneMinusDampening], h[kNesterov] != 0.0f,
            h[kMaximize] != 0.0f, h[kFirstStep] != 0.0f};
  }
  NT_HOST_DEVICE bool uses_momentum() const { return momentum != 0.0f; }
  // p, buf in/out; g: the gradient times the grad factor.
  NT_HOST_DEVICE void apply(float& p, float g, float& buf) const {
    if (maximize) g = -g;
    if (weight_decay != 0.0f) g = g + weight_decay * p;
    if (momentum != 0.0f) {
      buf = first_step ? g : buf * momentum + one_minus_dampening * g;
      g = nesterov ? g + momentum * buf : buf;
    }
    p = p + (-lr) * g;
  }
};

template <bool kAmsgrad>
struct AdamMath {
  float weight_decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
      bias_correction2_sqrt, decay_factor;
  bool maximize, decoupled;

  NT_HOST_DEVICE static AdamMath load(const float* h) {
    return {h[kWeightDecay], h[kOneMinusBeta1], h[kBeta2], h[kOneMinusBeta2], h[kEps],
            h[kAdamStepSize],
            h[kAdamBiasCorrection2Sqrt], h[kAdamDecayFactor], h[kMaximize] != 0.0f,
            h[kDecoupledDecay] != 0.0f};
  }
  // torch's lerp: exact at both ends, the form chosen by the weight.
  NT_HOST_DEVICE static float lerp(float a, float b, float w) {
    return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
  }
  NT_HOST_DEVICE void apply(float& p, float g, float& m, float& v, float& vmax) const {
    if (maximize) g = -g;
    if (weight_decay != 0.0f) {
      if (decoupled) {
        p = p * decay_factor;
      } else {
        g = g + weight_decay * p;
      }
    }
    m = lerp(m, g, one_minus_beta1);
    v = v * beta2 + one_minus_beta2 * g * g;
    float second = v;
    if constexpr (kAmsgrad) {
      vmax = fmaxf(vmax, v);
      second = vmax;
    }
    const float denom = sqrtf(second) / bias_correction2_sqrt + eps;
    p = p + (-step_size) * (m / denom);
  }
};

struct LambMath {
  float lr, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc1, inv_bc2;
  bool adapt;

  NT_HOST_DEVICE static LambMath load(const float* h) {
    return {h[kLr], h[kWeightDecay], h[kBeta1], h[kOneMinusBeta1], h[kBeta2], h[kOneMinusBeta2],
            h[kEps],
            h[kLambInvBiasCorrection1], h[kLambInvBiasCorrection2],
            h[kWeightDecay] != 0.0f || h[kAlwaysAdapt] != 0.0f};
  }
  // The moments, in place (torch: exp_avg.mul_(beta1).add_(g, alpha=1 - beta1), and so on).
  NT_HOST_DEVICE void moments(float g, float& m, float& v) const {
    m = m * beta1 + one_minus_beta1 * g;
    v = v * beta2 + one_minus_beta2 * g * g;
  }
  // The update direction m^ / (sqrt(v^) + eps) + wd * p, from the stored moments: both passes
  // of LAMB compute it from the same rounded values, so the norm is the norm of what is applied.
  NT_HOST_DEVICE float direction(float p, float m, float v) const {
    return (m * inv_bc1) / (sqrtf(v * inv_bc2) + eps) + weight_decay * p;
  }
  // MLPerf BERT's LAMB: the trust ratio ||p|| / ||update|| where both norms are non-zero, 1
  // otherwise, and 1 for tensors without weight decay unless always_adapt.
  NT_HOST_DEVICE float trust(float param_norm, float update_norm) const {
    return (adapt && param_norm > 0.0f && update_norm > 0.0f) ? param_norm / update_norm : 1.0f;
  }
  NT_HOST_DEVICE float apply(float p, float u, float trust_ratio) const {
    return p + (-lr) * (trust_ratio * u);
  }
};

// ------------------------------------------------------------------ CPU reference

namespace detail {

// Calls f(row of chunk c) for each chunk, with the group's hyper row and the grad factor.
template <typename F>
void for_each_chunk(const UpdateTables& t, F&& f) {
  for (int64_t c = 0; c < t.num_chunks; ++c) {
    const int64_t* row = t.chunks + c * kChunkColumns;
    f(c, row[kChunkBegin], row[kChunkCount], t.hyper + row[kChunkGroup] * kHyperColumns);
  }
}

}  // namespace detail

template <typename Traits>
void sgd_update_reference(const FlatBuffers& b, const UpdateTables& t) {
  using S = typename Traits::Storage;
  if (t.control[kSkipUpdate] != 0.0f) return;
  const float factor = t.control[kGradFactor];
  auto* p = static_cast<S*>(b.param);
  const auto* g = static_cast<const S*>(b.grad);
  auto* mom = static_cast<S*>(b.state[0]);
  detail::for_each_chunk(t, [&](int64_t, int64_t begin, int64_t count, const float* h) {
    const SgdMath math = SgdMath::load(h);
    for (int64_t i = begin; i < begin + count; ++i) {
      float pf = Traits::load(p[i]);
      float buf = math.uses_momentum() ? Traits::load(mom[i]) : 0.0f;
      math.apply(pf, Traits::load(g[i]) * factor, buf);
      p[i] = Traits::store(pf);
      if (math.uses_momentum()) mom[i] = Traits::store(buf);
    }
  });
}

template <typename Traits, bool kAmsgrad>
void adam_update_reference(const FlatBuffers& b, const UpdateTables& t) {
  using S = typename Traits::Storage;
  if (t.control[kSkipUpdate] != 0.0f) return;
  const float factor = t.control[kGradFactor];
  auto* p = static_cast<S*>(b.param);
  const auto* g = static_cast<const S*>(b.grad);
  auto* m = static_cast<S*>(b.state[0]);
  auto* v = static_cast<S*>(b.state[1]);
  auto* vmax = static_cast<S*>(b.state[2]);
  detail::for_each_chunk(t, [&](int64_t, int64_t begin, int64_t count, const float* h) {
    const auto math = AdamMath<kAmsgrad>::load(h);
    for (int64_t i = begin; i < begin + count; ++i) {
      float pf = Traits::load(p[i]), mf = Traits::load(m[i]), vf = Traits::load(v[i]);
      float vmaxf = kAmsgrad ? Traits::load(vmax[i]) : 0.0f;
      math.apply(pf, Traits::load(g[i]) * factor, mf, vf, vmaxf);
      p[i] = Traits::store(pf);
      m[i] = Traits::store(mf);
      v[i] = Traits::store(vf);
      if (kAmsgrad) vmax[i] = Traits::store(vmaxf);
    }
  });
}

// LAMB in its three passes, as the kernels run it: moments and per-chunk norms, per-tensor trust
// ratios, then the parameter update (the direction recomputed from the stored moments); or the
// part of them `passes` names.
template <typename Traits>
void lamb_update_reference(const FlatBuffers& b, const UpdateTables& t, const LambTables& l,
                           LambPasses passes = LambPasses::kAll) {
  using S = typename Traits::Storage;
  if (t.control[kSkipUpdate] != 0.0f) return;
  const float factor = t.control[kGradFactor];
  auto* p = static_cast<S*>(b.param);
  const auto* g = static_cast<const S*>(b.grad);
  auto* m = static_cast<S*>(b.state[0]);
  auto* v = static_cast<S*>(b.state[1]);
  if (passes != LambPasses::kApply) {
    detail::for_each_chunk(t, [&](int64_t c, int64_t begin, int64_t count, const float* h) {
      const LambMath math = LambMath::load(h);
      double p_sq = 0.0, u_sq = 0.0;
      for (int64_t i = begin; i < begin + count; ++i) {
        const float pf = Traits::load(p[i]);
        float mf = Traits::load(m[i]), vf = Traits::load(v[i]);
        math.moments(Traits::load(g[i]) * factor, mf, vf);
        const S ms = Traits::store(mf), vs = Traits::store(vf);
        if (passes == LambPasses::kAll) {  // kNorms: written by kApply, once the ranks agree
          m[i] = ms;
          v[i] = vs;
        }
        const float u = math.direction(pf, Traits::load(ms), Traits::load(vs));
        p_sq += double(pf) * pf;
        u_sq += double(u) * u;
      }
      l.chunk_norms[2 * c] = static_cast<float>(p_sq);
      l.chunk_norms[2 * c + 1] = static_cast<float>(u_sq);
    });
  }
  for (int64_t tensor = 0; tensor < l.num_tensors; ++tensor) {
    double p_sq = 0.0, u_sq = 0.0;
    const int64_t c0 = l.first_chunk[tensor], c1 = l.first_chunk[tensor + 1];
    if (passes == LambPasses::kApply) {
      p_sq = l.sums[2 * tensor];
      u_sq = l.sums[2 * tensor + 1];
    } else {
      for (int64_t c = c0; c < c1; ++c) {
        p_sq += l.chunk_norms[2 * c];
        u_sq += l.chunk_norms[2 * c + 1];
      }
    }
    if (passes == LambPasses::kNorms) {
      l.sums[2 * tensor] = static_cast<float>(p_sq);
      l.sums[2 * tensor + 1] = static_cast<float>(u_sq);
      continue;
    }
    const float* h = t.hyper + (c1 > c0 ? t.chunks[c0 * kChunkColumns + kChunkGroup] : 0) *
                                   kHyperColumns;
    l.trust[tensor] = LambMath::load(h).trust(static_cast<float>(std::sqrt(p_sq)),
                                              static_cast<float>(std::sqrt(u_sq)));
  }
  if (passes == LambPasses::kNorms) return;
  detail::for_each_chunk(t, [&](int64_t c, int64_t begin, int64_t count, const float* h) {
    const LambMath math = LambMath::load(h);
    const float trust = l.trust[t.chunks[c * kChunkColumns + kChunkTensor]];
    for (int64_t i = begin; i < begin + count; ++i) {
      const float pf = Traits::load(p[i]);
      if (passes == LambPasses::kApply) {  // the moments kNorms computed and did not write
        float mf = Traits::load(m[i]), vf = Traits::load(v[i]);
        math.moments(Traits::load(g[i]) * factor, mf, vf);
        m[i] = Traits::store(mf);
        v[i] = Traits::store(vf);
      }
      const float u = math.direction(pf, Traits::load(m[i]), Traits::load(v[i]));
      p[i] = Traits::store(math.apply(pf, u, trust));
    }
  });
}

// ------------------------------------------------------------------ CUDA (NT_HAVE_CUDA builds)
// Every pointer is device memory; one launch per call (LAMB: three, two for either part).

void sgd_update_cuda(const FlatBuffers& b, const UpdateTables& t, cudaStream_t stream);
void adam_update_cuda(const FlatBuffers& b, const UpdateTables& t, bool amsgrad,
                      cudaStream_t stream);
void lamb_update_cuda(const FlatBuffers& b, const UpdateTables& t, const LambTables& l,
                      LambPasses passes, cudaStream_t stream);

}  // namespace nimble_train::optim
