// The fused optimizer step over tensors (see fused_step.h).
#include "optim/fused_step.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "common/check.h"
#include "optim/device_tables.h"
#include "optim/flat_layout.h"

namespace nimble_train::optim {
namespace {

// Non-overlapping and dense: the strides are a permutation of a contiguous layout's.
bool dense(const at::Tensor& p) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < p.dim(); ++d) dims.emplace_back(p.stride(d), p.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (size != 1 && stride != expected) return false;
    expected *= size;
  }
  return true;
}

at::Tensor host_int64(const std::vector<int64_t>& values) {
  return at::from_blob(const_cast<int64_t*>(values.data()),
                       {static_cast<int64_t>(values.size())}, at::kLong)
      .clone();
}

std::pair<at::Tensor, at::Tensor> device_chunk_table(const std::vector<int64_t>& offsets,
                                                     const std::vector<int64_t>& groups,
                                                     int64_t chunk_elems, at::Device device) {
  auto [chunks, first] = make_chunk_table(host_int64(offsets), host_int64(groups), chunk_elems);
  return {chunks.to(device), first.to(device)};
}

bool at_view(const at::Tensor& t, const at::Tensor& view) {
  return t.defined() && t.unsafeGetTensorImpl() == view.unsafeGetTensorImpl();
}

}  // namespace

Algorithm parse_algorithm(const std::string& name) {
  if (name == "sgd") return Algorithm::kSgd;
  if (name == "adam") return Algorithm::kAdam;
  if (name == "lamb") return Algorithm::kLamb;
  NT_CHECK(false, "fused optimizer: the algorithm must be \"sgd\", \"adam\" or \"lamb\"; got \"",
           name, "\"");
  return Algorithm::kSgd;  // unreachable
}

at::Tensor FlatTensors::segment(const at::Tensor& flat, int64_t i) const {
  const at::Tensor& p = params[size_t(i)];
  at::Tensor seg = flat.narrow(0, offsets[size_t(i)], p.numel());
  if (p.is_contiguous() || !dense(p)) return seg.view(p.sizes());
  return seg.as_strided(p.sizes(), p.strides());
}

std::vector<FlatTensors> build_flat_buffers(
    const std::vector<std::pair<int64_t, at::Tensor>>& params, int64_t num_state,
    at::Device device, int64_t shard_world, int64_t chunk_elems, bool lamb) {
  NT_CHECK(!params.empty(), "fused optimizer: no parameters to fuse");
  NT_CHECK(num_state >= 0 && num_state <= 3, "fused optimizer: 0 to 3 state buffers; got ",
           num_state);
  std::vector<FlatTensors> flats;
  std::map<at::ScalarType, size_t> by_dtype;
  for (size_t index = 0; index < params.size(); ++index) {
    const auto& [group, p] = params[index];
    NT_CHECK(p.defined() && p.device() == device, "fused optimizer: parameter ", index,
             " must be on ", device, "; got ", p.defined() ? p.device() : at::Device(at::kCPU));
    auto [it, added] = by_dtype.emplace(p.scalar_type(), flats.size());
    if (added) {
      flats.emplace_back();
      flats.back().dtype = p.scalar_type();
    }
    FlatTensors& flat = flats[it->second];
    flat.params.push_back(p);
    flat.param_index.push_back(static_cast<int64_t>(index));
    flat.groups.push_back(group);
  }
  const c10::AutoGradMode no_grad(false);
  for (FlatTensors& flat : flats) {
    std::vector<int64_t> numels;
    for (const at::Tensor& p : flat.params) numels.push_back(p.numel());
    flat.offsets = flat_segment_offsets(numels, flat.params[0].element_size(), shard_world);
    const auto options = at::TensorOptions().dtype(flat.dtype).device(device);
    // Zeros in the padding stay zeros: a zero parameter with a zero gradient and zero state
    // has a zero update in every algorithm, so the padding never changes norms.
    flat.param = at::zeros({flat.offsets.back()}, options);
    flat.grad = at::zeros_like(flat.param);
    for (int64_t k = 0; k < num_state; ++k) flat.state.push_back(at::zeros_like(flat.param));
    for (size_t i = 0; i < flat.params.size(); ++i) {
      at::Tensor& p = flat.params[i];
      at::Tensor view = flat.segment(flat.param, int64_t(i));
      view.copy_(p.detach());
      p.set_data(view);
      at::Tensor grad = flat.segment(flat.grad, int64_t(i));
      if (p.grad().defined()) grad.copy_(p.grad());
      p.mutable_grad() = grad;
      flat.grad_views.push_back(grad);
    }
    std::tie(flat.chunks, flat.first_chunk) =
        device_chunk_table(flat.offsets, flat.groups, chunk_elems, device);
    if (lamb) {
      flat.chunk_norms = at::zeros({flat.chunks.size(0), 2},
                                   at::TensorOptions().dtype(at::kFloat).device(device));
      flat.trust = at::zeros({int64_t(flat.params.size())},
                             at::TensorOptions().dtype(at::kFloat).device(device));
    }
  }
  return flats;
}

