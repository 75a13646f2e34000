// nimble_train::Step on a GPU: captured steps equal a hand-written LibTorch loop, learning rates
// reach the graph without a new capture, a host sync in forward_loss is a SyncError, short
// batches are padded in the graph (or run eagerly where padding would change results), loss
// weights given per call are staged, a
// failed launch or capture leaves the model and optimizer as after the last completed step,
// a module left in eval mode, a child replaced, a parameter member assigned anew, a sparse
// gradient, a changed kernel setting (TF32, cuDNN) or another autocast in a captured step is
// refused, a parameter given its first gradient late trains eagerly with torch::optim, an
// evaluator is captured in the step's pool and equals the eager evaluation, and a
// parameter given new data, BatchNorm's statistics assigned anew, or a checkpoint loaded with
// torch::load, trains on from it.
// Skipped, with the reason, where there is no CUDA GPU.
#include <gtest/gtest.h>

#include "nimble_train/build_config.h"

#if NT_HAVE_CUDA
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/torch.h>

#include <memory>
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

class StepCuda : public testing::Test {
 protected:
  void SetUp() override {
    if (c10::cuda::device_count() == 0) GTEST_SKIP() << "needs a CUDA GPU; none is visible";
  }
  torch::Device device{torch::kCUDA, 0};
};

constexpr nimble_train::testing::MlpShape kShape{32, 64, 10};

torch::nn::Sequential make_model(int64_t seed, torch::Device device, bool batch_norm = false) {
  return nimble_train::testing::make_mlp(seed, kShape, device, batch_norm);
}

std::vector<nt::Batch> make_batches(int64_t count, int64_t size, int64_t seed,
                                    torch::Device device) {
  return nimble_train::testing::make_mlp_batches(count, size, seed, kShape, device);
}

// The step and the hand-written loop, each on batches [from, to).
void train_both(nt::Step& step, torch::nn::Sequential& ref, torch::optim::Optimizer& ref_opt,
                const std::vector<nt::Batch>& batches, size_t from, size_t to) {
  for (size_t i = from; i < to; ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
}

// Twin models, the Step over one (SGD, momentum 0.9) and the hand-written loop over the other,
// trained on batches [0, 5) of 10: the Step replays its graph from here.
struct Replaying {
  Replaying(int64_t seed, torch::Device device, bool batch_norm = false)
      : batches(make_batches(10, 32, seed, device)),
        net(make_model(seed + 1, device, batch_norm)),
        ref(make_model(seed + 1, device, batch_norm)),
        opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
        ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
        step(net, opt, per_sample(net)) {
    train_both(step, ref, ref_opt, batches, 0, 5);
  }
  void train(size_t from, size_t to) { train_both(step, ref, ref_opt, batches, from, to); }

  std::vector<nt::Batch> batches;
  torch::nn::Sequential net, ref;
  torch::optim::SGD opt, ref_opt;
  nt::Step step;
};

// An evaluator of the logits and the summed cross-entropy.
nt::Evaluator logits_and_loss(nt::Step& step, torch::nn::Sequential net) {
  return step.evaluator([net](const nt::Batch& b) mutable {
    torch::Tensor logits = net->forward(b[0]);
    const auto sum = F::CrossEntropyFuncOptions().reduction(torch::kSum);
    return std::vector<torch::Tensor>{logits, F::cross_entropy(logits, b[1], sum)};
  });
}

double diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace

TEST_F(StepCuda, CapturedStepsEqualTheHandWrittenLoopAndLrChangesNeedNoRecapture) {
  auto batches = make_batches(12, 32, 1, device);
  auto net = make_model(0, device), ref = make_model(0, device);
  auto options = torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(1e-4);
  torch::optim::SGD opt(net->parameters(), options);
  torch::optim::SGD ref_opt(ref->parameters(), options);
  nt::Step step(net, opt, per_sample(net));
  std::vector<torch::Tensor> losses;
  for (size_t i = 0; i < batches.size(); ++i) {
    const double lr = 0.1 / double(1 + i);
    set_lr(opt, lr);
    set_lr(ref_opt, lr);
    losses.push_back(step(batches[i]).clone());
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
  const nt::StepStats stats = step.stats();
  EXPECT_EQ(stats.phase, nt::Phase::kReplay);
  EXPECT_EQ(stats.captures, 1);  // twelve learning rates, one graph
  EXPECT_EQ(stats.replays, 12 - 3);
  EXPECT_GT(stats.graph_nodes, 0);
  EXPECT_EQ(stats.host_syncs_in_warmup, 0);
  for (const auto& loss : losses) EXPECT_TRUE(std::isfinite(loss.item<double>()));
}

TEST_F(StepCuda, AdamWWithClippingInTheGraphEqualsTheLoop) {
  auto batches = make_batches(10, 32, 2, device);
  auto net = make_model(3, device), ref = make_model(3, device);
  auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.05);
  torch::optim::AdamW opt(net->parameters(), options);
  torch::optim::AdamW ref_opt(ref->parameters(), options);
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_grad_clip(0.5).set_warmup(2));
  for (const auto& b : batches) {
    step(b);
    reference_step(ref, ref_opt, b, 0.5);
  }
  EXPECT_LT(max_diff(net, ref), 2e-5);
  EXPECT_EQ(step.stats().captures, 1);
  for (auto& p : net->parameters()) {
    EXPECT_EQ(static_cast<torch::optim::AdamWParamState&>(
                  *opt.state().at(p.unsafeGetTensorImpl())).step(), 10);
  }
}

