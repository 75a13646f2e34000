// A training batch norm's normalisation with the activation after it (a ReLU, with a residual
// added before it or not, or an exact GELU) in one pass, for channels-last activations.
//
// PyTorch's native batch norm runs three kernels in training: the batch statistics (mean and
// 1/sqrt(var + eps) per channel), the running averages' update, and the normalisation; the
// ReLU and a residual block's addition are kernels of their own, each reading and writing the
// whole activation again. Here, after the batch statistics (ours, batch_norm_stats below, or
// torch's), one kernel computes
//   y = act(weight * (x - mean) * invstd + bias [+ residual])
// (act: relu, or the exact GELU z * Phi(z), as torch's approximate="none"; a residual only with
// the ReLU) element by element, in float32 whatever the storage dtype, torch's normalisation
// expression in torch's order, and its first block updates the running averages as torch does:
//   running_mean = (1 - momentum) * running_mean + momentum * mean
//   running_var  = (1 - momentum) * running_var  + momentum * var * count / (count - 1)
// with the biased variance var = 1 / invstd^2 - eps (as SyncBatchNorm recovers it). The ReLU
// keeps NaN, as torch's does. The CPU reference computes the same, element by element.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/cuda_fwd.h"
#include "common/dtype.h"
#include "optim/dtype_traits.h"

namespace nimble_train::ops {

struct BatchNormActShape {
  int64_t rows = 0;  // N * H * W: the elements of each channel
  int64_t channels = 0;
};

// The per-channel values the normalisation reads (float32, [channels]); running_mean and
// running_var may both be null (no running averages to update).
enum class Activation : int8_t { kRelu, kGelu };

struct BatchNormActParams {
  Activation activation = Activation::kRelu;
  const float* mean = nullptr;
  const float* invstd = nullptr;
  const float* weight = nullptr;
  const float* bias = nullptr;
  float* running_mean = nullptr;
  float* running_var = nullptr;
  float momentum = 0.1f;
  float eps = 1e-5f;
};

struct BatchNormActMath {
  static constexpr float kSqrtHalf = 0.70710678118654752f;    // 1 / sqrt(2)
  static constexpr float kGeluBeta = 0.39894228040143268f;    // 1 / sqrt(2 pi)

  // The normalised value before the activation: torch's expression, then the residual.
  NT_HOST_DEVICE static float normalised(float x, float mean, float invstd, float weight,
                                         float bias, float residual) {
    return weight * (x - mean) * invstd + bias + residual;
  }

  // The ReLU keeps NaN, as torch's; the GELU is torch's exact one, z * Phi(z).
  NT_HOST_DEVICE static float activate(float z, Activation a) {
    if (a == Activation::kGelu) return z * 0.5f * erfcf(-z * kSqrtHalf);
    return z < 0.0f ? 0.0f : z;
  }

  // One element's output before storage rounding.
  NT_HOST_DEVICE static float apply(float x, float mean, float invstd, float weight, float bias,
                                    float residual, Activation a = Activation::kRelu) {
    return activate(normalised(x, mean, invstd, weight, bias, residual), a);
  }

  // The running averages of one channel after a batch of `rows` elements.
  NT_HOST_DEVICE static void update_running(float mean, float invstd, float momentum, float eps,
                                            int64_t rows, float* running_mean,
                                            float* running_var) {
    const float var = 1.0f / (invstd * invstd) - eps;
    const float unbiased = var * static_cast<float>(rows) / static_cast<float>(rows - 1);
    *running_mean = momentum * mean + (1.0f - momentum) * *running_mean;
    *running_var = momentum * unbiased + (1.0f - momentum) * *running_var;
  }
};

// The ReLU's mask as bits: the forward may write, for element i = row * channels + c of the
// output, bit i % 32 of word i / 32, set where the stored output is not <= 0 (where torch's
// threshold_backward lets the gradient through; NaN included), the bits past the last element
// clear. The backward then reads a bit per element instead of the output (1/32 of the reads
// of a float32 output, 1/16 of a half one).
inline int64_t relu_mask_words(const BatchNormActShape& s) {
  return (s.rows * s.channels + 31) / 32;
}

// The backward, from the output's gradient gy, the output y (or its mask) and the input x (one
// dtype, all channels-last [rows, channels]):
//   gz = y <= 0 ? 0 : gy                          (the ReLU's mask, as torch's threshold_backward)
//   gz = gy * (Phi(z) + z * phi(z))               (the GELU's, z recomputed from x)
//   sum_dy = sum over rows of gz,  sum_dy_xmu = sum over rows of gz * (x - mean)
//   grad_weight = sum_dy_xmu * invstd,  grad_bias = sum_dy
//   gx = (gz - sum_dy / rows - (x - mean) * invstd^2 * sum_dy_xmu / rows) * invstd * weight
// (torch's batch-norm backward in training) and, with a residual, its gradient gz. The sums are
// float32: the CUDA kernels sum each block's share of the rows, then the blocks' partial sums,
// each in a fixed order (deterministic); the reference sums the rows in order.
struct BatchNormActGrads {
  void* grad_x = nullptr;         // null: not wanted
  void* grad_residual = nullptr;  // null: not wanted
  float* grad_weight = nullptr;   // [channels], written (both always)
  float* grad_bias = nullptr;
};

struct BatchNormActBackwardMath {
  // The ReLU's mask bit of a stored output y (see relu_mask_words): whether the gradient
  // passes (gz = kept ? gy : 0).
  NT_HOST_DEVICE static uint32_t kept(float y) { return y <= 0.0f ? 0u : 1u; }