ParamWatch::ParamWatch(std::vector<at::Tensor> params, int64_t trained)
    : params_(std::move(params)) {
  NT_CHECK(trained >= 0 && size_t(trained) <= params_.size(),
           "ParamWatch: trained (", trained, ") must be in [0, ", params_.size(), "]");
  flags_.reserve(size_t(trained));
  for (int64_t i = 0; i < trained; ++i) flags_.push_back(params_[size_t(i)].requires_grad());
}

void ParamWatch::fix_storage(std::optional<std::vector<at::Tensor>> others) {
  if (others) {
    params_.resize(flags_.size());
    params_.insert(params_.end(), others->begin(), others->end());
  }
  captured_.clear();
  captured_.reserve(params_.size());
  for (const at::Tensor& p : params_) captured_.push_back(p.detach());
}

bool ParamWatch::is_moved(size_t i) const {
  // On every call, for every tensor the graphs read: the TensorImpls' fields, read directly
  // (data_ptr() would check the storage first), a few nanoseconds a tensor.
  const c10::TensorImpl& p = *params_[i].unsafeGetTensorImpl();
  const c10::TensorImpl& c = *captured_[i].unsafeGetTensorImpl();
  return p.storage().data() != c.storage().data() || p.storage_offset() != c.storage_offset() ||
         p.dtype() != c.dtype() || p.sizes() != c.sizes() || p.strides() != c.strides();
}

bool ParamWatch::changed() const {
  for (size_t i = 0; i < flags_.size(); ++i) {
    if (params_[i].requires_grad() != flags_[i]) return true;
  }
  for (size_t i = 0; i < captured_.size(); ++i) {
    if (is_moved(i)) return true;
  }
  return false;
}

int64_t ParamWatch::first_flag_changed() const {
  for (size_t i = 0; i < flags_.size(); ++i) {
    if (params_[i].requires_grad() != flags_[i]) return int64_t(i);
  }
  return -1;
}

std::vector<int64_t> ParamWatch::moved() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < captured_.size(); ++i) {
    if (is_moved(i)) out.push_back(int64_t(i));
  }
  return out;
}

namespace {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream s;
  s << t.scalar_type() << " " << t.sizes() << " on " << t.device();
  return s.str();
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  switch (at::get_overlap_status(a, b)) {
    case at::MemOverlapStatus::Full:
    case at::MemOverlapStatus::Partial:
      return true;
    case at::MemOverlapStatus::TooHard:  // not dense: same storage is overlap enough
      return a.storage().is_alias_of(b.storage());
    default:
      return false;
  }
}

}  // namespace

std::string layout_mismatch(const at::Tensor& now, const at::Tensor& then) {
  if (now.defined() && then.defined() && now.scalar_type() == then.scalar_type() &&
      now.sizes() == then.sizes() && now.device() == then.device()) {
    return "";
  }
  return describe(now) + " where the graphs read " + describe(then);
}

int64_t ParamWatch::shares_memory_with(int64_t i) const {
  NT_CHECK(i >= 0 && size_t(i) < params_.size(), "ParamWatch: no parameter ", i);
  for (size_t j = 0; j < params_.size(); ++j) {
    if (j != size_t(i) && overlaps(params_[size_t(i)], params_[j])) return int64_t(j);
  }
  return -1;
}

std::string ParamWatch::why_not_restorable(int64_t i) const {
  NT_CHECK(i >= 0 && size_t(i) < captured_.size(), "ParamWatch: no fixed parameter ", i);
  const at::Tensor& p = params_[size_t(i)];
  const at::Tensor& c = captured_[size_t(i)];
  if (std::string mismatch = layout_mismatch(p, c); !mismatch.empty()) {
    return "its data is now " + mismatch;
  }
  const int64_t j = shares_memory_with(i);
  if (j >= 0) {
    return "its data now shares memory with parameter " + std::to_string(j) +
           "'s, a tie the graphs (captured with them apart) cannot keep";
  }
  return "";
}