TEST_F(StepCuda, ShortBatchesArePaddedInTheGraphOrRunEagerlyWithBatchNorm) {
  for (const bool batch_norm : {false, true}) {
    auto batches = make_batches(6, 32, 4, device);
    batches.push_back(make_batches(1, 11, 5, device)[0]);
    batches.push_back(make_batches(1, 32, 6, device)[0]);
    auto net = make_model(7, device, batch_norm), ref = make_model(7, device, batch_norm);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    nt::Step step(net, opt, per_sample(net));
    for (const auto& b : batches) {
      step(b);
      reference_step(ref, ref_opt, b);
    }
    EXPECT_LT(max_diff(net, ref), 1e-5) << "batch_norm " << batch_norm;
    // Padding is exact without batch statistics: the short batch is a replay. With BatchNorm
    // it runs eagerly (the padded rows would change the statistics).
    EXPECT_EQ(step.stats().eager_steps, batch_norm ? 4 : 3) << "batch_norm " << batch_norm;
  }
}

TEST_F(StepCuda, AHostSyncInForwardLossIsASyncErrorAndNothingIsLost) {
  auto batches = make_batches(8, 32, 8, device);
  auto net = make_model(9, device), ref = make_model(9, device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  nt::Step step(net, opt, [net](const nt::Batch& b) mutable {
    torch::Tensor logits = net->forward(b[0]);
    if (logits.abs().max().item<float>() > 1e6) logits = logits / 2;  // a host sync
    return F::cross_entropy(logits, b[1], F::CrossEntropyFuncOptions().reduction(torch::kNone));
  });
  for (size_t i = 0; i < 3; ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_GT(step.stats().host_syncs_in_warmup, 0);
  try {
    step(batches[3]);
    FAIL() << "expected SyncError";
  } catch (const nt::SyncError& e) {
    EXPECT_NE(std::string(e.what()).find("synchronis"), std::string::npos) << e.what();
  }
  EXPECT_LT(max_diff(net, ref), 1e-6);  // as after the last completed step
  for (size_t i = 3; i < batches.size(); ++i) {  // later calls run eagerly, same semantics
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
  }
  EXPECT_LT(max_diff(net, ref), 1e-5);
  EXPECT_EQ(step.stats().phase, nt::Phase::kEager);
  EXPECT_FALSE(step.stats().capture_error.empty());
}

TEST_F(StepCuda, AFailedLaunchOrCaptureLeavesTheModelAndOptimizerAsAfterTheLastStep) {
  for (const int point : {1, 2, 3}) {
    auto batches = make_batches(9, 32, 10 + point, device);
    auto net = make_model(11, device), ref = make_model(11, device);
    auto options = torch::optim::AdamOptions(1e-2);
    torch::optim::Adam opt(net->parameters(), options);
    torch::optim::Adam ref_opt(ref->parameters(), options);
    nt::Step step(net, opt, per_sample(net));
    // Point 3 fails the capture (the 4th call); 1 and 2 fail the launch of the 6th.
    const size_t failing = point == 3 ? 3 : 5;
    for (size_t i = 0; i < failing; ++i) {
      step(batches[i]);
      reference_step(ref, ref_opt, batches[i]);
    }
    step.inject_failure_for_testing(point);
    EXPECT_ANY_THROW(step(batches[failing])) << "point " << point;
    EXPECT_LT(max_diff(net, ref), 1e-6) << "point " << point;
    for (size_t i = failing; i < batches.size(); ++i) {
      step(batches[i]);
      reference_step(ref, ref_opt, batches[i]);
    }
    EXPECT_LT(max_diff(net, ref), 2e-5) << "point " << point;
    for (auto& p : net->parameters()) {
      EXPECT_EQ(static_cast<torch::optim::AdamParamState&>(
                    *opt.state().at(p.unsafeGetTensorImpl())).step(), 9)
          << "point " << point;
    }
  }
}

TEST_F(StepCuda, Bf16AutocastTrainsInTheGraph) {
  auto batches = make_batches(10, 32, 12, device);
  auto net = make_model(13, device), ref = make_model(13, device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_amp(nt::Amp::kBF16));
  for (const auto& b : batches) {
    step(b);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::increment_nesting();
    ref_opt.zero_grad();
    torch::Tensor loss = F::cross_entropy(ref->forward(b[0]), b[1]);
    at::autocast::decrement_nesting();
    at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    loss.backward();
    ref_opt.step();
  }
  EXPECT_LT(max_diff(net, ref), 1e-4);
  EXPECT_EQ(step.stats().captures, 1);
}

// p.set_data(t) after capture gives a parameter storage the graph never reads: the next call
// copies the new values where the graph reads them (the parameter views that again), and the
// step trains on from them as the loop does; data of another dtype is refused, running nothing.
TEST_F(StepCuda, AParameterGivenNewDataAfterCaptureTrainsOnFromItOrIsRefused) {
  Replaying r(14, device);
  ASSERT_EQ(r.step.stats().phase, nt::Phase::kReplay);
  torch::Tensor weight = r.net->parameters()[0];
  const void* where = weight.const_data_ptr();
  const torch::Tensor fresh = torch::randn_like(weight) * 0.1;
  const torch::Tensor halved = fresh.to(torch::kHalf);
  {
    torch::NoGradGuard no_grad;
    weight.set_data(halved);
    r.ref->parameters()[0].set_data(fresh.clone());
  }
  expect_refused(r.step, r.batches[5], {"replaced after capture", "Half"});
  EXPECT_TRUE(torch::equal(weight.detach(), halved));  // nothing ran
  {
    torch::NoGradGuard no_grad;
    weight.set_data(fresh.clone());
  }
  r.train(5, r.batches.size());
  EXPECT_EQ(weight.const_data_ptr(), where);  // back in the storage the graph reads
  EXPECT_LT(max_diff(r.net, r.ref), 1e-5);
  EXPECT_EQ(r.step.stats().captures, 1);
}

// torch::load(module, ...) after capture sets every parameter's and buffer's storage (a
// checkpoint loaded into a running step): the next call copies the loaded values where the
// graph reads them, BatchNorm's running statistics included, and the step trains on from them
// as the loop does.
TEST_F(StepCuda, AModelLoadedWithTorchLoadAfterCaptureTrainsOnFromTheCheckpoint) {
  Replaying r(18, device, /*batch_norm=*/true);
  auto& net = r.net;
  ASSERT_EQ(r.step.stats().phase, nt::Phase::kReplay);
  auto other = make_model(20, device, /*batch_norm=*/true);
  {
    torch::NoGradGuard no_grad;
    for (auto& b : other->buffers()) {
      if (b.is_floating_point()) b.uniform_(0.5, 1.5);  // statistics unlike net's
    }
  }
  auto storages = [&net] {  // where each parameter's, then each buffer's data lies
    std::vector<const void*> at;
    for (const auto& t : net->parameters()) at.push_back(t.const_data_ptr());
    for (const auto& t : net->buffers()) at.push_back(t.const_data_ptr());
    return at;
  };
  const std::vector<const void*> where = storages();
  std::stringstream checkpoint;
  torch::save(other, checkpoint);
  for (auto* model : {&r.net, &r.ref}) {
    checkpoint.seekg(0);
    torch::load(*model, checkpoint);
  }
  ASSERT_NE(net->buffers()[0].const_data_ptr(), where[net->parameters().size()]);
  r.train(5, r.batches.size());
  EXPECT_LT(max_diff(net, r.ref), 1e-5);
  const auto buffers = net->buffers(), ref_buffers = r.ref->buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_TRUE(torch::allclose(buffers[i].to(torch::kDouble), ref_buffers[i].to(torch::kDouble),
                                1e-4, 1e-5)) << "buffer " << i;
  }
  EXPECT_EQ(storages(), where);  // back in the storage the graph reads
  EXPECT_EQ(r.step.stats().captures, 1);
}

// After capture, BatchNorm's running statistics given new tensors (bn->running_mean = t, which
// the loop's forward reads from then on) are copied where the graph reads them, and the step
// trains on as the loop does (a launch that fails after that leaves them as assigned); a
// parameter member given a new tensor, or a child module replaced, is refused with nothing run.
TEST_F(StepCuda, AModuleMemberOrChildAssignedAfterCaptureIsTakenOrRefused) {
  Replaying r(21, device, /*batch_norm=*/true);
  auto &net = r.net, &ref = r.ref;
  auto& step = r.step;
  ASSERT_EQ(step.stats().phase, nt::Phase::kReplay);
  auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(net->ptr(3));
  auto ref_bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(ref->ptr(3));
  ASSERT_TRUE(bn && ref_bn);
  const torch::Tensor read_mean = bn->running_mean, read_var = bn->running_var;
  torch::manual_seed(23);
  const torch::Tensor mean = torch::randn({kShape.classes}, device);
  const torch::Tensor var = torch::rand({kShape.classes}, device) + 0.5;
  bn->running_mean = mean.clone();
  bn->running_var = var.clone();
  ref_bn->running_mean = mean.clone();
  ref_bn->running_var = var.clone();
  for (const int point : {1, 2}) {  // launches that fail once the statistics went back
    step.inject_failure_for_testing(point);
    EXPECT_ANY_THROW(step(r.batches[5])) << "point " << point;
    EXPECT_TRUE(torch::equal(bn->running_mean, mean)) << "point " << point;  // as assigned
    EXPECT_TRUE(torch::equal(bn->running_var, var)) << "point " << point;
    EXPECT_LT(max_diff(net, ref), 1e-5) << "point " << point;
  }
  r.train(5, 7);
  EXPECT_TRUE(bn->running_mean.is_same(read_mean));  // back where the graph reads it
  EXPECT_TRUE(bn->running_var.is_same(read_var));
  EXPECT_TRUE(torch::allclose(bn->running_mean, ref_bn->running_mean, 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(bn->running_var, ref_bn->running_var, 1e-4, 1e-5));
  EXPECT_FALSE(torch::allclose(bn->running_mean, mean));  // the two steps moved them
  EXPECT_LT(max_diff(net, ref), 1e-5);

  auto fc = std::dynamic_pointer_cast<torch::nn::LinearImpl>(net->ptr(0));
  const torch::Tensor weight = fc->weight;
  fc->weight = weight.detach().clone().requires_grad_();
  expect_refused(step, r.batches[7], {"0.weight", "would never train", "Nothing was run"});
  fc->weight = weight;
  const auto relu = net->ptr(1);
  net->replace_module("1", torch::nn::ReLU().ptr());
  expect_refused(step, r.batches[7], {"module '1'", "was replaced by a", "Nothing was run"});
  net->replace_module("1", relu);
  EXPECT_LT(max_diff(net, ref), 1e-5);  // nothing ran
  r.train(7, r.batches.size());
  EXPECT_LT(max_diff(net, ref), 1e-5);
  EXPECT_TRUE(torch::allclose(bn->running_mean, ref_bn->running_mean, 1e-4, 1e-5));
  EXPECT_EQ(step.stats().captures, 1);
}

// The graph runs BatchNorm's batch statistics as it was captured: a module left in eval() after
// an evaluation is refused before anything runs, and train() resumes the graph.
TEST_F(StepCuda, AModuleLeftInEvalAfterCaptureIsRefusedAndTrainResumesTheGraph) {
  Replaying r(16, device, /*batch_norm=*/true);
  r.net->eval();
  expect_refused(r.step, r.batches[5], {"is in eval mode", "call train()"});
  EXPECT_LT(max_diff(r.net, r.ref), 1e-5);  // nothing ran
  r.net->train();
  r.train(5, r.batches.size());
  EXPECT_LT(max_diff(r.net, r.ref), 1e-5);
  EXPECT_EQ(r.step.stats().captures, 1);
}

// A graph runs the kernels its capture chose: a call after a setting that chooses them changed
// (float32 products in TF32, cuDNN switched off) is refused before anything runs, naming it;
// set back, the step trains on as the loop.
TEST_F(StepCuda, ACallAfterAKernelSettingChangedSinceCaptureIsRefusedAndTrainsOnOnceItIsBack) {
  Replaying r(18, device);
  auto& context = at::globalContext();
  const bool tf32 = context.allowTF32CuBLAS(), cudnn = context.userEnabledCuDNN();
  context.setAllowTF32CuBLAS(!tf32);
  expect_refused(r.step, r.batches[5],
                 {"torch.backends.cuda.matmul.fp32_precision", tf32 ? "was 'tf32'" : "was 'ieee'",
                  "Nothing was run"});
  context.setAllowTF32CuBLAS(tf32);
  context.setUserEnabledCuDNN(!cudnn);
  expect_refused(r.step, r.batches[5], {"torch.backends.cudnn.enabled is"});
  context.setUserEnabledCuDNN(cudnn);
  EXPECT_LT(max_diff(r.net, r.ref), 1e-5);  // nothing ran
  r.train(5, r.batches.size());
  EXPECT_LT(max_diff(r.net, r.ref), 1e-5);
  EXPECT_EQ(r.step.stats().captures, 1);
  EXPECT_EQ(r.step.stats().replays, 5 + 5 - 3);
}

// A graph runs the precision it was captured with: a call under at::autocast after a capture
// made without it is refused before anything runs, and the step trains on as the loop without.
TEST_F(StepCuda, ACallUnderAnotherAutocastThanTheCaptureIsRefused) {
  Replaying r(19, device);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  expect_refused(r.step, r.batches[5],
                 {"called under autocast to BFloat16", "captured without autocast",
                  "set_amp(Amp::kBF16)", "Nothing was run"});
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  EXPECT_LT(max_diff(r.net, r.ref), 1e-5);  // nothing ran
  r.train(5, r.batches.size());
  EXPECT_LT(max_diff(r.net, r.ref), 1e-5);
  EXPECT_EQ(r.step.stats().replays, 5 + 5 - 3);
}

// warmup = 1: the first step runs the optimizer as it is, the second is captured and fuses the
// update on the way (the data moves into the flat buffers, where the graph reads it); later
// replays train on from there as the loop.
TEST_F(StepCuda, AWarmUpOfOneStepCapturesTheSecondAndEqualsTheLoop) {
  auto batches = make_batches(6, 32, 32, device);
  auto net = make_model(33, device), ref = make_model(33, device);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_warmup(1));
  train_both(step, ref, ref_opt, batches, 0, batches.size());
  EXPECT_LT(max_diff(net, ref), 2e-5);
  EXPECT_EQ(step.stats().captures, 1);
  EXPECT_EQ(step.stats().replays, 5);
}

// accumulate = 3: three graphs (a window's first, middle and last call) over one set of static
// inputs in the one pool, captured as each kind first comes after warm-up; every window's update
// equals the loop's over its micro-batches, a short one padded in the middle graph included;
// a launch failing inside a window leaves its gradients and the model as they were.
TEST_F(StepCuda, AccumulationCapturesAGraphPerKindOfCallAndEqualsTheLoopWindowByWindow) {
  auto batches = make_batches(24, 32, 30, device);
  batches[16] = {batches[16][0].narrow(0, 0, 9), batches[16][1].narrow(0, 0, 9)};
  auto net = make_model(31, device), ref = make_model(31, device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  nt::Step step(net, opt, per_sample(net),
                nt::StepOptions().set_accumulate(3).set_grad_clip(1.0));
  for (size_t w = 0; w < 8; ++w) {
    const std::vector<nt::Batch> window(batches.begin() + int64_t(3 * w),
                                        batches.begin() + int64_t(3 * w + 3));
    for (size_t i = 0; i < 3; ++i) {
      if (w == 4 && i == 1) {
        std::vector<torch::Tensor> grads;
        for (auto& p : net->parameters()) grads.push_back(p.grad().clone());
        step.inject_failure_for_testing(1);
        EXPECT_ANY_THROW(step(window[i]));
        auto params = net->parameters();
        for (size_t j = 0; j < params.size(); ++j) {
          EXPECT_TRUE(torch::equal(params[j].grad(), grads[j]));
        }
      }
      step(window[i]);
      EXPECT_EQ(step.stepped(), i == 2);
    }
    reference_window(ref, ref_opt, window, 1.0);
    EXPECT_LT(max_diff(net, ref), 5e-5) << "window " << w;
  }
  const nt::StepStats stats = step.stats();
  EXPECT_EQ(stats.phase, nt::Phase::kReplay);
  EXPECT_EQ(stats.captures, 3);
  EXPECT_EQ(stats.updates, 8);
  EXPECT_EQ(stats.eager_steps, 3);
  EXPECT_EQ(stats.replays, 21);
}

// The first window after warm-up opens with a short batch: that call runs eagerly and moves
// the parameters into the flat buffers, and the middle and last calls are captured there. The
// graphs and the module's parameters must stay on that storage in every later window (the
// replays train it, the module reads it) and equal the loop.
TEST_F(StepCuda, AFirstCallAfterWarmUpThatRunsEagerlyLeavesTheGraphsOnTheModulesParameters) {
  auto batches = make_batches(24, 16, 80, device);
  batches[3] = {batches[3][0].narrow(0, 0, 5), batches[3][1].narrow(0, 0, 5)};
  auto net = make_model(81, device), ref = make_model(81, device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_accumulate(3));
  std::vector<const void*> storage;
  for (size_t w = 0; w < 8; ++w) {
    const std::vector<nt::Batch> window(batches.begin() + int64_t(3 * w),
                                        batches.begin() + int64_t(3 * w + 3));
    for (const nt::Batch& b : window) step(b);
    reference_window(ref, ref_opt, window, 0.0);
    ASSERT_LT(max_diff(net, ref), 5e-5) << "window " << w;
    if (w == 1) {
      for (const auto& p : net->parameters()) storage.push_back(p.const_data_ptr());
    } else if (w > 1) {
      const auto params = net->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(params[i].const_data_ptr(), storage[i]) << "window " << w << ", parameter " << i;
      }
    }
  }
  const nt::StepStats stats = step.stats();
  EXPECT_EQ(stats.captures, 3);  // the middle and last in window 1, the first in window 2
  EXPECT_EQ(stats.replays, 3 * 6 + 2);
}

// Windows ended early (step(batch, true)) in graphs: a window of one call is a fourth kind of
// call, captured when it first comes; every window's update equals the loop's over the
// micro-batches it had.
TEST_F(StepCuda, WindowsEndedEarlyReplayTheirOwnGraphsAndEqualTheLoop) {
  auto batches = make_batches(30, 32, 36, device);
  auto net = make_model(37, device), ref = make_model(37, device);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  nt::Step step(net, opt, per_sample(net),
                nt::StepOptions().set_accumulate(4).set_warmup(4));
  size_t next = 0;
  for (const size_t size : {4, 4, 2, 1, 3, 4, 1, 2, 4, 4, 1}) {
    const std::vector<nt::Batch> window(batches.begin() + int64_t(next),
                                        batches.begin() + int64_t(next + size));
    for (size_t i = 0; i < size; ++i) step(window[i], /*update=*/i + 1 == size);
    reference_window(ref, ref_opt, window);
    EXPECT_LT(max_diff(net, ref), 5e-5) << "a window of " << size << " from call " << next;
    next += size;
  }
  EXPECT_EQ(step.stats().captures, 4);  // first, middle, last, and a window of one
  EXPECT_EQ(step.stats().updates, 11);
  EXPECT_EQ(step.stats().eager_steps, 4);
  EXPECT_EQ(step.stats().replays, int64_t(next) - 4);
}

// Loss weights given per call (CallOptions::loss_weight) are staged with each launch: the
// graphs of the Step's own weighting replay them, no new capture, a padded short micro-batch
// and windows ended early included; each window's update equals the loop's (mean *
// w).backward() over its micro-batches. Calls without a weight go back to the Step's.
TEST_F(StepCuda, LossWeightsGivenPerCallAreStagedAndEqualTheLoop) {
  auto batches = make_batches(32, 32, 38, device);
  batches[21] = {batches[21][0].narrow(0, 0, 11), batches[21][1].narrow(0, 0, 11)};
  auto net = make_model(39, device), ref = make_model(39, device);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  nt::Step step(net, opt, per_sample(net),
                nt::StepOptions().set_accumulate(3).set_grad_clip(1.0));
  size_t next = 0;
  int64_t windows = 0;
  for (const size_t size : {3, 3, 3, 3, 2, 3, 3, 1, 3, 3}) {
    const std::vector<nt::Batch> window(batches.begin() + int64_t(next),
                                        batches.begin() + int64_t(next + size));
    const bool own = windows == 8;  // the Step's weighting again, in the same graphs
    std::vector<double> weights;
    for (size_t i = 0; i < size; ++i) weights.push_back(0.1 + 0.25 * double((i + next) % 5));
    for (size_t i = 0; i < size; ++i) {
      nt::CallOptions call;
      call.set_update(i + 1 == size);
      if (!own) call.set_loss_weight(weights[i]);
      step(window[i], call);
      EXPECT_EQ(step.stepped(), i + 1 == size);
    }
    if (own) {
      reference_window(ref, ref_opt, window, 1.0);
    } else {
      reference_weighted_window(ref, ref_opt, window, weights, 1.0);
    }
    EXPECT_LT(max_diff(net, ref), 5e-5) << "a window of " << size << " from call " << next;
    next += size;
    ++windows;
  }
  const nt::StepStats stats = step.stats();
  EXPECT_EQ(stats.phase, nt::Phase::kReplay);
  EXPECT_EQ(stats.captures, 4);  // first, middle, last, and a window of one
  EXPECT_EQ(stats.updates, 10);
  EXPECT_EQ(stats.eager_steps, 3);  // the warm-up: the short micro-batch is padded
  EXPECT_EQ(stats.replays, int64_t(next) - 3);
}

// step.evaluator(fn): eager before the step replays and for short batches; once the step
// replays and fn met a full batch, captured into the step's pool and replayed, reading the
// weights (and BatchNorm's running statistics) where training writes them, equal to the eager
// evaluation of the loop's model after every step; its outputs are fresh; training is left
// alone; a parameter given new data after capture is what the evaluation's graph reads too.
TEST_F(StepCuda, AnEvaluatorIsCapturedInTheStepsPoolAndEqualsTheEagerEvaluation) {
  auto batches = make_batches(10, 32, 60, device);
  auto held_out = make_batches(3, 48, 61, device);
  held_out[2] = {held_out[2][0].narrow(0, 0, 17), held_out[2][1].narrow(0, 0, 17)};
  auto net = make_model(62, device, /*batch_norm=*/true);
  auto ref = make_model(62, device, /*batch_norm=*/true);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  nt::Step step(net, opt, per_sample(net));
  nt::Evaluator evaluate = logits_and_loss(step, net);
  for (size_t i = 0; i < batches.size(); ++i) {
    step(batches[i]);
    reference_step(ref, ref_opt, batches[i]);
    for (const nt::Batch& b : held_out) {
      const std::vector<torch::Tensor> out = evaluate(b);
      const torch::Tensor expected = eval_forward(ref, b[0]);
      EXPECT_LT(diff(out[0], expected), 1e-4) << "after step " << i;
      EXPECT_NEAR(out[1].item<double>(),
                  F::cross_entropy(expected, b[1], F::CrossEntropyFuncOptions().reduction(
                                                       torch::kSum)).item<double>(), 1e-3);
    }
    EXPECT_LT(max_diff(net, ref), 5e-5) << "step " << i;
    EXPECT_TRUE(torch::allclose(net->named_buffers()["3.running_var"],
                                ref->named_buffers()["3.running_var"], 1e-4, 1e-5));
  }
  nt::EvaluatorStats stats = evaluate.stats();
  EXPECT_EQ(stats.captures, 1);
  EXPECT_EQ(stats.replays, 14);  // two full batches after each of the 7 steps from the capture
  EXPECT_EQ(stats.eager, 3 * 3 + 7);  // every batch before, the short one after
  EXPECT_TRUE(stats.capture_error.empty());
  EXPECT_EQ(step.stats().captures, 1);

  const torch::Tensor kept = evaluate(held_out[0])[0];
  const torch::Tensor copy = kept.clone();
  evaluate(held_out[1]);
  EXPECT_TRUE(torch::equal(kept, copy));  // fresh outputs: the next replay leaves them alone

  torch::Tensor weight = net->parameters()[0];
  const torch::Tensor fresh = torch::randn_like(weight) * 0.1;
  {
    torch::NoGradGuard no_grad;
    weight.set_data(fresh.clone());
    ref->parameters()[0].set_data(fresh.clone());
  }
  EXPECT_LT(diff(evaluate(held_out[0])[0], eval_forward(ref, held_out[0][0])), 1e-4);
  EXPECT_EQ(evaluate.stats().replays, 17);
  step(batches[0]);
  reference_step(ref, ref_opt, batches[0]);
  EXPECT_LT(max_diff(net, ref), 5e-5);
}

// Inside ema_weights() the evaluator's graph evaluates the averages (copied into the tensors
// it reads), and the trained weights after the scope.
TEST_F(StepCuda, AnEvaluatorsGraphInsideEmaWeightsEvaluatesTheAverages) {
  auto batches = make_batches(8, 32, 63, device);
  auto net = make_model(64, device, /*batch_norm=*/true);
  auto ref = make_model(64, device, /*batch_norm=*/true);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_ema(0.8));
  nt::Evaluator evaluate = logits_and_loss(step, net);
  for (const nt::Batch& b : batches) {
    step(b);
    evaluate(b);
  }
  ASSERT_EQ(evaluate.stats().captures, 1);
  const torch::Tensor trained = evaluate(batches[0])[0];
  torch::Tensor averaged;
  {
    const auto in = step.ema_weights();
    averaged = evaluate(batches[0])[0];
  }
  auto state = step.ema_state_dict();
  {
    torch::NoGradGuard no_grad;
    for (const auto& item : ref->named_parameters()) item.value().copy_(state[item.key()]);
    for (const auto& item : ref->named_buffers()) item.value().copy_(state[item.key()]);
  }
  EXPECT_LT(diff(averaged, eval_forward(ref, batches[0][0])), 1e-4);
  EXPECT_GT(diff(averaged, trained), 1e-3);
  EXPECT_TRUE(torch::equal(evaluate(batches[0])[0], trained));
  EXPECT_EQ(evaluate.stats().replays, 8);  // 5 in the loop, 3 here
}

