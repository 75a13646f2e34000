// Tensor-level entry points of src/optim: check the tensors, then call the pointer-level code.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "optim/fused_update.h"

namespace nimble_train::optim {

// The tensors below are CPU tensors (the CPU reference runs) or CUDA tensors on one device (the
// kernels run on the current stream). Buffers are contiguous; see device_tables.h for layouts.

// The chunk table of flat buffers. offsets: int64 [num_tensors + 1] offsets into flat, elements;
// tensor_group: int64 [num_tensors]. Returns (chunks: int64 [num_chunks, 4], first_chunk: int64
// [num_tensors + 1]), CPU tensors.
std::tuple<at::Tensor, at::Tensor> make_chunk_table(const at::Tensor& offsets,
                                                     const at::Tensor& tensor_group,
                                                     int64_t chunk_elems);

// Rows of partials that grad_stats_ writes for a buffer of n elements.
int64_t grad_stats_partial_rows(int64_t n);

// partials[rows, 2] = per-block (sum of (grad * inv_scale)^2, non-finite flag). grads: a flat
// gradient buffer; inv_scale: float32 [1] or None; partials: float32 [grad_stats_rows(n), 2].
void grad_stats_(const at::Tensor& grads, const std::optional<at::Tensor>& inv_scale,
                 const at::Tensor& partials);

// The persistent tables of one fused optimizer.
struct StepTables {
  at::Tensor staged;       // float32 [num_groups * kNumStagedHyper]: a view of the values the
                           // step's staging ring fetched (src/capture/staging_ring.h)
  at::Tensor hyper;        // float32 [num_groups, kHyperColumns]
  at::Tensor param_steps;  // float32 [num_params]
  at::Tensor param_group;  // int64 [num_params]
  at::Tensor control;      // float32 [kControlSize]
};

// The step's control block (see step_control.h): takes the staged hyper-parameters, reduces the
// partials (None: no stats pass ran) into the norm, clip factor and overflow flag, writes
// found_inf (float32 [1] or None), advances the step counts. max_norm <= 0: no clipping.
void prepare_step_(const StepTables& tables, const std::optional<at::Tensor>& partials,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf, double max_norm,
                   bool skip_nonfinite);

// Updates, in place, after prepare_step_. params, grads and state: flat buffers of one dtype
// and length; chunks: from build_chunk_table; hyper and control: StepTables'.
void sgd_update_(const at::Tensor& params, const at::Tensor& grads,
                 const std::optional<at::Tensor>& momentum, const at::Tensor& chunks,
                 const at::Tensor& hyper, const at::Tensor& control);
void adam_update_(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                  const at::Tensor& chunks, const at::Tensor& hyper, const at::Tensor& control);
// chunk_norms: float32 [num_chunks, 2] and trust: float32 [num_tensors] scratch. passes:
// LambPasses (fused_update.h); for kNorms and kApply, sums: float32 [num_tensors, 2], each
// tensor's sums of p^2 and update^2, written by kNorms and read by kApply.
void lamb_update_(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& chunks,
                  const at::Tensor& first_chunk, const at::Tensor& hyper,
                  const at::Tensor& control, const at::Tensor& chunk_norms,
                  const at::Tensor& trust, const std::optional<at::Tensor>& sums = std::nullopt,
                  LambPasses passes = LambPasses::kAll);

}  // namespace nimble_train::optim
