// A training batch norm's normalisation with the ReLU after it (and a residual added before
// the ReLU) in one pass, for channels-last activations.
//
// PyTorch's native batch norm runs three kernels in training: the batch statistics (mean and
// 1/sqrt(var + eps) per channel), the running averages' update, and the normalisation; the
// ReLU and a residual block's addition are kernels of their own, each reading and writing the
// whole activation again. Here, after torch's statistics kernel, one kernel computes
//   y = relu(weight * (x - mean) * invstd + bias [+ residual])
// element by element, in float32 whatever the storage dtype, torch's normalisation expression
// in torch's order, and its first block updates the running averages as torch does:
//   running_mean = (1 - momentum) * running_mean + momentum * mean
//   running_var  = (1 - momentum) * running_var  + momentum * var * count / (count - 1)
// with the biased variance var = 1 / invstd^2 - eps (as SyncBatchNorm recovers it). The ReLU
// keeps NaN, as torch's does. The CPU reference computes the same, element by element.
#pragma once

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
struct BatchNormActParams {
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
  // One element's output before storage rounding: torch's expression, then the residual and
  // the ReLU (NaN kept).
  NT_HOST_DEVICE static float apply(float x, float mean, float invstd, float weight, float bias,
                                    float residual) {
    float z = weight * (x - mean) * invstd + bias;
    z += residual;
    return z < 0.0f ? 0.0f : z;
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

// x, residual (null: none) and y: channels-last [rows, channels] of `dtype`.
void batch_norm_relu_forward_reference(const void* x, const void* residual, void* y,
                                       const BatchNormActParams& p, const BatchNormActShape& s,
                                       DType dtype);

// ------------------------------------------------------------------ CUDA (NT_HAVE_CUDA builds)
void batch_norm_relu_forward_cuda(const void* x, const void* residual, void* y,
                                  const BatchNormActParams& p, const BatchNormActShape& s,
                                  DType dtype, cudaStream_t stream);

}  // namespace nimble_train::ops