// An evaluator whose capture fails (here injected) warns, evaluates eagerly, correctly, from
// then on, and leaves the model and optimizer alone; one whose launch fails raises, and the
// next call replays; training equals the loop's throughout.
TEST_F(StepCuda, AnEvaluatorsFailedCaptureOrLaunchChangesNothing) {
  Replaying r(65, device);
  nt::Evaluator evaluate = logits_and_loss(r.step, r.net);
  const nt::Batch& b = r.batches[9];
  evaluate(b);
  r.step.inject_failure_for_testing(3);
  EXPECT_LT(diff(evaluate(b)[0], eval_forward(r.ref, b[0])), 1e-4);
  nt::EvaluatorStats stats = evaluate.stats();
  EXPECT_EQ(stats.captures, 0);
  EXPECT_NE(stats.capture_error.find("injected failure"), std::string::npos)
      << stats.capture_error;
  EXPECT_LT(max_diff(r.net, r.ref), 1e-5);
  r.train(5, 7);
  EXPECT_LT(diff(evaluate(b)[0], eval_forward(r.ref, b[0])), 1e-4);
  EXPECT_EQ(evaluate.stats().eager, 3);

  nt::Evaluator second = logits_and_loss(r.step, r.net);
  second(b);
  second(b);
  ASSERT_EQ(second.stats().captures, 1);
  for (const int point : {1, 2}) {
    r.step.inject_failure_for_testing(point);
    EXPECT_ANY_THROW(second(r.batches[point]));
    EXPECT_LT(max_diff(r.net, r.ref), 5e-5);
    EXPECT_LT(diff(second(b)[0], eval_forward(r.ref, b[0])), 1e-4) << "point " << point;
  }
  r.train(7, 10);
  EXPECT_LT(max_diff(r.net, r.ref), 5e-5);
  EXPECT_EQ(r.step.stats().replays, 10 - 3);
  EXPECT_EQ(second.stats().replays, 3);
}

