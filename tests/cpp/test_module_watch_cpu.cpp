// ModuleWatch on CPU modules: an untouched model passes; a torch::nn buffer member assigned
// anew goes back where the graph reads it with the new values (all or nothing); a parameter
// member assigned, a child replaced, added or removed, or a mode switched is refused, naming
// what changed, with nothing changed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "nimble_train/step.h"
#include "step/module_watch.h"

namespace nt = nimble_train;
namespace nn = torch::nn;

namespace {

template <typename M>
M& child(nn::Sequential& net, size_t i) {
  auto m = std::dynamic_pointer_cast<M>(net->ptr(i));
  if (m == nullptr) throw std::logic_error("child " + std::to_string(i) + " is not that module");
  return *m;
}

// Linear -> ReLU -> Linear (no bias) -> BatchNorm1d, random weights and statistics.
nn::Sequential make_net(int64_t seed) {
  torch::manual_seed(seed);
  nn::Sequential net(nn::Linear(6, 5), nn::ReLU(), nn::Linear(nn::LinearOptions(5, 3).bias(false)),
                     nn::BatchNorm1d(3));
  torch::NoGradGuard no_grad;
  auto& bn = child<nn::BatchNorm1dImpl>(net, 3);
  bn.running_mean.normal_();
  bn.running_var.uniform_(0.5, 2.0);
  return net;
}

void expect_refused(nt::ModuleWatch& watch, std::initializer_list<const char*> said) {
  try {
    watch.check();
    ADD_FAILURE() << "check() passed; expected a nimble_train::Error saying \"" << *said.begin()
                  << "\"";
  } catch (const nt::Error& e) {
    const std::string what = e.what();
    for (const char* part : said) EXPECT_NE(what.find(part), std::string::npos) << what;
  }
}

}  // namespace

TEST(ModuleWatch, AnUntouchedModelPassesAndTheBuiltInMembersAreWatched) {
  auto net = make_net(1);
  nt::ModuleWatch watch(net.ptr());
  const std::vector<std::string> expected = {
      "0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias",
      "3.running_mean", "3.running_var", "3.num_batches_tracked"};
  EXPECT_EQ(watch.member_names(), expected);
  {
    torch::NoGradGuard no_grad;  // values changed in place are what the graph reads
    child<nn::LinearImpl>(net, 0).weight.mul_(2.0);
    child<nn::BatchNorm1dImpl>(net, 3).running_mean.add_(1.0);
  }
  EXPECT_NO_THROW(watch.check());
  EXPECT_NO_THROW(watch.check());
}

// bn->running_mean = t: the forward would read t, the graph reads the tensor captured. The
// check copies t's values into that one and puts it back in the member (and so in the module's
// registered buffers, which never changed).
TEST(ModuleWatch, ABufferMemberAssignedAnewGoesBackWithItsNewValues) {
  auto net = make_net(2);
  auto& bn = child<nn::BatchNorm1dImpl>(net, 3);
  const torch::Tensor captured_mean = bn.running_mean, captured_var = bn.running_var;
  nt::ModuleWatch watch(net.ptr());
  torch::manual_seed(3);
  const torch::Tensor mean = torch::randn({3}), var = torch::rand({3}) + 0.5;
  bn.running_mean = mean.clone();
  bn.running_var = var.clone();
  ASSERT_NO_THROW(watch.check());
  EXPECT_TRUE(bn.running_mean.is_same(captured_mean));
  EXPECT_TRUE(bn.running_var.is_same(captured_var));
  EXPECT_TRUE(torch::equal(captured_mean, mean));
  EXPECT_TRUE(torch::equal(captured_var, var));
  EXPECT_TRUE(net->named_buffers()["3.running_mean"].is_same(captured_mean));
  EXPECT_NO_THROW(watch.check());
}

