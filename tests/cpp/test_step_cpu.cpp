// nimble_train::Step on the CPU: its eager path (the fused update over flat buffers, staged
// hyper-parameters, clipping, short batches, torch::optim's state) equals a hand-written
// LibTorch loop with torch::optim, on random data.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "nimble_train/step.h"
#include "step_reference.h"

namespace nt = nimble_train;
namespace F = torch::nn::functional;
using nimble_train::testing::eval_forward;
using nimble_train::testing::expect_refused;
using nimble_train::testing::LateLayer;
using nimble_train::testing::max_diff;
using nimble_train::testing::per_sample;
using nimble_train::testing::reference_step;
using nimble_train::testing::reference_weighted_window;
using nimble_train::testing::reference_window;
using nimble_train::testing::ReferenceEma;
using nimble_train::testing::set_lr;

namespace {

constexpr nimble_train::testing::MlpShape kShape{8, 16, 4};

torch::nn::Sequential make_model(int64_t seed, bool batch_norm = false) {
  return nimble_train::testing::make_mlp(seed, kShape, torch::kCPU, batch_norm);
}

std::vector<nt::Batch> make_batches(int64_t count, int64_t size, int64_t seed) {
  return nimble_train::testing::make_mlp_batches(count, size, seed, kShape, torch::kCPU);
}

double max_change(torch::nn::Sequential& a, const std::vector<torch::Tensor>& before) {
  double worst = 0;
  auto pa = a->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    worst = std::max(worst, (pa[i] - before[i]).abs().max().item<double>());
  }
  return worst;
}

std::vector<torch::Tensor> snapshot(torch::nn::Sequential& a) {
  std::vector<torch::Tensor> out;
  for (auto& p : a->parameters()) out.push_back(p.detach().clone());
  return out;
}

constexpr double kTol = 2e-6;

// SGD with momentum (lr 0.1), or AdamW (lr 1e-2), over the model's parameters.
std::unique_ptr<torch::optim::Optimizer> sgd_or_adamw(torch::nn::Sequential& net, bool adamw) {
  if (adamw) {
    return std::make_unique<torch::optim::AdamW>(net->parameters(),
                                                 torch::optim::AdamWOptions(1e-2));
  }
  return std::make_unique<torch::optim::SGD>(net->parameters(),
                                             torch::optim::SGDOptions(0.1).momentum(0.9));
}

// Bags of embeddings with a sparse gradient, then a classifier: the same weights at each call.
torch::nn::Sequential sparse_bag() {
  torch::manual_seed(0);
  return torch::nn::Sequential(
      torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(30, 8).sparse(true)),
      torch::nn::Linear(8, 4));
}

}  // namespace

