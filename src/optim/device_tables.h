// Layouts of the small tables through which every per-step value reaches the optimizer kernels.
//
// Nothing that may change between steps is a kernel argument: a captured CUDA graph replays its
// kernel arguments verbatim, so learning rates, step counts, the loss scale and the overflow flag
// are read from these tables (device memory, or CPU memory on the CPU path) when the kernels run.
#pragma once

#include <cstdint>

namespace nimble_train::optim {

// Columns of the hyper-parameter table: float32 [num_groups][kHyperColumns], one row per
// parameter group. The host stages columns [0, kNumStagedHyper) for each step, in the step's
// staging ring (src/capture/slot_ring.h); prepare_step copies them in and computes the rest on
// the device.
enum Hyper : int {
  kLr,
  kWeightDecay,
  kMomentum,        // SGD
  kDampening,       // SGD
  kNesterov,        // SGD, 0 or 1
  kMaximize,        // SGD, Adam; 0 or 1
  kBeta1,           // Adam, LAMB
  kBeta2,           // Adam, LAMB
  kEps,             // Adam, LAMB
  kBiasCorrection,  // LAMB, 0 or 1 (Adam always corrects)
  kDecoupledDecay,  // Adam: 1 for AdamW's decoupled weight decay, 0 for L2 added to the gradient
  kAlwaysAdapt,     // LAMB: 1 applies the trust ratio even where weight_decay == 0
  kNumStagedHyper,
  // Written by prepare_step:
  kStep = kNumStagedHyper,  // steps taken; a step skipped for a non-finite gradient is not counted
  kAdamStepSize,            // lr / (1 - beta1^step)
  kAdamBiasCorrection2Sqrt, // sqrt(1 - beta2^step)
  kAdamDecayFactor,         // 1 - lr * weight_decay (decoupled weight decay)
  kLambInvBiasCorrection1,  // 1 / (1 - beta1^step), or 1 without bias correction
  kLambInvBiasCorrection2,  // 1 / (1 - beta2^step), or 1 without bias correction
  kFirstStep,               // 1 on step 1: SGD takes its momentum buffer from the gradient
  // torch computes these in double on the host and rounds them once; so does prepare_step
  // (1.0f - 0.9f is 0.10000002, 1 - 0.9 rounded is 0.1: a 2e-7 bias in every moment update).
  kOneMinusBeta1,
  kOneMinusBeta2,
  kOneMinusDampening,
  kHyperColumns
};

// The control block: float32 [kControlSize], written by prepare_step, read by the updates.
enum Control : int {
  kGradNorm,     // global L2 norm of the unscaled gradients (NaN when it was not computed)
  kGradFactor,   // inv_scale * clip factor: every gradient is multiplied by it in the update
  kFoundInf,     // 1 when a non-finite gradient was seen
  kSkipUpdate,   // 1: the update kernels leave parameters and state untouched this step
  kControlSize = 8
};

// Rows of the chunk table: int64 [num_chunks][kChunkColumns].
enum ChunkColumn : int { kChunkBegin, kChunkCount, kChunkGroup, kChunkTensor, kChunkColumns };

}  // namespace nimble_train::optim