// A buffer that no longer fits is refused before anything is copied: the one that fits is left
// as the user assigned it too, and the captured tensors keep their values.
TEST(ModuleWatch, ABufferThatNoLongerFitsIsRefusedAndNothingIsCopied) {
  auto net = make_net(4);
  auto& bn = child<nn::BatchNorm1dImpl>(net, 3);
  const torch::Tensor captured_mean = bn.running_mean, captured_var = bn.running_var;
  const torch::Tensor mean_before = captured_mean.clone(), var_before = captured_var.clone();
  nt::ModuleWatch watch(net.ptr());
  const torch::Tensor mean = torch::randn({3});
  bn.running_mean = mean;
  bn.running_var = torch::rand({3}).to(torch::kDouble);
  expect_refused(watch, {"3.running_var", "a buffer of", "Double [3]", "Float [3]",
                         "Nothing was run"});
  EXPECT_TRUE(bn.running_mean.is_same(mean));
  EXPECT_TRUE(torch::equal(captured_mean, mean_before));
  EXPECT_TRUE(torch::equal(captured_var, var_before));
  bn.running_var = torch::rand({4});
  expect_refused(watch, {"3.running_var", "Float [4]"});
  bn.running_var = torch::Tensor();
  expect_refused(watch, {"3.running_var", "an undefined tensor"});
  bn.running_var = captured_var;  // put back: the mean alone is taken
  ASSERT_NO_THROW(watch.check());
  EXPECT_TRUE(bn.running_mean.is_same(captured_mean));
  EXPECT_TRUE(torch::equal(captured_mean, mean));
}

// A member the graph was captured without (BatchNorm that tracks no running statistics) cannot
// be given one.
TEST(ModuleWatch, ABufferMemberTheGraphHadNoneOfIsRefused) {
  nn::Sequential net(nn::Linear(4, 3),
                     nn::BatchNorm1d(nn::BatchNormOptions(3).track_running_stats(false)));
  nt::ModuleWatch watch(net.ptr());
  child<nn::BatchNorm1dImpl>(net, 1).running_mean = torch::zeros({3});
  expect_refused(watch, {"1.running_mean", "captured with none there"});
}

// fc->weight = t: the optimizer updates the registered tensor the graph reads; t would never
// train. Refused, whether the member held a tensor or none (a Linear without bias).
TEST(ModuleWatch, AParameterMemberAssignedAnewIsRefused) {
  auto net = make_net(5);
  nt::ModuleWatch watch(net.ptr());
  auto& fc = child<nn::LinearImpl>(net, 0);
  const torch::Tensor weight = fc.weight;
  fc.weight = torch::randn({5, 6}, torch::requires_grad());
  expect_refused(watch, {"the module's 0.weight (a parameter of", "would never train",
                         "0->weight.copy_(t)", "Nothing was run"});
  fc.weight = weight;
  EXPECT_NO_THROW(watch.check());
  child<nn::LinearImpl>(net, 2).bias = torch::zeros({3}, torch::requires_grad());
  expect_refused(watch, {"2.bias", "would never train"});
}

TEST(ModuleWatch, AChildReplacedAddedOrRemovedIsRefused) {
  auto net = make_net(6);
  nt::ModuleWatch watch(net.ptr());
  const auto old = net->ptr(2);
  net->replace_module("2", nn::Linear(5, 3).ptr());
  expect_refused(watch, {"module '2' (torch::nn::LinearImpl) was replaced by a "
                         "torch::nn::LinearImpl", "would never train", "Nothing was run"});
  net->replace_module("2", old);
  EXPECT_NO_THROW(watch.check());
  net->push_back(nn::ReLU());
  expect_refused(watch, {"module '4' (torch::nn::ReLUImpl) was added"});

  struct Net : nn::Module {
    Net() {
      register_module("body", nn::Linear(3, 3));
      register_module("head", nn::Linear(3, 2));
    }
  };
  auto other = std::make_shared<Net>();
  nt::ModuleWatch other_watch(other);
  other->unregister_module("head");
  expect_refused(other_watch, {"module 'head' (torch::nn::LinearImpl) was removed"});
}

TEST(ModuleWatch, AModuleInAnotherModeIsRefused) {
  auto net = make_net(7);
  nt::ModuleWatch watch(net.ptr());
  net->eval();
  expect_refused(watch, {"the module (torch::nn::Sequential", "is in eval mode",
                         "call train()"});
  net->train();
  net->ptr(3)->eval();
  expect_refused(watch, {"module '3' (torch::nn::BatchNorm1dImpl) is in eval mode",
                         "put the modes back"});
  net->train();
  EXPECT_NO_THROW(watch.check());
}
