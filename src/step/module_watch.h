// ModuleWatch: what a captured LibTorch step's graph holds of the module, checked before each
// call runs anything.
//
// A graph runs the modules and tensors it was captured with. LibTorch refuses to register a
// parameter or buffer under a name already taken, and torch::load and p.set_data(t) keep each
// tensor and change its data (optim::ParamWatch sees those). What user code can still change
// is which objects the forward reaches: a child replaced, added or removed (replace_module,
// unregister_module, Sequential::push_back), a module switched to another training mode, and a
// torch::nn module's public tensor member assigned anew (bn->running_mean = t, fc->weight = t),
// which its forward reads in place of the registered tensor the graph holds. At capture the
// watch takes every module (modules()'s order), its name and training flag, and each member of
// torch::nn's own modules (table in module_watch.cpp) as it is; check() then compares:
//  - a module replaced, added or removed: refused (the graph runs the old one, and the
//    optimizer holds its parameters, so the new one would never train);
//  - another training mode: refused (the graph runs batch statistics and dropout as captured);
//  - a parameter member assigned: refused, for the same reason as a module;
//  - a buffer member assigned (running statistics, a loss's class weights): its values are
//    copied into the tensor the graph reads, which goes back in the member (as Python's Step
//    does with model.bn.running_mean = t), or refused when it no longer fits there (another
//    shape, dtype or device, or none).
// A module of one's own holds its tensor members in its own code; only its registered children
// are seen. Cost per call: one modules() walk and a pointer comparison per member and mode:
// 1.3 us for a CIFAR ResNet-18's tree (57 modules, 142 members) on a slow host.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace nimble_train {

class ModuleWatch {
 public:
  // Takes root's modules, modes and members as they are now.
  explicit ModuleWatch(std::shared_ptr<torch::nn::Module> root);

  // Throws nimble_train::Error naming the first change that cannot be taken, before changing
  // anything; then puts every buffer member that was assigned anew back (values kept). Host
  // work: outside any capture. modes = false: training modes are not compared (an
  // evaluation sets its own).
  void check(bool modes = true);

  // The torch::nn members watched (for tests and diagnostics): "fc.weight", ...
  std::vector<std::string> member_names() const;

 private:
  struct Member {
    size_t module;       // index into modules_
    const char* name;    // "weight", "running_mean", ...
    bool parameter;      // registered as a parameter (else a buffer)
    at::Tensor* field;   // the member, inside modules_[module] (which the watch keeps alive)
    at::Tensor captured; // what it held at capture: what the graph reads
  };

  void check_structure() const;
  void check_modes() const;
  // Why member m's new tensor cannot go back where the graph reads it, or "" when it can.
  std::string why_not_restorable(const Member& m) const;
  std::string module_text(size_t i) const;  // "module 'layer1.bn' (torch::nn::BatchNorm2dImpl)"
  std::string member_text(const Member& m) const;  // "the module's layer1.bn.running_mean"

  std::shared_ptr<torch::nn::Module> root_;
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::vector<std::string> names_;
  std::vector<bool> modes_;
  std::vector<Member> members_;
};

}  // namespace nimble_train
