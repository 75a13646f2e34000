// The fused optimizer step over tensors: the flat buffers a model's parameters move into, and
// the step's sequence (gradient statistics, prepare, the updates). One implementation for both
// faces: Python's FusedOptimizer (python/nimble_train/optim/fused.py, which adds torch.optim's
// state format) and the LibTorch Step (nimble_train/step.h, which adds torch::optim's).
//
// Moving parameters in: each parameter of one dtype becomes a segment of its dtype's flat
// buffers (layout: flat_layout.h); its data and gradient become views into them (set_data, and
// the gradient assigned), so autograd accumulates into the flat gradient buffer in place and
// the update is one vectorised pass. Values move with the tensors: the model is unchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "optim/boundary.h"

namespace nimble_train::optim {

enum class Algorithm { kSgd, kAdam, kLamb };

// "sgd", "adam" (Adam and AdamW) or "lamb"; InvalidArgument for anything else.
Algorithm parse_algorithm(const std::string& name);

// The flat buffers of one dtype.
struct FlatTensors {
  at::ScalarType dtype = at::kFloat;
  std::vector<at::Tensor> params;      // the parameters, in flat order
  std::vector<int64_t> param_index;    // each one's index in the list given to build
  std::vector<int64_t> groups;         // each one's param group
  std::vector<int64_t> offsets;        // [num_tensors + 1] segment offsets, elements
  at::Tensor param;                    // the flat buffers
  at::Tensor grad;
  std::vector<at::Tensor> state;       // one per state buffer, in the order asked for
  std::vector<at::Tensor> grad_views;  // each parameter's gradient view
  at::Tensor chunks;                   // int64 [num_chunks, 4] on the device
  at::Tensor first_chunk;              // int64 [num_tensors + 1] on the device
  at::Tensor chunk_norms;              // LAMB scratch: float32 [num_chunks, 2]
  at::Tensor trust;                    // LAMB scratch: float32 [num_tensors]