// Random loops in graphs (step_reference.h): every kind of call captured as it comes, short
// micro-batches padded, loss weights staged; each window equals the hand-written loop's.
TEST_F(StepCuda, RandomLoopsInGraphsEqualTheHandWrittenLoopWindowByWindow) {
  for (uint32_t seed = 0; seed < 24; ++seed) {
    nimble_train::testing::random_loop(seed, kShape, device, 5e-5);
  }
}

// The loss a call returns stays its value until the step's next call: an evaluator captured
// before a kind of call (here the window's last, with accumulation) replays into memory of
// its own that the later graph's loss must not share.
TEST_F(StepCuda, ALossHeldAcrossAnEvaluatorsReplaysKeepsItsValue) {
  auto batches = make_batches(8, 32, 67, device);
  auto net = make_model(68, device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_accumulate(2).set_warmup(2));
  nt::Evaluator evaluate = logits_and_loss(step, net);
  step(batches[0]);
  step(batches[1]);  // warm-up ends with the first window
  step(batches[2]);  // the window's first call: captured
  evaluate(batches[6]);
  evaluate(batches[6]);  // the evaluator: captured after the first kind
  // The MLP has no BatchNorm or dropout: its eval-mode forward is the training one.
  const double expected =
      F::cross_entropy(eval_forward(net, batches[3][0]), batches[3][1]).item<double>();
  const torch::Tensor loss = step(batches[3]);  // the last kind: captured after the evaluator
  ASSERT_EQ(step.stats().captures, 2);
  ASSERT_EQ(evaluate.stats().captures, 1);
  const torch::Tensor value = loss.clone();
  for (int i = 0; i < 3; ++i) evaluate(batches[7 - i % 2]);
  EXPECT_TRUE(torch::equal(loss, value));
  EXPECT_NEAR(value.item<double>(), expected, 1e-4);  // the loss before this call's update
}

