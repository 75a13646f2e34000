// Per-step control of a fused optimizer step, all on the device: the global gradient norm and
// overflow check, the clip and unscale factor, the staged hyper-parameters and the step count.
//
// A step is grad_stats (one pass over each flat gradient buffer, only when unscaling, clipping
// or overflow detection is asked for) then prepare_step (one block), then the updates of
// fused_update.h, which read what prepare_step wrote. No value goes through the host, so the
// step never synchronises and a captured graph computes everything afresh at each replay.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/cuda_fwd.h"
#include "common/dtype.h"
#include "optim/device_tables.h"
#include "optim/dtype_traits.h"

namespace nimble_train::optim {

// grad_stats writes one partial row per CUDA block: float32 [rows][2] = (sum of squares of
// grad * inv_scale, 1 if a non-finite gradient was seen). The row count depends on n only, so
// the sum is reduced in the same order at every replay (deterministic norms). 2048 blocks of
// 256 threads fill an H100 (132 SMs x 8 resident blocks = 1056) about twice.
constexpr int64_t kStatsMaxRows = 2048;
constexpr int64_t kStatsElementsPerRow = 4096;
inline int64_t grad_stats_rows(int64_t n) {
  return std::clamp<int64_t>((n + kStatsElementsPerRow - 1) / kStatsElementsPerRow, 1,
                             kStatsMaxRows);
}

struct PrepareArgs {
  const float* partials = nullptr;  // [num_partials][2] from grad_stats; null: no stats this step
  int64_t num_partials = 0;
  const float* inv_scale = nullptr;  // [1] 1 / loss scale, or null (1)
  float max_norm = 0.0f;             // > 0: clip the global norm to it; otherwise no clipping
  bool skip_nonfinite = false;       // a non-finite gradient skips the update and the step count
  float* found_inf = nullptr;        // [1] written 1.0 or 0.0, or null
  // [num_groups][kNumStagedHyper]: this step's staged hyper-parameters, as the step's staging
  // ring fetched them (src/capture/slot_ring.h) into device memory at the top of the step.
  const float* staged = nullptr;
  float* hyper = nullptr;            // [num_groups][kHyperColumns]
  int64_t num_groups = 0;
  float* param_steps = nullptr;      // [num_params] each parameter's step (state["step"] views)
  const int64_t* param_group = nullptr;  // [num_params] group of each parameter
  int64_t num_params = 0;
  float* control = nullptr;          // [kControlSize]
};

// ------------------------------------------------------------------ CPU reference

// grads: [n] elements of the dtype of Traits; partials: [grad_stats_rows(n)][2]. The reference
// puts the whole sum in row 0.
template <typename Traits>
void grad_stats_reference(const typename Traits::Storage* grads, int64_t n,
                          const float* inv_scale, float* partials) {
  const float s = inv_scale ? *inv_scale : 1.0f;
  double sum = 0.0;
  bool nonfinite = false;
  for (int64_t i = 0; i < n; ++i) {
    const float g = Traits::load(grads[i]);
    nonfinite |= !std::isfinite(g);
    const float u = g * s;
    sum += double(u) * double(u);
  }
  std::fill(partials, partials + 2 * grad_stats_rows(n), 0.0f);
  partials[0] = static_cast<float>(sum);
  partials[1] = nonfinite ? 1.0f : 0.0f;
}

// The derived columns of one hyper row, from its staged columns and its (new) step count.
// Double precision, as torch computes these on the host in Python floats.
NT_HOST_DEVICE inline void derive_hyper(float* row) {
  const double step = row[kStep];
  const double lr = row[kLr];
  const double bc1 = 1.0 - pow(double(row[kBeta1]), step);
  const double bc2 = 1.0 - pow(double(row[kBeta2]), step);
  const bool lamb_bc = row[kBiasCorrection] != 0.0f;
  row[kAdamStepSize] = static_cast<float>(lr / bc1);
  row[kAdamBiasCorrection2Sqrt] = static_cast<float>(sqrt(bc2));
  row[kAdamDecayFactor] = static_cast<float>(1.0 - lr * double(row[kWeightDecay]));
  row[kLambInvBiasCorrection1] = lamb_bc ? static_cast<float>(1.0 / bc1) : 1.0f;
  row[kLambInvBiasCorrection2] = lamb_bc ? static_cast<float>(1.0 / bc2) : 1.0f;
  row[kFirstStep] = step == 1.0 ? 1.0f : 0.0f;
  row[kOneMinusBeta1] = static_cast<float>(1.0 - double(row[kBeta1]));
  row[kOneMinusBeta2] = static_cast<float>(1.0 - double(row[kBeta2]));
  row[kOneMinusDampening] = static_cast<float>(1.0 - double(row[kDampening]));
}

// The scalar part of prepare_step, shared by the reference and the kernel: from the reduced
// sum of squares and overflow flag, the norm, clip and skip decisions.
NT_HOST_DEVICE inline void decide_step(const PrepareArgs& a, double sum_sq, bool nonfinite) {
  const float s = a.inv_scale ? *a.inv_scale : 1.0f;
  const bool have_stats = a.partials != nullptr;
  const float norm = have_stats ? static_cast<float>(sqrt(sum_sq)) : NAN;
  // As torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1, branch-free
  // for the kernels that apply it (a factor of 1 when the norm is small).
  const float clip = (have_stats && a.max_norm > 0.0f)
                         ? fminf(1.0f, a.max_norm / (norm + 1e-6f)) : 1.0f;
  const bool found = have_stats && nonfinite;
  a.control[kGradNorm] = norm;
  a.control[kGradFactor] = s * clip;
  a.control[kFoundInf] = found ? 1.0f : 0.0f;
  a.control[kSkipUpdate] = (found && a.skip_nonfinite) ? 1.0f : 0.0f;
  if (a.found_inf) *a.found_inf = found ? 1.0f : 0.0f;
}

inline void prepare_step_reference(const PrepareArgs& a) {
  double sum = 0.0;
  bool nonfinite = false;
  for (int64_t i = 0; i < (a.partials ? a.num_partials : 0); ++i) {
    sum += a.partials[2 * i];
    nonfinite |= a.partials[2 * i + 1] != 0.0f;
  }
  decide_step(a, sum, nonfinite);
  const bool skip = a.control[kSkipUpdate] != 0.0f;
  for (int64_t g = 0; g < a.num_groups; ++g) {
    float* row = a.hyper + g * kHyperColumns;
    std::copy_n(a.staged + g * kNumStagedHyper, kNumStagedHyper, row);
    if (!skip) row[kStep] += 1.0f;
    derive_hyper(row);
  }
  for (int64_t i = 0; i < a.num_params; ++i) {
    a.param_steps[i] = a.hyper[a.param_group[i] * kHyperColumns + kStep];
  }
}

// ------------------------------------------------------------------ CUDA (NT_HAVE_CUDA builds)

// grads: [n] elements of `dtype` in device memory; inv_scale: [1] or null; partials:
// [grad_stats_rows(n)][2].
void grad_stats_cuda(const void* grads, DType dtype, int64_t n, const float* inv_scale,
                     float* partials, cudaStream_t stream);

// One block. Every pointer in `a` is device memory.
void prepare_step_cuda(const PrepareArgs& a, cudaStream_t stream);

}  // namespace nimble_train::optim