  // Tensor i's view of `flat` (a buffer of this dtype's length), laid out as the parameter is:
  // a channels_last weight keeps its strides, so convolutions see the memory format (and
  // cuDNN the algorithms) they had before.
  at::Tensor segment(const at::Tensor& flat, int64_t i) const;
};

// Moves `params` ((group, parameter) pairs, in the optimizer's order) into flat buffers per
// dtype, in order of first appearance: data and gradient become views (values copied; an
// undefined gradient becomes zeros). num_state: state buffers per dtype (zeros).
std::vector<FlatTensors> build_flat_buffers(
    const std::vector<std::pair<int64_t, at::Tensor>>& params, int64_t num_state,
    at::Device device, int64_t shard_world, int64_t chunk_elems, bool lamb);

// Puts back, for every parameter, the views user code moved away: a gradient set to undefined
// (zero_grad(set_to_none)) or replaced, data swapped. Values are copied into the views first
// (an undefined gradient becomes zero). Host work: outside any capture.
void reattach(std::vector<FlatTensors>& flats);
// Only undefined gradients go back to their views, keeping what the views hold (the graphs
// of an accumulation window wrote it there).
void attach_grads(std::vector<FlatTensors>& flats);
// One memset per flat gradient buffer (capturable); undefined gradients go back to their views.
void zero_grads(std::vector<FlatTensors>& flats);

// "" when `now` can stand where the graphs read `then` (the same dtype, shape and device:
// their kernels were made for those), else both described: "Half [16] on cuda:0 where the
// graphs read Float [16] on cuda:0". An undefined tensor fits nowhere.
std::string layout_mismatch(const at::Tensor& now, const at::Tensor& then);

// A step's parameters as it fixed them. Which required gradients when it fixed what it trains
// (its flat buffers, its graphs): a parameter frozen since (requires_grad_(false)) would go on
// being updated by them, one unfrozen never would. And, from capture on, the storage the graphs
// read: `p.data = t` (a re-initialised layer, weights assigned, module.to()) gives a parameter
// data the graphs never see, while they go on training the old. The step checks both before
// each call (`changed`: one pass, cheap enough for every replay), refuses the first, and puts
// the second back: the new values copied where the graphs read them.
class ParamWatch {
 public:
  // params: the optimizer's parameters (their flags are watched), then any others the graphs
  // read (the model's parameters outside the optimizer: only their storage is watched).
  ParamWatch(std::vector<at::Tensor> params, int64_t trained);
  // From here on the graphs read each parameter's data where it is now (kept alive with them).
  // others, when given, first take the place of the parameters after the trained ones: what the
  // graphs about to be captured read besides, as it is then (a buffer a module assigned anew
  // since construction, model.float()'s BatchNorm statistics, is watched where it is now).
  void fix_storage(std::optional<std::vector<at::Tensor>> others = std::nullopt);
  // A flag changed or a parameter's data moved since.
  bool changed() const;
  // The index of the first optimizer parameter whose requires_grad differs from then, or -1.
  int64_t first_flag_changed() const;
  bool was_trainable(int64_t i) const { return flags_.at(size_t(i)); }
  int64_t trained() const { return int64_t(flags_.size()); }
  // The parameters whose data is no longer the storage the graphs read.
  std::vector<int64_t> moved() const;
  // Why parameter i's new data cannot go back where the graphs read it (another shape, dtype
  // or device: the graphs' kernels were made for the old; memory shared with another
  // parameter: a tie the graphs cannot keep), or "" when it can.
  std::string why_not_restorable(int64_t i) const;
  // The first other parameter whose data shares memory with parameter i's, or -1.
  int64_t shares_memory_with(int64_t i) const;
  // Every moved parameter's new values are copied into the storage the graphs read, and the
  // parameter views it again. All or nothing: throws, changing nothing, when one cannot go
  // back (why_not_restorable says why first). Between calls, outside any capture; or inside
  // one, after the step's forwards, whose replays then copy what they give the tensors back.
  void restore();
  // Every moved parameter views the storage the graphs read again, its values as they are there:
  // after a failed capture, which ran nothing (the data its forwards gave holds no values).
  void undo_moves();
  // The graphs about to be captured again read each of `others` (indices of parameters after
  // the trained ones) where its data is now: one another step's update moved into its flat
  // buffers, which the old graphs would go on reading where it was. Throws, changing nothing,
  // for a trained parameter's index or before fix_storage.
  void adopt(const std::vector<int64_t>& others);

 private:
  bool is_moved(size_t i) const;