void ParamWatch::restore() {
  const c10::AutoGradMode no_grad(false);
  // Every moved parameter's values first, all checked: a new data that is (part of) storage
  // the graphs read is copied aside, as another parameter's restore may write there.
  std::vector<std::pair<size_t, at::Tensor>> values;
  for (const int64_t i : moved()) {
    const std::string why = why_not_restorable(i);
    NT_CHECK(why.empty(), "ParamWatch: parameter ", i, " cannot go back: ", why);
    at::Tensor v = params_[size_t(i)].detach();
    for (const at::Tensor& c : captured_) {
      if (overlaps(v, c)) {
        v = v.clone();
        break;
      }
    }
    values.emplace_back(size_t(i), std::move(v));
  }
  for (auto& [i, v] : values) {
    captured_[i].copy_(v);
    params_[i].set_data(captured_[i]);
  }
}

void ParamWatch::undo_moves() {
  const c10::AutoGradMode no_grad(false);
  for (const int64_t i : moved()) params_[size_t(i)].set_data(captured_[size_t(i)]);
}

void ParamWatch::adopt(const std::vector<int64_t>& others) {
  for (const int64_t i : others) {
    NT_CHECK(!captured_.empty(), "ParamWatch::adopt: no storage fixed yet (fix_storage first)");
    NT_CHECK(i >= int64_t(flags_.size()) && i < int64_t(params_.size()), "ParamWatch::adopt: ",
             i, " is not the index of a parameter outside the trained ones [", flags_.size(),
             ", ", params_.size(), ")");
  }
  for (const int64_t i : others) captured_[size_t(i)] = params_[size_t(i)].detach();
}

void reattach(std::vector<FlatTensors>& flats) {
  const c10::AutoGradMode no_grad(false);
  for (FlatTensors& flat : flats) {
    const int64_t element_size = flat.param.element_size();
    for (size_t i = 0; i < flat.params.size(); ++i) {
      at::Tensor& p = flat.params[i];
      const at::Tensor& view = flat.grad_views[i];
      if (!at_view(p.grad(), view)) {
        if (p.grad().defined()) {
          view.copy_(p.grad());
        } else {
          view.zero_();
        }
        p.mutable_grad() = view;
      }
      const char* expected = static_cast<const char*>(flat.param.const_data_ptr()) +
                             flat.offsets[i] * element_size;
      if (p.const_data_ptr() != expected) {
        at::Tensor data = flat.segment(flat.param, int64_t(i));
        data.copy_(p.detach());
        p.set_data(data);
      }
    }
  }
}

void attach_grads(std::vector<FlatTensors>& flats) {
  for (FlatTensors& flat : flats) {
    for (size_t i = 0; i < flat.params.size(); ++i) {
      if (!flat.params[i].grad().defined()) flat.params[i].mutable_grad() = flat.grad_views[i];
    }
  }
}

void zero_grads(std::vector<FlatTensors>& flats) {
  for (FlatTensors& flat : flats) {
    flat.grad.zero_();
    for (size_t i = 0; i < flat.params.size(); ++i) {
      if (!at_view(flat.params[i].grad(), flat.grad_views[i])) {
        flat.params[i].mutable_grad() = flat.grad_views[i];
      }
    }
  }
}

UpdateTarget target_of(const FlatTensors& flat) {
  UpdateTarget t;
  t.param = flat.param;
  t.grad = flat.grad;
  t.state = flat.state;
  t.chunks = flat.chunks;
  t.first_chunk = flat.first_chunk;
  t.chunk_norms = flat.chunk_norms;
  t.trust = flat.trust;
  return t;
}

at::Tensor assign_partials(std::vector<UpdateTarget>& targets, at::Device device) {
  int64_t rows = 0;
  for (const UpdateTarget& t : targets) rows += grad_stats_partial_rows(t.grad.numel());
  at::Tensor partials = at::zeros({rows, 2}, at::TensorOptions().dtype(at::kFloat).device(device));
  int64_t first = 0;
  for (UpdateTarget& t : targets) {
    const int64_t n = grad_stats_partial_rows(t.grad.numel());
    t.partials = partials.narrow(0, first, n);
    first += n;
  }
  return partials;
}