// An evaluator's graph runs the precision it was captured with: a call under another
// at::autocast is refused before anything runs.
TEST_F(StepCuda, AnEvaluatorCalledUnderAnotherAutocastThanItsCaptureIsRefused) {
  Replaying r(66, device);
  nt::Evaluator evaluate = logits_and_loss(r.step, r.net);
  evaluate(r.batches[0]);
  evaluate(r.batches[0]);
  ASSERT_EQ(evaluate.stats().captures, 1);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  try {
    evaluate(r.batches[1]);
    ADD_FAILURE() << "the evaluation ran under another autocast";
  } catch (const nt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("captured without autocast"), std::string::npos)
        << e.what();
  }
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  EXPECT_LT(diff(evaluate(r.batches[1])[0], eval_forward(r.ref, r.batches[1][0])), 1e-4);
  EXPECT_EQ(evaluate.stats().replays, 2);
}

// ema = 0.9 in graphs, with accumulate = 2 and BatchNorm: the average moves in the update's
// graph (one lerp_ per flat buffer, and the running statistics), and after every update equals
// a hand-written EMA's; ema_weights() swaps it in for a scope and back.
TEST_F(StepCuda, TheEmaMovesInTheUpdatesGraphAndEqualsAHandWrittenAverage) {
  auto batches = make_batches(16, 32, 42, device);
  auto net = make_model(43, device, /*batch_norm=*/true);
  auto ref = make_model(43, device, /*batch_norm=*/true);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_ema(0.9).set_accumulate(2));
  ReferenceEma ema(*ref, 0.9);
  for (size_t i = 0; i < batches.size(); i += 2) {
    const std::vector<nt::Batch> window(batches.begin() + int64_t(i),
                                        batches.begin() + int64_t(i) + 2);
    for (const nt::Batch& b : window) step(b);
    reference_window(ref, ref_opt, window);
    ema.update();
    EXPECT_LT(ema.max_diff(step.ema_state_dict(), *net), 5e-5) << "call " << i + 2;
  }
  EXPECT_LT(max_diff(net, ref), 5e-5);
  EXPECT_EQ(step.stats().captures, 2);
  EXPECT_EQ(step.stats().replays, 12);
  const torch::Tensor trained = net->parameters()[0].detach().clone();
  {
    const auto averaged = step.ema_weights();
    EXPECT_LT((net->parameters()[0] - ema.averages.at("0.weight")).abs().max().item<double>(),
              5e-5);
  }
  EXPECT_TRUE(torch::equal(net->parameters()[0], trained));
  step(batches[0]);
  step(batches[1]);
  EXPECT_EQ(step.stats().replays, 14);
}