  std::vector<at::Tensor> params_;
  std::vector<bool> flags_;           // the first `trained` parameters'
  std::vector<at::Tensor> captured_;  // aliases of the data the graphs read (empty: not fixed)
};

// What one pass of the update reads and writes: a whole FlatTensors, or one rank's slice of it
// when the state is sharded. state: in the order of the algorithm's state keys (SGD:
// momentum; Adam: exp_avg, exp_avg_sq[, max_exp_avg_sq]; LAMB: exp_avg, exp_avg_sq); empty
// for SGD without momentum.
struct UpdateTarget {
  at::Tensor param;
  at::Tensor grad;
  std::vector<at::Tensor> state;
  at::Tensor chunks;
  at::Tensor first_chunk;  // LAMB only (and chunk_norms, trust)
  at::Tensor chunk_norms;
  at::Tensor trust;
  at::Tensor partials;     // this target's rows of the gradient-statistics partials
  // Sharded LAMB (a rank's slice holds parts of tensors): each local tensor's row of
  // global_sums (int64 [num_tensors]), its sums of p^2 and update^2 (float32 [num_tensors, 2]),
  // and the float32 [rows, 2] sums that every target of a step shares, added over the ranks
  // before the trust ratios. range_sums: the rows of global_sums of every tensor in the range
  // the slice is all-gathered from (its bucket, whole tensors on every rank), which an update
  // of this slice alone (update_) adds over the ranks. Undefined for a whole buffer.
  at::Tensor tensor_rows;
  at::Tensor tensor_sums;
  at::Tensor global_sums;
  at::Tensor range_sums;
};

UpdateTarget target_of(const FlatTensors& flat);

// One float32 [rows, 2] buffer for the gradient statistics of every target; each target gets
// its rows as `partials`. Returns the whole buffer.
at::Tensor assign_partials(std::vector<UpdateTarget>& targets, at::Device device);

struct FusedStepArgs {
  std::optional<at::Tensor> inv_scale;   // float32 [1]: 1 / loss scale
  std::optional<at::Tensor> found_inf;   // float32 [1]: written 1 on a non-finite gradient
  std::optional<at::Tensor> grad_scale;  // float32 [1]: a factor without the overflow skip
  double max_grad_norm = 0;              // > 0: clip the global norm to it
  // Sharded state: sums the partials over the ranks, in place, before prepare (and sharded
  // LAMB's per-tensor sums before its trust ratios).
  std::function<void(const at::Tensor&)> reduce_partials;
  // The gradient statistics were computed already, into `partials`, by grad_stats_parts_
  // with gradient_factor(args) (a step whose statistics overlap the backward).
  bool stats_done = false;
};

// Whether a step with these arguments computes gradient statistics: unscaling, an overflow
// check or clipping asks for the global norm or overflow flag.
bool needs_stats(const FusedStepArgs& args);
// What the statistics and the update multiply the gradients by: inv_scale times grad_scale
// (either alone; neither: none). Checks the arguments.
std::optional<at::Tensor> gradient_factor(const FusedStepArgs& args, at::Device device);

// The step: gradient statistics (when unscaling, clipping or a gradient factor asks for
// them), prepare_step_, then the algorithm's update over every target, on the current stream
// (capturable) or at once on the CPU. tables.staged must hold this step's staged values.
// Sharded LAMB (targets with tensor_rows): every target's per-tensor sums of p^2 and update^2,
// added over the ranks with args.reduce_partials, then the trust ratios, moments and
// parameters; if the reduce raises, nothing but the step counts (in tables) has changed.
// Returns the global gradient norm (a 0-dim view of the control block, valid until the next
// step) when it was computed, else an undefined tensor.
at::Tensor fused_step(Algorithm algorithm, const std::vector<UpdateTarget>& targets,
                      const StepTables& tables, const at::Tensor& partials,
                      const FusedStepArgs& args);

// The statistics in parts, for a step that needs them and overlaps the backward (a
// data-parallel step takes each all-reduce bucket's share of the norm right after its
// collective): gradient_factor once, then grad_stats_parts_ over the targets in any grouping,
// each target once per step, on streams ordered after the factor was computed; then fused_step
// with args.stats_done and the partials the targets wrote. The update itself still waits for
// the last gradient: clipping and the overflow skip need every one.
void grad_stats_parts_(const std::vector<UpdateTarget>& targets,
                       const std::optional<at::Tensor>& factor);

// The step in two parts, for updates that overlap the backward (a data-parallel step updates
// each all-reduce bucket right after its collective): prepare_update_, which needs no gradient
// (so no unscaling, clipping or overflow check: nothing global), then update_ over the targets
// in any grouping, each target once per step, on streams ordered after prepare_update_.
// Together they do what fused_step does when it computes no statistics. grad_scale: as
// FusedStepArgs'. LAMB's trust ratios need each target to hold whole tensors; a sharded slice
// (tensor_rows) holds parts of them, so update_ takes its part of its tensors' norms, adds the
// ranks' parts with `reduce` (an in-place sum over the ranks, on range_sums: every rank calls
// it for the same range, in the same order), then applies the whole tensors' ratios.
void prepare_update_(const StepTables& tables, const std::optional<at::Tensor>& grad_scale);
void update_(Algorithm algorithm, const std::vector<UpdateTarget>& targets,
             const StepTables& tables,
             const std::function<void(const at::Tensor&)>& reduce = {});

}  // namespace nimble_train::optim
