// ModuleWatch (see module_watch.h).
#include "step/module_watch.h"

#include <c10/core/GradMode.h>
#include <torch/nn/modules.h>

#include <algorithm>
#include <utility>

#include "nimble_train/step.h"
#include "optim/fused_step.h"

namespace nimble_train {
namespace {

namespace nn = torch::nn;

struct Found {
  const char* name;
  bool parameter;
  at::Tensor* field;
};

template <typename M>
M* as(nn::Module& module) {
  return dynamic_cast<M*>(&module);
}

// The public tensor members torch::nn's own modules' forwards read, each the tensor registered
// under its name (a parameter, or a buffer where marked); none for any other module.
std::vector<Found> members_of(nn::Module& module) {
  std::vector<Found> out;
  const auto weight_bias = [&out](auto* m) {
    if (m == nullptr) return false;
    out = {{"weight", true, &m->weight}, {"bias", true, &m->bias}};
    return true;
  };
  const auto norm = [&out](auto* m) {  // BatchNorm and InstanceNorm: NormImplBase
    if (m == nullptr) return false;
    out = {{"weight", true, &m->weight},
           {"bias", true, &m->bias},
           {"running_mean", false, &m->running_mean},
           {"running_var", false, &m->running_var},
           {"num_batches_tracked", false, &m->num_batches_tracked}};
    return true;
  };
  const auto weight_only = [&out](auto* m, bool parameter) {
    if (m == nullptr) return false;
    out = {{"weight", parameter, &m->weight}};
    return true;
  };
  const auto cell = [&out](auto* m) {  // RNNCell, LSTMCell, GRUCell
    if (m == nullptr) return false;
    out = {{"weight_ih", true, &m->weight_ih},
           {"weight_hh", true, &m->weight_hh},
           {"bias_ih", true, &m->bias_ih},
           {"bias_hh", true, &m->bias_hh}};
    return true;
  };
  if (weight_bias(as<nn::LinearImpl>(module)) || weight_bias(as<nn::BilinearImpl>(module)) ||
      weight_bias(as<nn::Conv1dImpl>(module)) || weight_bias(as<nn::Conv2dImpl>(module)) ||
      weight_bias(as<nn::Conv3dImpl>(module)) ||
      weight_bias(as<nn::ConvTranspose1dImpl>(module)) ||
      weight_bias(as<nn::ConvTranspose2dImpl>(module)) ||
      weight_bias(as<nn::ConvTranspose3dImpl>(module)) ||
      weight_bias(as<nn::LayerNormImpl>(module)) || weight_bias(as<nn::GroupNormImpl>(module)) ||
      norm(as<nn::BatchNorm1dImpl>(module)) || norm(as<nn::BatchNorm2dImpl>(module)) ||
      norm(as<nn::BatchNorm3dImpl>(module)) || norm(as<nn::InstanceNorm1dImpl>(module)) ||
      norm(as<nn::InstanceNorm2dImpl>(module)) || norm(as<nn::InstanceNorm3dImpl>(module)) ||
      weight_only(as<nn::EmbeddingImpl>(module), true) ||
      weight_only(as<nn::EmbeddingBagImpl>(module), true) ||
      weight_only(as<nn::PReLUImpl>(module), true) ||
      weight_only(as<nn::NLLLossImpl>(module), false) ||
      weight_only(as<nn::CrossEntropyLossImpl>(module), false) ||
      cell(as<nn::RNNCellImpl>(module)) || cell(as<nn::LSTMCellImpl>(module)) ||
      cell(as<nn::GRUCellImpl>(module))) {
    return out;
  }
  if (auto* m = as<nn::BCEWithLogitsLossImpl>(module)) {
    return {{"weight", false, &m->weight}, {"pos_weight", false, &m->pos_weight}};
  }
  if (auto* m = as<nn::MultiheadAttentionImpl>(module)) {  // out_proj is a child Linear
    return {{"in_proj_weight", true, &m->in_proj_weight},
            {"in_proj_bias", true, &m->in_proj_bias},
            {"bias_k", true, &m->bias_k},
            {"bias_v", true, &m->bias_v},
            {"q_proj_weight", true, &m->q_proj_weight},
            {"k_proj_weight", true, &m->k_proj_weight},
            {"v_proj_weight", true, &m->v_proj_weight}};
  }
  return out;
}

const char* mode(bool training) { return training ? "training" : "eval"; }

}  // namespace

ModuleWatch::ModuleWatch(std::shared_ptr<torch::nn::Module> root) : root_(std::move(root)) {
  modules_ = root_->modules();
  for (const auto& named : root_->named_modules()) names_.push_back(named.key());
  for (size_t i = 0; i < modules_.size(); ++i) {
    modes_.push_back(modules_[i]->is_training());
    for (const Found& f : members_of(*modules_[i])) {
      members_.push_back({i, f.name, f.parameter, f.field, *f.field});
    }
  }
}

std::vector<std::string> ModuleWatch::member_names() const {
  std::vector<std::string> out;
  for (const Member& m : members_) {
    out.push_back(names_[m.module].empty() ? m.name : names_[m.module] + "." + m.name);
  }
  return out;
}

std::string ModuleWatch::module_text(size_t i) const {
  const std::string name = names_[i].empty() ? "the module" : "module '" + names_[i] + "'";
  return name + " (" + modules_[i]->name() + ")";
}

std::string ModuleWatch::member_text(const Member& m) const {
  const std::string& owner = names_[m.module];
  return "the module's " + (owner.empty() ? std::string() : owner + ".") + m.name + " (" +
         (m.parameter ? "a parameter" : "a buffer") + " of " + modules_[m.module]->name() + ")";
}

void ModuleWatch::check(bool modes) {
  check_structure();
  if (modes) check_modes();
  bool assigned = false;
  for (const Member& m : members_) {
    if (m.field->unsafeGetTensorImpl() == m.captured.unsafeGetTensorImpl()) continue;
    assigned = true;
    const std::string what = member_text(m) + " was assigned another tensor after capture";
    const std::string place = names_[m.module].empty() ? "module" : names_[m.module];
    if (m.parameter) {
      throw Error("nimble_train::Step: " + what + "; the step's graph reads the one it was "
                  "captured with, and the optimizer updates that one, so the new one would "
                  "never train. Change a parameter's values in place (torch::NoGradGuard, " +
                  place + "->" + m.name + ".copy_(t)), or build a new Step and an optimizer "
                  "over the new parameters (close() this one). Nothing was run for this call.");
    }
    const std::string why = why_not_restorable(m);
    if (!why.empty()) {
      throw Error("nimble_train::Step: " + what + ", and " + why + ". Change a buffer's values "
                  "in place (torch::NoGradGuard, " + place + "->" + m.name + ".copy_(t)), or "
                  "build a new Step for the new model (close() this one). Nothing was run for "
                  "this call.");
    }
  }
  if (!assigned) return;
  const c10::AutoGradMode no_grad(false);
  for (Member& m : members_) {
    if (m.field->unsafeGetTensorImpl() == m.captured.unsafeGetTensorImpl()) continue;
    m.captured.copy_(*m.field);
    *m.field = m.captured;
  }
}

std::string ModuleWatch::why_not_restorable(const Member& m) const {
  if (!m.captured.defined()) return "the graph was captured with none there; it cannot read one";
  const std::string mismatch = optim::layout_mismatch(*m.field, m.captured);
  return mismatch.empty() ? "" : "it is " + mismatch;
}

void ModuleWatch::check_structure() const {
  const auto now = root_->modules();
  size_t i = 0;
  while (i < now.size() && i < modules_.size() && now[i] == modules_[i]) ++i;
  if (i == now.size() && i == modules_.size()) return;
  std::vector<std::string> now_names;
  for (const auto& named : root_->named_modules()) now_names.push_back(named.key());
  std::string what;
  if (i < now.size() && i < modules_.size() && now_names[i] == names_[i]) {
    what = module_text(i) + " was replaced by a " + now[i]->name();
  } else if (i < modules_.size() &&
             std::find(now_names.begin(), now_names.end(), names_[i]) == now_names.end()) {
    what = module_text(i) + " was removed";
  } else {
    what = "module '" + now_names[i] + "' (" + now[i]->name() + ") was added";
  }
  throw Error("nimble_train::Step: " + what + " after capture; the step's graph runs the "
              "modules it was captured with, and the optimizer holds their parameters, so a "
              "new module would never train. Change modules before the Step's first call, or "
              "build a new Step and an optimizer over the new model's parameters (close() this "
              "one). Nothing was run for this call.");
}

void ModuleWatch::check_modes() const {
  size_t i = 0;
  while (i < modules_.size() && modules_[i]->is_training() == modes_[i]) ++i;
  if (i == modules_.size()) return;
  const std::string fix =
      !root_->is_training() && modes_[0]
          ? "call train() on the module before the next step (after an evaluation)"
          : "put the modes back, or, to train on with the new ones, close() this Step and build "
            "a new one";
  throw Error("nimble_train::Step: " + module_text(i) + " is in " + mode(!modes_[i]) +
              " mode, and the step's graph was captured with it in " + mode(modes_[i]) +
              " mode; a captured graph runs the modes it was captured with. To train as the "
              "modes say, " + fix + ". Nothing was run for this call.");
}

}  // namespace nimble_train