void prepare_update_(const StepTables& tables, const std::optional<at::Tensor>& grad_scale) {
  if (grad_scale.has_value()) {
    const at::Tensor& x = *grad_scale;
    NT_CHECK(x.numel() == 1 && x.scalar_type() == at::kFloat &&
                 x.device() == tables.control.device(),
             "fused optimizer prepare: grad_scale must be a one-element float32 tensor on ",
             tables.control.device(), "; got ", x.numel(), " elements of ", x.scalar_type(),
             " on ", x.device());
  }
  prepare_step_(tables, std::nullopt, grad_scale, std::nullopt, 0.0, false);
}

namespace {

void check_sharded_lamb(const UpdateTarget& t, const at::Tensor& global) {
  NT_CHECK(t.state.size() >= 2, "fused LAMB: exp_avg and exp_avg_sq are missing");
  NT_CHECK(t.tensor_rows.defined() && t.tensor_sums.defined() && t.global_sums.defined() &&
               t.global_sums.is_same(global),
           "fused LAMB: every target of a sharded step needs tensor_rows, tensor_sums and "
           "the one global_sums they share");
}

// A sharded slice's part of its tensors' sums of p^2 and update^2 (kNorms computes the
// moments and writes nothing but the sums).
void lamb_norms_(const UpdateTarget& t, const StepTables& tables) {
  lamb_update_(t.param, t.grad, t.state[0], t.state[1], t.chunks, t.first_chunk, tables.hyper,
               tables.control, t.chunk_norms, t.trust, t.tensor_sums, LambPasses::kNorms);
}

// The whole tensors' sums, added over the ranks in global_sums, back into the slice's rows;
// then its trust ratios, moments and parameters (kApply).
void lamb_apply_(const UpdateTarget& t, const StepTables& tables) {
  at::Tensor sums = t.tensor_sums;  // the same tensor: each tensor's total, in place
  at::index_select_out(sums, t.global_sums, 0, t.tensor_rows);
  lamb_update_(t.param, t.grad, t.state[0], t.state[1], t.chunks, t.first_chunk, tables.hyper,
               tables.control, t.chunk_norms, t.trust, t.tensor_sums, LambPasses::kApply);
}

// Sharded LAMB over one slice alone: only its range's rows are added over the ranks.
void lamb_sharded_part_(const UpdateTarget& t, const StepTables& tables,
                        const std::function<void(const at::Tensor&)>& reduce) {
  check_sharded_lamb(t, t.global_sums);
  NT_CHECK(t.range_sums.defined(), "fused LAMB: a sharded slice updated on its own needs "
           "range_sums, the rows of every tensor of its range (update it with fused_step)");
  NT_CHECK(static_cast<bool>(reduce), "fused LAMB: a sharded slice updated on its own needs "
           "reduce (an in-place sum over the ranks) for its tensors' norms");
  lamb_norms_(t, tables);
  t.range_sums.zero_();
  t.global_sums.index_add_(0, t.tensor_rows, t.tensor_sums);
  reduce(t.range_sums);
  lamb_apply_(t, tables);
}

// Sharded LAMB: each target's per-tensor sums, every tensor's sums added over the targets and
// over the ranks, then each target's trust ratios, moments and parameters. A reduce that raises
// leaves the state as it was; the step counts prepare_step_ moved are the caller's to put back.
void lamb_sharded_(const std::vector<UpdateTarget>& targets, const StepTables& tables,
                   const std::function<void(const at::Tensor&)>& reduce) {
  NT_CHECK(static_cast<bool>(reduce), "fused LAMB: a sharded step needs reduce_partials (an "
           "in-place sum over the ranks) for its per-tensor norms");
  const at::Tensor& global = targets.front().global_sums;
  for (const UpdateTarget& t : targets) {
    check_sharded_lamb(t, global);
    lamb_norms_(t, tables);
  }
  global.zero_();
  for (const UpdateTarget& t : targets) global.index_add_(0, t.tensor_rows, t.tensor_sums);
  reduce(global);
  for (const UpdateTarget& t : targets) lamb_apply_(t, tables);
}

}  // namespace