// A sparse gradient cannot live in a graph (its size follows the batch's indices): a captured
// Step refuses it at the second call, naming the parameter, before anything runs; without a
// capture, torch::optim's step() takes it at every step.
TEST_F(StepCuda, ASparseGradientIsRefusedByACapturedStepAndTrainsWithoutOne) {
  auto make = [this] {
    torch::manual_seed(0);
    torch::nn::Sequential net(
        torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(30, 8).sparse(true)),
        torch::nn::Linear(8, 4));
    net->to(device);
    return net;
  };
  torch::manual_seed(3);
  const auto ints = torch::TensorOptions(device).dtype(torch::kLong);
  std::vector<nt::Batch> batches;
  for (int i = 0; i < 6; ++i) {
    batches.push_back({torch::randint(0, 30, {16, 5}, ints), torch::randint(0, 4, {16}, ints)});
  }
  for (const bool capture : {true, false}) {
    auto net = make(), ref = make();
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    nt::Step step(net, opt, per_sample(net), nt::StepOptions().set_capture(capture));
    step(batches[0]);
    reference_step(ref, ref_opt, batches[0]);
    if (capture) {
      expect_refused(step, batches[1], {"0.weight", "sparse gradient", "sparse(false)"});
      EXPECT_LT(max_diff(net, ref), 1e-6);  // nothing ran
      EXPECT_EQ(step.stats().captures, 0);
      continue;
    }
    for (size_t i = 1; i < batches.size(); ++i) {
      step(batches[i]);
      reference_step(ref, ref_opt, batches[i]);
    }
    EXPECT_TRUE(net[0]->parameters()[0].grad().is_sparse());
    EXPECT_LT(max_diff(net, ref), 1e-5);
    EXPECT_EQ(step.stats().update, "eager");
  }
}