  // Bit i % 32 of `mask`'s word i / 32.
  NT_HOST_DEVICE static bool kept_at(const uint32_t* mask, int64_t i) {
    return (mask[i >> 5] >> (i & 31)) & 1u;
  }

  // The gradient through the GELU at the normalised value z (torch's gelu_backward:
  // Phi(z) + z * phi(z)).
  NT_HOST_DEVICE static float gelu_through(float gy, float z) {
    const float cdf = 0.5f * (1.0f + erff(z * BatchNormActMath::kSqrtHalf));
    const float pdf = expf(-0.5f * z * z) * BatchNormActMath::kGeluBeta;
    return gy * (cdf + z * pdf);
  }

  // gx of one element from the channel's sums (torch's batch_norm_backward_elemt).
  NT_HOST_DEVICE static float grad_input(float gz, float x, float mean, float invstd,
                                         float weight, float sum_dy, float sum_dy_xmu,
                                         float inv_rows) {
    const float grad_mean = sum_dy * inv_rows;
    const float proj_scale = sum_dy_xmu * inv_rows * invstd * invstd;
    return (gz - grad_mean - (x - mean) * proj_scale) * invstd * weight;
  }
};

// The batch statistics of a training batch norm over channels-last x [rows, channels]: per
// channel the mean and invstd = 1 / sqrt(var + eps), var the biased variance (as
// torch.batch_norm_stats gives them), float32. The sums are of d = x - shift and d * d, shift
// the channel's first value (so that they do not cancel when the mean is far from zero):
//   mean = shift + sum_d / rows,  var = max(sum_dd / rows - (sum_d / rows)^2, 0).
// On CUDA two kernels, as the backward's sums: blocks of packs of channels x a share of the rows
// add their part in a fixed tree; then 32 threads per channel add the parts, each a fixed subset
// in order, then in a fixed tree (deterministic). The reference adds the rows in order.
struct BatchNormStats {
  float* mean = nullptr;    // [channels], written
  float* invstd = nullptr;  // [channels], written
  float eps = 1e-5f;
};

struct BatchNormStatsMath {
  // The statistics from the sums over `rows` values.
  NT_HOST_DEVICE static void finish(float shift, float sum_d, float sum_dd, int64_t rows,
                                    float eps, float* mean, float* invstd) {
    const float inv_rows = 1.0f / static_cast<float>(rows);
    const float mean_d = sum_d * inv_rows;
    const float var = fmaxf(sum_dd * inv_rows - mean_d * mean_d, 0.0f);
    *mean = shift + mean_d;
    *invstd = 1.0f / sqrtf(var + eps);
  }
};

void batch_norm_stats_reference(const void* x, const BatchNormStats& out,
                                const BatchNormActShape& s, DType dtype);

// x, residual (null: none) and y: channels-last [rows, channels] of `dtype`; mask (null: not
// wanted; the ReLU only): relu_mask_words(s) words, written.
void batch_norm_relu_forward_reference(const void* x, const void* residual, void* y,
                                       uint32_t* mask, const BatchNormActParams& p,
                                       const BatchNormActShape& s, DType dtype);

// The ReLU's mask from `mask` when it is not null (y is then not read), else from y.
void batch_norm_relu_backward_reference(const void* grad_y, const void* y, const uint32_t* mask,
                                        const void* x, const BatchNormActParams& p,
                                        const BatchNormActGrads& g, const BatchNormActShape& s,
                                        DType dtype);

// ------------------------------------------------------------------ CUDA (NT_HAVE_CUDA builds)
// `early`: each kernel launched early (common/early_launch.cuh), after the one before it on
// `stream`, whichever that is; the results are the same either way.
void batch_norm_relu_forward_cuda(const void* x, const void* residual, void* y, uint32_t* mask,
                                  const BatchNormActParams& p, const BatchNormActShape& s,
                                  DType dtype, cudaStream_t stream, bool early);

// The statistics' workspace: floats for the blocks' parts.
int64_t batch_norm_stats_workspace(const BatchNormActShape& s, DType dtype, int device);

void batch_norm_stats_cuda(const void* x, const BatchNormStats& out, float* workspace,
                           const BatchNormActShape& s, DType dtype, cudaStream_t stream,
                           bool early);

// The backward's workspace: floats for its per-block partial sums and the channels' totals.
int64_t batch_norm_relu_backward_workspace(const BatchNormActShape& s, DType dtype, int device);

void batch_norm_relu_backward_cuda(const void* grad_y, const void* y, const uint32_t* mask,
                                   const void* x, const BatchNormActParams& p,
                                   const BatchNormActGrads& g, float* workspace,
                                   const BatchNormActShape& s, DType dtype, cudaStream_t stream,
                                   bool early);

}  // namespace nimble_train::ops