void update_(Algorithm algorithm, const std::vector<UpdateTarget>& targets,
             const StepTables& tables, const std::function<void(const at::Tensor&)>& reduce) {
  const auto state = [](const UpdateTarget& t, size_t k) -> std::optional<at::Tensor> {
    if (k < t.state.size()) return t.state[k];
    return std::nullopt;
  };
  for (const UpdateTarget& t : targets) {
    switch (algorithm) {
      case Algorithm::kSgd:
        sgd_update_(t.param, t.grad, state(t, 0), t.chunks, tables.hyper, tables.control);
        break;
      case Algorithm::kAdam:
        NT_CHECK(t.state.size() >= 2, "fused Adam: exp_avg and exp_avg_sq are missing");
        adam_update_(t.param, t.grad, t.state[0], t.state[1], state(t, 2), t.chunks,
                     tables.hyper, tables.control);
        break;
      case Algorithm::kLamb:
        NT_CHECK(t.state.size() >= 2, "fused LAMB: exp_avg and exp_avg_sq are missing");
        if (t.tensor_rows.defined()) {
          lamb_sharded_part_(t, tables, reduce);
          break;
        }
        lamb_update_(t.param, t.grad, t.state[0], t.state[1], t.chunks, t.first_chunk,
                     tables.hyper, tables.control, t.chunk_norms, t.trust);
        break;
    }
  }
}

bool needs_stats(const FusedStepArgs& args) {
  return args.inv_scale.has_value() || args.found_inf.has_value() || args.max_grad_norm > 0;
}

std::optional<at::Tensor> gradient_factor(const FusedStepArgs& args, at::Device device) {
  const std::pair<const char*, const std::optional<at::Tensor>*> scalars[] = {
      {"inv_scale", &args.inv_scale}, {"found_inf", &args.found_inf},
      {"grad_scale", &args.grad_scale}};
  for (const auto& [name, t] : scalars) {
    if (!t->has_value()) continue;
    const at::Tensor& x = **t;
    NT_CHECK(x.numel() == 1 && x.scalar_type() == at::kFloat && x.device() == device,
             "fused optimizer step: ", name, " must be a one-element float32 tensor on ", device,
             "; got ", x.numel(), " elements of ", x.scalar_type(), " on ", x.device());
  }
  NT_CHECK(args.max_grad_norm >= 0 && std::isfinite(args.max_grad_norm),
           "fused optimizer step: max_grad_norm must be a positive finite number (0: none); "
           "got ", args.max_grad_norm);
  std::optional<at::Tensor> factor = args.inv_scale;  // one factor for the norm and the update
  if (args.grad_scale.has_value()) {
    factor = factor.has_value() ? at::mul(*factor, *args.grad_scale) : *args.grad_scale;
  }
  return factor;
}

void grad_stats_parts_(const std::vector<UpdateTarget>& targets,
                       const std::optional<at::Tensor>& factor) {
  for (const UpdateTarget& t : targets) {
    NT_CHECK(t.partials.defined(), "fused optimizer statistics: a target without its rows of "
             "partials (assign_partials)");
    grad_stats_(t.grad, factor, t.partials);
  }
}

at::Tensor fused_step(Algorithm algorithm, const std::vector<UpdateTarget>& targets,
                      const StepTables& tables, const at::Tensor& partials,
                      const FusedStepArgs& args) {
  const std::optional<at::Tensor> factor = gradient_factor(args, tables.control.device());
  const bool stats = needs_stats(args);
  NT_CHECK(stats || !args.stats_done, "fused optimizer step: stats_done is set, but this step "
           "computes no gradient statistics (no inv_scale, found_inf or max_grad_norm)");
  if (stats) {
    if (!args.stats_done) grad_stats_parts_(targets, factor);
    if (args.reduce_partials) args.reduce_partials(partials);  // over every shard
  }
  const bool skip_nonfinite = args.inv_scale.has_value() || args.found_inf.has_value();
  prepare_step_(tables, stats ? std::optional<at::Tensor>(partials) : std::nullopt, factor,
                args.found_inf, args.max_grad_norm, skip_nonfinite);
  const bool sharded_lamb = algorithm == Algorithm::kLamb && !targets.empty() &&
                            targets.front().tensor_rows.defined();
  if (sharded_lamb) {
    lamb_sharded_(targets, tables, args.reduce_partials);
  } else {
    update_(algorithm, targets, tables);
  }
  if (!stats) return at::Tensor();
  return tables.control.select(0, kGradNorm);
}

}  // namespace nimble_train::optim