// A parameter the first step gave no gradient is left out of the fused update (as
// torch::optim's step() skips it); one that gets a gradient later, in a warm-up step or in the
// captured forward, is not dropped: that step and every later one run torch::optim's step(),
// eagerly, and the call that was to capture loses nothing.
TEST_F(StepCuda, AParameterGivenItsFirstGradientInWarmUpOrCaptureTrainsEagerlyWithTorchOptim) {
  const auto batches = nimble_train::testing::make_mlp_batches(7, 16, 4, {8, 16, 4}, device);
  for (const int64_t from : {1, 3}) {  // a warm-up step's (fused) forward, the capture's
    auto net = LateLayer::make(device), ref = LateLayer::make(device);
    const auto options = torch::optim::AdamOptions(1e-2);
    torch::optim::Adam opt(net->parameters(), options), ref_opt(ref->parameters(), options);
    LateLayer late{from};
    nt::Step step(net, opt, late.forward_loss(net), nt::StepOptions().set_warmup(3));
    for (size_t i = 0; i < batches.size(); ++i) {
      late.call = int64_t(i);
      const double loss = step(batches[i]).item<double>();
      ref_opt.zero_grad();
      torch::Tensor expected = F::cross_entropy(late.logits(ref, batches[i][0]), batches[i][1]);
      expected.backward();
      ref_opt.step();
      EXPECT_NEAR(loss, expected.item<double>(), 1e-5) << "from " << from << ", step " << i;
      EXPECT_LT(max_diff(net, ref), 1e-5) << "from " << from << ", step " << i;
    }
    const nt::StepStats stats = step.stats();
    EXPECT_EQ(stats.captures, 0);
    EXPECT_EQ(stats.phase, nt::Phase::kEager);
    EXPECT_EQ(stats.update, "eager");
    EXPECT_NE(stats.capture_error.find("1.weight (param_groups()[0].params()[2]) got a "
                                       "gradient at call " + std::to_string(from + 1)),
              std::string::npos) << stats.capture_error;
  }
}

#else
TEST(StepCuda, NeedsACudaBuild) { GTEST_SKIP() << "this build has no CUDA"; }
#endif