TEST(StepCpu, SgdMomentumWithLrChangesEqualsTheHandWrittenLoop) {
  auto batches = make_batches(8, 16, 1);
  auto net = make_model(0), ref = make_model(0);
  ASSERT_EQ(max_diff(net, ref), 0);
  torch::optim::SGD opt(net->parameters(),
                        torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
  torch::optim::SGD ref_opt(ref->parameters(),
                            torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
  nt::Step step(net, opt, per_sample(net));
  for (size_t i = 0; i < batches.size(); ++i) {
    const double lr = 0.1 * (1.0 - 0.1 * double(i));  // a scheduler, between calls
    set_lr(opt, lr);
    set_lr(ref_opt, lr);
    const double loss = step(batches[i]).item<double>();
    const double expected = reference_step(ref, ref_opt, batches[i]);
    EXPECT_NEAR(loss, expected, 1e-5) << "step " << i;
  }
  EXPECT_LT(max_diff(net, ref), kTol);
  const nt::StepStats stats = step.stats();
  EXPECT_EQ(stats.update, "fused");  // the CPU runs the same fused update as a graph does
  EXPECT_EQ(stats.phase, nt::Phase::kEager);
  EXPECT_EQ(stats.calls, 8);
  EXPECT_EQ(stats.replays, 0);
  // The optimizer's own state follows: its momentum buffers are the fused update's.
  for (auto& p : net->parameters()) {
    auto& state = static_cast<torch::optim::SGDParamState&>(
        *opt.state().at(p.unsafeGetTensorImpl()));
    EXPECT_TRUE(state.momentum_buffer().defined());
  }
}

TEST(StepCpu, AdamWWithClippingEqualsTheHandWrittenLoop) {
  auto batches = make_batches(7, 16, 2);
  auto net = make_model(3), ref = make_model(3);
  auto options = torch::optim::AdamWOptions(3e-2).weight_decay(0.05).betas({0.8, 0.99});
  torch::optim::AdamW opt(net->parameters(), options);
  torch::optim::AdamW ref_opt(ref->parameters(), options);
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_grad_clip(0.25));
  for (const auto& b : batches) {
    step(b);
    reference_step(ref, ref_opt, b, 0.25);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
  // The norm before clipping, as clip_grad_norm_ computes it, kept on the device.
  ASSERT_TRUE(step.grad_norm().has_value());
  EXPECT_GT(step.grad_norm()->item<double>(), 0.0);
  // Host step counts advance with the fused update, as torch::optim's would.
  for (auto& p : net->parameters()) {
    auto& state = static_cast<torch::optim::AdamWParamState&>(
        *opt.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(state.step(), 7);
  }
}

TEST(StepCpu, AdamWithL2AndAmsgradEqualsTheHandWrittenLoop) {
  auto batches = make_batches(6, 16, 4);
  auto net = make_model(5), ref = make_model(5);
  auto options = torch::optim::AdamOptions(1e-2).weight_decay(1e-2).amsgrad(true);
  torch::optim::Adam opt(net->parameters(), options);
  torch::optim::Adam ref_opt(ref->parameters(), options);
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_warmup(1));
  for (const auto& b : batches) {
    step(b);
    reference_step(ref, ref_opt, b);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
}

TEST(StepCpu, AShortBatchEqualsTheLoopOnThatBatch) {
  auto batches = make_batches(5, 16, 6);
  auto short_batches = make_batches(1, 5, 7);
  batches.push_back(short_batches[0]);
  batches.push_back(make_batches(1, 16, 8)[0]);
  auto net = make_model(9), ref = make_model(9);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  nt::Step step(net, opt, per_sample(net));
  for (const auto& b : batches) {
    step(b);
    reference_step(ref, ref_opt, b);
  }
  EXPECT_LT(max_diff(net, ref), kTol);
}

TEST(StepCpu, ASmallerBatchUnderKErrorRaisesShapeError) {
  auto net = make_model(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  nt::Step step(net, opt, per_sample(net),
                nt::StepOptions().set_partial_batch(nt::PartialBatch::kError));
  step(make_batches(1, 16, 0)[0]);
  const auto before = snapshot(net);
  try {
    step(make_batches(1, 4, 1)[0]);
    FAIL() << "expected ShapeError";
  } catch (const nt::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("4 samples"), std::string::npos) << e.what();
  }
  EXPECT_EQ(max_change(net, before), 0);
}

TEST(StepCpu, ABatchOfAnotherShapeRaisesShapeErrorNamingTheTensor) {
  auto net = make_model(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  nt::Step step(net, opt, per_sample(net));
  step(make_batches(1, 16, 0)[0]);
  try {
    step({torch::randn({16, 9}), torch::randint(0, 4, {16})});
    FAIL() << "expected ShapeError";
  } catch (const nt::ShapeError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("batch[0]"), std::string::npos) << what;
  }
}

TEST(StepCpu, ALossOfTheWrongShapeIsAClearError) {
  auto net = make_model(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  nt::Step step(net, opt, [net](const nt::Batch& b) mutable { return net->forward(b[0]); });
  try {
    step(make_batches(1, 16, 0)[0]);
    FAIL() << "expected nimble_train::Error";
  } catch (const nt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("one loss per sample"), std::string::npos) << e.what();
  }
}

TEST(StepCpu, AFailedStepLeavesTheModelAndOptimizerAsAfterTheLastOne) {
  auto batches = make_batches(6, 16, 10);
  auto net = make_model(11), ref = make_model(11);
  auto options = torch::optim::AdamWOptions(1e-2);
  torch::optim::AdamW opt(net->parameters(), options);
  torch::optim::AdamW ref_opt(ref->parameters(), options);
  int calls = 0;
  nt::Step step(net, opt, [&, net](const nt::Batch& b) mutable {
    if (++calls == 4) throw std::runtime_error("the data pipeline failed");
    return F::cross_entropy(net->forward(b[0]), b[1],
                            F::CrossEntropyFuncOptions().reduction(torch::kNone));
  });
  for (size_t i = 0; i < 3; ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_THROW(step(batches[3]), std::runtime_error);
  EXPECT_LT(max_diff(net, ref), 1e-6);  // nothing of the failed step landed
  for (size_t i = 3; i < batches.size(); ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
  for (auto& p : net->parameters()) {
    EXPECT_EQ(static_cast<torch::optim::AdamWParamState&>(
                  *opt.state().at(p.unsafeGetTensorImpl())).step(), 6);  // 3 + 3
  }
}

TEST(StepCpu, ACheckpointOfTheOptimizerRoundTripsThroughTorchSaveAndLoad) {
  auto batches = make_batches(8, 16, 12);
  auto net = make_model(13), ref = make_model(13);
  auto options = torch::optim::AdamOptions(2e-2);
  torch::optim::Adam opt(net->parameters(), options);
  torch::optim::Adam ref_opt(ref->parameters(), options);
  nt::Step step(net, opt, per_sample(net));
  for (size_t i = 0; i < 4; ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  // The Step's optimizer saves the state the fused update keeps.
  std::stringstream saved;
  torch::save(opt, saved);
  torch::optim::Adam restored(ref->parameters(), options);
  torch::load(restored, saved);
  for (auto& p : ref->parameters()) {
    auto& a = static_cast<torch::optim::AdamParamState&>(
        *restored.state().at(p.unsafeGetTensorImpl()));
    auto& b = static_cast<torch::optim::AdamParamState&>(
        *ref_opt.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(a.step(), b.step());
    EXPECT_LT((a.exp_avg() - b.exp_avg()).abs().max().item<double>(), 1e-6);
    EXPECT_LT((a.exp_avg_sq() - b.exp_avg_sq()).abs().max().item<double>(), 1e-6);
  }
  // Loading a checkpoint into the Step's optimizer between calls: the next call uses it.
  std::stringstream ref_saved;
  torch::save(ref_opt, ref_saved);
  torch::load(opt, ref_saved);
  for (size_t i = 4; i < batches.size(); ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
}

TEST(StepCpu, AnOptimizerThatCannotBeFusedRunsAsItIs) {
  auto batches = make_batches(5, 16, 14);
  auto net = make_model(15), ref = make_model(15);
  torch::optim::RMSprop opt(net->parameters(), torch::optim::RMSpropOptions(1e-2));
  torch::optim::RMSprop ref_opt(ref->parameters(), torch::optim::RMSpropOptions(1e-2));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_capture(false));
  for (const auto& b : batches) {
    step(b);
    reference_step(ref, ref_opt, b);
  }
  EXPECT_LT(max_diff(net, ref), 1e-6);
  EXPECT_EQ(step.stats().update, "eager");
}

// A parameter frozen (or unfrozen) after warm-up: the flat buffers hold the old set, so the
// call is refused before it runs anything, and a new Step trains the new set as the loop does.
TEST(StepCpu, AParameterFrozenOrUnfrozenAfterWarmupIsRefusedAndANewStepTrainsTheNewSet) {
  auto batches = make_batches(10, 16, 16);
  auto net = make_model(17), ref = make_model(17);
  auto options = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::optim::SGD opt(net->parameters(), options);
  torch::optim::SGD ref_opt(ref->parameters(), options);
  auto refused_after = [&](nt::Step& step, const nt::Batch& b, const char* change) {
    const std::vector<torch::Tensor> before = snapshot(net);
    expect_refused(step, b, {change, "param_groups()[0].params()[0]", "build a new Step"});
    EXPECT_EQ(max_change(net, before), 0);  // nothing ran
  };
  nt::Step step(net, opt, per_sample(net));
  size_t i = 0;
  for (; i < 3; ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  ASSERT_EQ(step.stats().update, "fused");
  net->parameters()[0].requires_grad_(false);
  ref->parameters()[0].requires_grad_(false);
  refused_after(step, batches[i], "true to false");
  step.close();
  const torch::Tensor frozen = net->parameters()[0].detach().clone();
  nt::Step again(net, opt, per_sample(net));
  for (; i < 6; ++i) {
    again(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), kTol);
  EXPECT_TRUE(net->parameters()[0].equal(frozen));  // no momentum moved it, as in the loop
  net->parameters()[0].requires_grad_(true);
  ref->parameters()[0].requires_grad_(true);
  refused_after(again, batches[i], "false to true");
  again.close();
  nt::Step third(net, opt, per_sample(net));
  for (; i < batches.size(); ++i) {
    third(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), kTol);
  EXPECT_FALSE(net->parameters()[0].equal(frozen));  // trained again
}

// close() hands the optimizer back for a plain loop: torch::optim's zero_grad() detaches each
// gradient in place, which the flat buffers' views would refuse.
TEST(StepCpu, AfterCloseTheOptimizerTrainsInAPlainLoop) {
  auto batches = make_batches(6, 16, 18);
  auto net = make_model(19), ref = make_model(19);
  auto options = torch::optim::AdamOptions(1e-2);
  torch::optim::Adam opt(net->parameters(), options);
  torch::optim::Adam ref_opt(ref->parameters(), options);
  nt::Step step(net, opt, per_sample(net));
  for (size_t i = 0; i < 3; ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  ASSERT_EQ(step.stats().update, "fused");
  step.close();
  for (size_t i = 3; i < batches.size(); ++i) {
    reference_step(net, opt, batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
}

// A sparse gradient (an EmbeddingBag built with sparse(true)) cannot live in the flat buffers:
// without a capture, torch::optim's own step() takes it at every step, as in the plain loop.
TEST(StepCpu, ASparseGradientGoesToTorchOptimsStepAtEveryStep) {
  auto net = sparse_bag(), ref = sparse_bag();
  ASSERT_EQ(max_diff(net, ref), 0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  nt::Step step(net, opt, per_sample(net));
  torch::manual_seed(3);
  for (int i = 0; i < 6; ++i) {
    const nt::Batch b{torch::randint(0, 30, {16, 5}), torch::randint(0, 4, {16})};
    const double loss = step(b).item<double>();
    EXPECT_NEAR(loss, reference_step(ref, ref_opt, b), 1e-5) << "step " << i;
  }
  EXPECT_TRUE(net[0]->parameters()[0].grad().is_sparse());
  EXPECT_LT(max_diff(net, ref), kTol);
  EXPECT_EQ(step.stats().update, "eager");
  EXPECT_EQ(step.stats().calls, 6);
}

// With accumulation too: the sparse gradient accumulates over the window's micro-batches, a
// short one included (the update's correction multiplies it as it does the dense ones).
TEST(StepCpu, ASparseGradientAccumulatesOverAWindow) {
  auto net = sparse_bag(), ref = sparse_bag();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_accumulate(2));
  torch::manual_seed(4);
  for (int w = 0; w < 4; ++w) {
    const int64_t second = w == 2 ? 6 : 16;  // a short micro-batch in the third window
    const std::vector<nt::Batch> window{
        {torch::randint(0, 30, {16, 5}), torch::randint(0, 4, {16})},
        {torch::randint(0, 30, {second, 5}), torch::randint(0, 4, {second})}};
    for (const nt::Batch& b : window) step(b);
    reference_window(ref, ref_opt, window);
    EXPECT_LT(max_diff(net, ref), 1e-5) << "window " << w;
  }
  EXPECT_TRUE(net[0]->parameters()[0].grad().is_sparse());
  EXPECT_EQ(step.stats().updates, 4);
}

TEST(StepCpu, AClosedStepRefusesCalls) {
  auto net = make_model(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  nt::Step step(net, opt, per_sample(net));
  step(make_batches(1, 16, 0)[0]);
  step.close();
  EXPECT_THROW(step(make_batches(1, 16, 1)[0]), nt::Error);
}

// An evaluation loop calling the training step: with autograd off a warm-up step could not run
// its backward, and a replay would train all the same. Refused before anything runs (the batch
// norm's statistics included); outside the scope the step trains as the loop.
TEST(StepCpu, ACallWithAutogradOffIsRefusedBeforeAnythingRuns) {
  auto batches = make_batches(4, 16, 20);
  auto net = make_model(21, /*batch_norm=*/true), ref = make_model(21, /*batch_norm=*/true);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  nt::Step step(net, opt, per_sample(net));
  step(batches[0]);
  reference_step(ref, ref_opt, batches[0]);
  const auto buffers = net->buffers();
  std::vector<torch::Tensor> before;
  for (const auto& b : buffers) before.push_back(b.clone());
  {
    const torch::NoGradGuard no_grad;
    expect_refused(step, batches[1], {"called with autograd off", "Nothing was run"});
  }
  {
    const c10::InferenceMode inference;
    expect_refused(step, batches[1], {"called with autograd off"});
  }
  for (size_t i = 0; i < buffers.size(); ++i) EXPECT_TRUE(torch::equal(buffers[i], before[i]));
  EXPECT_LT(max_diff(net, ref), kTol);
  for (size_t i = 1; i < batches.size(); ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
  EXPECT_EQ(step.stats().calls, 4);
}

// The Step plans its flat buffers over the optimizer's tensors as built: a tensor put in place
// of one of a group's (the step would go on updating the old one), or a group added, is refused
// before anything runs, naming it; put back, the step trains on as the loop.
TEST(StepCpu, AChangeOfTheOptimizersParamGroupsIsRefusedBeforeAnythingRuns) {
  auto batches = make_batches(4, 16, 22);
  auto net = make_model(23), ref = make_model(23);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  nt::Step step(net, opt, per_sample(net));
  step(batches[0]);
  reference_step(ref, ref_opt, batches[0]);
  std::vector<torch::Tensor>& params = opt.param_groups()[0].params();
  const torch::Tensor kept = params[1];
  params[1] = torch::zeros_like(kept).requires_grad_();
  expect_refused(step, batches[1], {"param_groups()[0].params()[1] is another tensor",
                                    "would go on updating the old one", "Nothing was run"});
  params[1] = kept;
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {torch::zeros({3}, torch::requires_grad())},
      std::make_unique<torch::optim::SGDOptions>(0.1)));
  expect_refused(step, batches[1], {"param groups changed", "1 groups before, 2 now",
                                    "Nothing was run"});
  opt.param_groups().pop_back();
  EXPECT_LT(max_diff(net, ref), kTol);  // nothing ran
  for (size_t i = 1; i < batches.size(); ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
}

// ema = 0.9 over a model with BatchNorm: after every update the averages of the parameters
// and the running statistics are a hand-written EMA's (the integer counter is the model's own);
// ema_weights() puts them in the model for its scope, refusing training meanwhile, and the
// trained values after; with accumulation the average moves at updates only.
TEST(StepCpu, TheEmaEqualsAHandWrittenAverageAndSwapsInForAScope) {
  for (const int64_t k : {1, 2}) {
    auto batches = make_batches(8, 16, 38);
    auto net = make_model(39, /*batch_norm=*/true), ref = make_model(39, /*batch_norm=*/true);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    nt::Step step(net, opt, per_sample(net),
                  nt::StepOptions().set_ema(0.9).set_accumulate(k));
    ReferenceEma ema(*ref, 0.9);
    for (size_t i = 0; i < batches.size(); i += size_t(k)) {
      const std::vector<nt::Batch> window(batches.begin() + int64_t(i),
                                          batches.begin() + int64_t(i) + k);
      for (const nt::Batch& b : window) step(b);
      reference_window(ref, ref_opt, window);
      ema.update();
    }
    EXPECT_LT(max_diff(net, ref), 1e-5) << "accumulate " << k;
    EXPECT_LT(ema.max_diff(step.ema_state_dict(), *net), 1e-5) << "accumulate " << k;
    const torch::Tensor trained = net->parameters()[0].detach().clone();
    {
      const auto averaged = step.ema_weights();
      EXPECT_LT((net->parameters()[0] - ema.averages.at("0.weight")).abs().max().item<double>(),
                1e-5);
      EXPECT_TRUE(torch::allclose(net->named_buffers()["3.running_mean"],
                                  ema.averages.at("3.running_mean"), 1e-5, 1e-6));
      expect_refused(step, batches[0], {"inside ema_weights()", "Nothing was run"});
    }
    EXPECT_TRUE(torch::equal(net->parameters()[0], trained));
    step(batches[0]);  // trains again after the scope
  }
}

// ema_state_dict() round-trips through load_ema_state_dict(); a state of another model (a name
// missing, another shape, an unknown name) is refused whole, changing nothing.
TEST(StepCpu, TheEmaStateLoadsBackAndAStateThatDoesNotFitIsRefused) {
  auto batches = make_batches(4, 16, 40);
  auto net = make_model(41);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_ema(0.5));
  for (const auto& b : batches) step(b);
  const auto saved = step.ema_state_dict();
  step(batches[0]);
  auto moved = step.ema_state_dict();
  EXPECT_FALSE(torch::equal(moved["0.weight"], saved["0.weight"]));
  auto missing = saved;
  missing.erase("2.bias");
  auto reshaped = saved;
  reshaped["0.weight"] = torch::zeros({3, 3});
  auto unknown = saved;
  unknown.insert("9.weight", torch::zeros({1}));
  for (const auto& [bad, said] :
       std::vector<std::pair<torch::OrderedDict<std::string, torch::Tensor>, std::string>>{
           {missing, "the state has no '2.bias'"},
           {reshaped, "'0.weight' has shape (16, 8) in this model; the state holds (3, 3)"},
           {unknown, "holds '9.weight', which this model does not have"}}) {
    try {
      step.load_ema_state_dict(bad);
      ADD_FAILURE() << "loaded a state that does not fit: " << said;
    } catch (const nt::Error& e) {
      EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(step.ema_state_dict()["0.weight"], moved["0.weight"]));
  }
  step.load_ema_state_dict(saved);
  for (const auto& item : saved) {
    EXPECT_TRUE(torch::equal(step.ema_state_dict()[item.key()], item.value())) << item.key();
  }
  nt::Step plain(net, opt, per_sample(net));
  EXPECT_THROW(plain.ema_state_dict(), nt::Error);
}

// step.evaluator(fn) runs fn with the model in eval mode (BatchNorm reads its running
// statistics, which it leaves alone) and autograd off, each module's own mode back after (a
// child the user keeps in eval stays so); evaluations between training calls change nothing
// of the training, which equals the loop's; a short batch is evaluated as it is.
TEST(StepCpu, AnEvaluatorRunsFnInEvalModeAndLeavesTheTrainingAlone) {
  auto batches = make_batches(6, 16, 50);
  auto held_out = make_batches(3, 24, 51);
  held_out[2] = {held_out[2][0].narrow(0, 0, 5), held_out[2][1].narrow(0, 0, 5)};
  auto net = make_model(52, /*batch_norm=*/true), ref = make_model(52, /*batch_norm=*/true);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  nt::Step step(net, opt, per_sample(net));
  nt::Evaluator evaluate = step.evaluator([net](const nt::Batch& b) mutable {
    torch::Tensor logits = net->forward(b[0]);
    return std::vector<torch::Tensor>{logits, F::cross_entropy(logits, b[1],
        F::CrossEntropyFuncOptions().reduction(torch::kSum))};
  });
  for (size_t i = 0; i < batches.size(); ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
    for (const nt::Batch& b : held_out) {
      const std::vector<torch::Tensor> out = evaluate(b);
      ASSERT_EQ(out.size(), 2u);
      const torch::Tensor expected = eval_forward(ref, b[0]);
      EXPECT_LT((out[0] - expected).abs().max().item<double>(), 1e-5) << "after step " << i;
      EXPECT_NEAR(out[1].item<double>(),
                  F::cross_entropy(expected, b[1], F::CrossEntropyFuncOptions().reduction(
                                                       torch::kSum)).item<double>(), 1e-4);
      EXPECT_FALSE(out[0].requires_grad());
    }
    EXPECT_TRUE(net->is_training());
    EXPECT_LT(max_diff(net, ref), 1e-6) << "step " << i;
    EXPECT_TRUE(torch::allclose(net->named_buffers()["3.running_mean"],
                                ref->named_buffers()["3.running_mean"], 1e-5, 1e-7));
  }
  net[1]->eval();  // a child kept in eval by the loop stays so
  evaluate(held_out[0]);
  EXPECT_TRUE(net->is_training());
  EXPECT_FALSE(net[1]->is_training());
  EXPECT_TRUE(net[3]->is_training());
  net[1]->train();
  const nt::EvaluatorStats stats = evaluate.stats();
  EXPECT_EQ(stats.eager, int64_t(batches.size() * held_out.size() + 1));
  EXPECT_EQ(stats.replays, 0);  // the CPU runs eagerly
  EXPECT_EQ(stats.captures, 0);
  EXPECT_TRUE(stats.capture_error.empty());
}

// Inside ema_weights() an evaluator evaluates the averages.
TEST(StepCpu, AnEvaluatorInsideEmaWeightsEvaluatesTheAverages) {
  auto batches = make_batches(5, 16, 53);
  auto net = make_model(54, /*batch_norm=*/true), ref = make_model(54, /*batch_norm=*/true);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_ema(0.8));
  nt::Evaluator evaluate = step.evaluator([net](const nt::Batch& b) mutable {
    return std::vector<torch::Tensor>{net->forward(b[0])};
  });
  for (const nt::Batch& b : batches) step(b);
  torch::Tensor averaged, trained = evaluate(batches[0])[0];
  {
    const auto in = step.ema_weights();
    averaged = evaluate(batches[0])[0];
  }
  auto state = step.ema_state_dict();
  for (const auto& item : ref->named_parameters()) {
    const torch::NoGradGuard no_grad;
    item.value().copy_(state[item.key()]);
  }
  for (const auto& item : ref->named_buffers()) item.value().copy_(state[item.key()]);
  EXPECT_LT((averaged - eval_forward(ref, batches[0][0])).abs().max().item<double>(), 1e-6);
  EXPECT_GT((averaged - trained).abs().max().item<double>(), 1e-3);
  EXPECT_TRUE(torch::equal(evaluate(batches[0])[0], trained));  // the trained weights are back
}

// What an evaluator cannot do is a clear error: an empty fn, fn returning no tensor or an
// undefined one, a batch of another layout than its first, its step closed or destroyed.
TEST(StepCpu, AnEvaluatorsMisusesAreClearErrors) {
  auto batches = make_batches(2, 16, 55);
  auto net = make_model(56);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  auto step = std::make_unique<nt::Step>(net, opt, per_sample(net));
  EXPECT_THROW(step->evaluator(nt::EvalFn()), nt::Error);
  const auto said = [](nt::Evaluator& evaluate, const nt::Batch& b, const std::string& part) {
    try {
      evaluate(b);
      ADD_FAILURE() << "the evaluation ran; expected an error saying " << part;
    } catch (const nt::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  nt::Evaluator nothing = step->evaluator([](const nt::Batch&) {
    return std::vector<torch::Tensor>{};
  });
  said(nothing, batches[0], "fn returned no tensors");
  nt::Evaluator undefined = step->evaluator([](const nt::Batch&) {
    return std::vector<torch::Tensor>{torch::Tensor()};
  });
  said(undefined, batches[0], "fn's output 0 is an undefined tensor");
  nt::Evaluator evaluate = step->evaluator([net](const nt::Batch& b) mutable {
    return std::vector<torch::Tensor>{net->forward(b[0])};
  });
  evaluate(batches[0]);
  EXPECT_THROW(evaluate({batches[0][0].narrow(1, 0, 4), batches[0][1]}), nt::ShapeError);
  said(evaluate, {batches[0][0].to(torch::kDouble), batches[0][1]}, "nimble_train::Evaluator");
  nt::Evaluator copy = evaluate;  // copies share the state
  EXPECT_EQ(copy.stats().eager, 1);
  nt::Evaluator empty;
  said(empty, batches[1], "this evaluator is empty");
  EXPECT_EQ(empty.stats().eager, 0);
  step->close();
  said(evaluate, batches[1], "its step was closed");
  step.reset();
  said(copy, batches[1], "its Step was destroyed");
}

TEST(StepCpu, BadOptionsAreClearErrors) {
  auto net = make_model(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_THROW(nt::Step(net, opt, per_sample(net), nt::StepOptions().set_warmup(0)), nt::Error);
  EXPECT_THROW(nt::Step(net, opt, per_sample(net), nt::StepOptions().set_grad_clip(-1)),
               nt::Error);
  EXPECT_THROW(nt::Step(net, opt, nt::ForwardLoss()), nt::Error);
  EXPECT_THROW(nt::Step(net, opt, per_sample(net), nt::StepOptions().set_accumulate(0)),
               nt::Error);
  EXPECT_THROW(nt::Step(net, opt, per_sample(net), nt::StepOptions().set_ema(1.0)), nt::Error);
}

// accumulate = 3 with SGD (momentum, clipping) and AdamW: each window's update equals the
// hand-written loop's over the window's micro-batches, a short one included (per-sample losses:
// one step on all the window's samples together); the update comes every third call.
TEST(StepCpu, AccumulationEqualsTheHandWrittenLoopWindowByWindow) {
  for (const bool adam : {false, true}) {
    auto batches = make_batches(12, 16, 24);
    batches[7] = {batches[7][0].narrow(0, 0, 5), batches[7][1].narrow(0, 0, 5)};
    auto net = make_model(25), ref = make_model(25);
    auto opt = sgd_or_adamw(net, adam), ref_opt = sgd_or_adamw(ref, adam);
    nt::Step step(net, *opt, per_sample(net),
                  nt::StepOptions().set_accumulate(3).set_grad_clip(0.5));
    for (size_t w = 0; w < 4; ++w) {
      std::vector<nt::Batch> window(batches.begin() + int64_t(3 * w),
                                    batches.begin() + int64_t(3 * w + 3));
      for (size_t i = 0; i < 3; ++i) {
        const torch::Tensor loss = step(window[i]);
        EXPECT_EQ(step.stepped(), i == 2) << "window " << w << ", call " << i;
        EXPECT_NEAR(loss.item<double>(), F::cross_entropy(net->forward(window[i][0]),
                                                          window[i][1]).item<double>(),
                    i == 2 ? 10.0 : 1e-5);  // after the update the model moved
      }
      reference_window(ref, *ref_opt, window, 0.5);
      EXPECT_LT(max_diff(net, ref), 1e-5) << (adam ? "AdamW" : "SGD") << ", window " << w;
    }
    EXPECT_EQ(step.stats().updates, 4);
    EXPECT_EQ(step.stats().calls, 12);
    EXPECT_TRUE(step.grad_norm().has_value());
  }
}

// step(batch, true) ends a window early (an epoch's end), at its middle or at its first call:
// each window's update equals the loop's over the micro-batches it had.
TEST(StepCpu, AWindowEndedEarlyUpdatesOverTheMicroBatchesItHad) {
  auto batches = make_batches(10, 16, 34);
  auto net = make_model(35), ref = make_model(35);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_accumulate(3));
  size_t next = 0;
  for (const size_t size : {1, 3, 2, 1, 3}) {
    const std::vector<nt::Batch> window(batches.begin() + int64_t(next),
                                        batches.begin() + int64_t(next + size));
    for (size_t i = 0; i < size; ++i) {
      step(window[i], /*update=*/i + 1 == size);
      EXPECT_EQ(step.stepped(), i + 1 == size);
    }
    reference_window(ref, ref_opt, window);
    EXPECT_LT(max_diff(net, ref), 1e-5) << "a window of " << size << " from call " << next;
    next += size;
  }
  EXPECT_EQ(step.stats().updates, 5);
}

// A scalar loss (forward_loss reduces it) is weighted 1 / accumulate, short micro-batch or not,
// as the plain loop's (loss / K).backward().
TEST(StepCpu, AccumulationWeightsAScalarLossOneOverK) {
  auto batches = make_batches(6, 16, 26);
  batches[4] = {batches[4][0].narrow(0, 0, 7), batches[4][1].narrow(0, 0, 7)};
  auto net = make_model(27), ref = make_model(27);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  nt::Step step(net, opt, [net](const nt::Batch& b) mutable {
    return F::cross_entropy(net->forward(b[0]), b[1]);
  }, nt::StepOptions().set_accumulate(2));
  for (size_t w = 0; w < 3; ++w) {
    std::vector<nt::Batch> window(batches.begin() + int64_t(2 * w),
                                  batches.begin() + int64_t(2 * w + 2));
    for (const nt::Batch& b : window) step(b);
    reference_window(ref, ref_opt, window, 0, /*scalar=*/true);
    EXPECT_LT(max_diff(net, ref), 1e-5) << "window " << w;
  }
}

// CallOptions::loss_weight replaces the Step's weighting call by call (a loop normalising by
// the window's token count), per-sample losses or a scalar, short micro-batches and windows
// ended early included: each window's update equals the loop's (mean * w).backward() over its
// micro-batches, with no correction for the window's samples.
TEST(StepCpu, ALossWeightGivenPerCallReplacesTheStepsWeighting) {
  for (const bool scalar : {false, true}) {
    for (const bool adam : {false, true}) {
      auto batches = make_batches(11, 16, 44);
      batches[4] = {batches[4][0].narrow(0, 0, 6), batches[4][1].narrow(0, 0, 6)};
      auto net = make_model(45), ref = make_model(45);
      auto opt = sgd_or_adamw(net, adam), ref_opt = sgd_or_adamw(ref, adam);
      nt::ForwardLoss loss_fn = per_sample(net);
      if (scalar) {
        loss_fn = [net](const nt::Batch& b) mutable {
          return F::cross_entropy(net->forward(b[0]), b[1]);
        };
      }
      nt::Step step(net, *opt, loss_fn, nt::StepOptions().set_accumulate(3).set_grad_clip(0.7));
      size_t next = 0;
      for (const size_t size : {3, 3, 2, 3}) {
        const std::vector<nt::Batch> window(batches.begin() + int64_t(next),
                                            batches.begin() + int64_t(next + size));
        std::vector<double> weights;
        for (size_t i = 0; i < size; ++i) weights.push_back(0.15 + 0.3 * double((i + next) % 4));
        for (size_t i = 0; i < size; ++i) {
          const torch::Tensor loss = step(window[i], nt::CallOptions()
                                                         .set_update(i + 1 == size)
                                                         .set_loss_weight(weights[i]));
          EXPECT_EQ(step.stepped(), i + 1 == size);
          if (i + 1 < size) {  // the loss is the micro-batch's mean, unweighted
            EXPECT_NEAR(loss.item<double>(),
                        F::cross_entropy(net->forward(window[i][0]), window[i][1]).item<double>(),
                        1e-5);
          }
        }
        reference_weighted_window(ref, *ref_opt, window, weights, 0.7);
        EXPECT_LT(max_diff(net, ref), 1e-5)
            << (scalar ? "scalar" : "per-sample") << ", " << (adam ? "AdamW" : "SGD")
            << ", a window of " << size << " from call " << next;
        next += size;
      }
      EXPECT_EQ(step.stats().updates, 4);
    }
  }
}

// Random loops, each against the hand-written one window by window (step_reference.h).
TEST(StepCpu, RandomLoopsEqualTheHandWrittenLoopWindowByWindow) {
  for (uint32_t seed = 0; seed < 24; ++seed) {
    nimble_train::testing::random_loop(seed, kShape, torch::kCPU, 2e-5);
  }
}

// A torch::data::Example is the batch {data, target}, with or without CallOptions.
TEST(StepCpu, ATorchDataExampleIsTheBatchOfItsDataAndTarget) {
  auto batches = make_batches(5, 16, 57);
  auto net = make_model(58), twin = make_model(58);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW twin_opt(twin->parameters(), torch::optim::AdamWOptions(1e-2));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_accumulate(2));
  nt::Step twin_step(twin, twin_opt, per_sample(twin), nt::StepOptions().set_accumulate(2));
  for (size_t i = 0; i < batches.size(); ++i) {
    const torch::data::Example<> example(batches[i][0], batches[i][1]);
    if (i < 3) {  // a window ended early, its calls weighted by the loop
      const auto call = nt::CallOptions().set_update(i == 2).set_loss_weight(0.25 * double(i + 1));
      step(example, call);
      twin_step(batches[i], call);
    } else {
      step(example);
      twin_step(batches[i]);
    }
  }
  EXPECT_EQ(step.stats().updates, twin_step.stats().updates);
  EXPECT_EQ(max_diff(net, twin), 0.0);
}

// A loss weight that is not a finite number, or one other than 1 without accumulation, is
// refused before the call runs anything; 1 without accumulation is the plain step.
TEST(StepCpu, ABadLossWeightIsRefusedBeforeAnythingRuns) {
  auto batches = make_batches(3, 16, 46);
  for (const int64_t k : {1, 2}) {
    auto net = make_model(47);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_accumulate(k));
    step(batches[0]);
    const std::vector<torch::Tensor> before = snapshot(net);
    std::vector<torch::Tensor> grads;
    for (auto& p : net->parameters()) grads.push_back(p.grad().clone());
    std::vector<double> bad = {std::nan(""), std::numeric_limits<double>::infinity()};
    if (k == 1) bad.push_back(0.5);
    for (const double w : bad) {
      expect_refused(step, batches[1],
                     {k == 1 && std::isfinite(w) ? "needs StepOptions::accumulate > 1"
                                                 : "must be a finite number",
                      "Nothing was run"},
                     nt::CallOptions().set_loss_weight(w));
      EXPECT_EQ(max_change(net, before), 0.0);
      auto params = net->parameters();
      for (size_t j = 0; j < params.size(); ++j) {
        EXPECT_TRUE(torch::equal(params[j].grad(), grads[j])) << "k " << k << ", w " << w;
      }
      EXPECT_EQ(step.stats().calls, 1);
    }
  }
  // Without accumulation a weight of 1 is the step itself.
  auto net = make_model(48), ref = make_model(48);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  nt::Step step(net, opt, per_sample(net));
  for (const nt::Batch& b : batches) {
    step(b, nt::CallOptions().set_loss_weight(1.0));
    reference_step(ref, ref_opt, b);
  }
  EXPECT_LT(max_diff(net, ref), 1e-6);
}

// A call that fails inside a window (the data pipeline, in forward_loss) leaves the window's
// gradients, the model and the optimizer as after the last completed call; the window goes
// on, and the training equals the loop's.
TEST(StepCpu, ACallFailingInsideAnAccumulationWindowPutsItsGradientsBack) {
  for (const int failing : {5, 6}) {  // in the middle of the second window; at its end
    auto batches = make_batches(9, 16, 28);
    auto net = make_model(29), ref = make_model(29);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
    int calls = 0;
    nt::Step step(net, opt, [&, net](const nt::Batch& b) mutable {
      torch::Tensor losses = F::cross_entropy(
          net->forward(b[0]), b[1], F::CrossEntropyFuncOptions().reduction(torch::kNone));
      if (++calls == failing) {
        losses.sum().backward();  // a partial gradient, then the failure
        throw std::runtime_error("the data pipeline failed");
      }
      return losses;
    }, nt::StepOptions().set_accumulate(3));
    for (size_t i = 0; i < 4; ++i) step(batches[i]);
    std::vector<torch::Tensor> grads;
    for (auto& p : net->parameters()) grads.push_back(p.grad().clone());
    if (failing == 6) step(batches[4]);
    if (failing == 6) {
      grads.clear();
      for (auto& p : net->parameters()) grads.push_back(p.grad().clone());
    }
    EXPECT_THROW(step(batches[failing == 5 ? 4 : 5]), std::runtime_error);
    auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::equal(params[i].grad(), grads[i])) << "call " << failing;
    }
    for (size_t i = failing == 5 ? 4 : 5; i < batches.size(); ++i) step(batches[i]);
    for (size_t w = 0; w < 3; ++w) {
      reference_window(ref, ref_opt, std::vector<nt::Batch>(batches.begin() + int64_t(3 * w),
                                                            batches.begin() + int64_t(3 * w + 3)));
    }
    EXPECT_LT(max_diff(net, ref), 1e-5) << "call " << failing;
    EXPECT_EQ(step.stats().updates, 3);
  }
}

TEST(StepCpu, AParameterTheFirstStepGaveNoGradientTrainsFromTheStepThatGivesItOne) {
  for (const bool adam : {false, true}) {
    auto net = LateLayer::make(torch::kCPU), ref = LateLayer::make(torch::kCPU);
    std::unique_ptr<torch::optim::Optimizer> opt, ref_opt;
    if (adam) {
      const auto options = torch::optim::AdamOptions(1e-2);
      opt = std::make_unique<torch::optim::Adam>(net->parameters(), options);
      ref_opt = std::make_unique<torch::optim::Adam>(ref->parameters(), options);
    } else {
      const auto options = torch::optim::SGDOptions(0.1).momentum(0.9);
      opt = std::make_unique<torch::optim::SGD>(net->parameters(), options);
      ref_opt = std::make_unique<torch::optim::SGD>(ref->parameters(), options);
    }
    LateLayer late{3};
    nt::Step step(net, *opt, late.forward_loss(net));
    const auto batches = make_batches(7, 16, 2);
    for (size_t i = 0; i < batches.size(); ++i) {
      late.call = int64_t(i);
      const double loss = step(batches[i]).item<double>();
      ref_opt->zero_grad();
      torch::Tensor expected = F::cross_entropy(late.logits(ref, batches[i][0]), batches[i][1]);
      expected.backward();
      ref_opt->step();
      EXPECT_NEAR(loss, expected.item<double>(), 1e-5) << "adam " << adam << ", step " << i;
      EXPECT_LT(max_diff(net, ref), kTol) << "adam " << adam << ", step " << i;
      // fused from the second step until the late layer's first gradient, torch::optim's after
      EXPECT_EQ(step.stats().update, i >= 1 && i < 3 ? "fused" : "eager") << "step " << i;
    }
  }
}
