// The hand-written LibTorch loop the C++ Step is compared with, and the comparisons.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "nimble_train/step.h"

namespace nimble_train::testing {

namespace F = torch::nn::functional;

// A two-layer MLP classifier: features -> hidden -> classes (then BatchNorm1d if asked).
struct MlpShape {
  int64_t features, hidden, classes;
};

inline torch::nn::Sequential make_mlp(int64_t seed, MlpShape shape, torch::Device device,
                                      bool batch_norm = false) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(shape.features, shape.hidden), torch::nn::ReLU(),
                            torch::nn::Linear(shape.hidden, shape.classes));
  if (batch_norm) net->push_back(torch::nn::BatchNorm1d(shape.classes));
  net->to(device);
  return net;
}

// `count` random batches of `size` samples (features, label) for that classifier.
inline std::vector<Batch> make_mlp_batches(int64_t count, int64_t size, int64_t seed,
                                           MlpShape shape, torch::Device device) {
  torch::manual_seed(seed);
  std::vector<Batch> batches;
  for (int64_t i = 0; i < count; ++i) {
    batches.push_back({torch::randn({size, shape.features}).to(device),
                       torch::randint(0, shape.classes, {size}).to(device)});
  }
  return batches;
}

// The largest absolute difference between the parameters of two models of one architecture.
inline double max_diff(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  double worst = 0;
  auto pa = a->parameters();
  auto pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>());
  }
  return worst;
}

// Per-sample cross-entropy: the Step averages it (and masks padding in a graph).
inline ForwardLoss per_sample(torch::nn::Sequential& net) {
  return [net](const Batch& b) mutable {
    return F::cross_entropy(net->forward(b[0]), b[1],
                            F::CrossEntropyFuncOptions().reduction(torch::kNone));
  };
}

// The model's outputs in eval mode, without autograd (BatchNorm's running statistics).
inline torch::Tensor eval_forward(torch::nn::Sequential& net, const torch::Tensor& x) {
  const torch::NoGradGuard no_grad;
  net->eval();
  torch::Tensor out = net->forward(x);
  net->train();
  return out;
}

// One iteration of the hand-written loop: zero_grad, mean loss, backward, clipping, step.
inline double reference_step(torch::nn::Sequential& net, torch::optim::Optimizer& opt,
                             const Batch& b, double clip = 0) {
  opt.zero_grad();
  torch::Tensor loss = F::cross_entropy(net->forward(b[0]), b[1]);
  loss.backward();
  if (clip > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), clip);
  opt.step();
  return loss.item<double>();
}

// One window of the hand-written accumulation loop: zero_grad; each micro-batch's summed loss
// over the window's samples, backward (with full micro-batches, (mean / K).backward()); or,
// with `scalar`, each micro-batch's mean loss over K; clipping; step.
inline void reference_window(torch::nn::Sequential& net, torch::optim::Optimizer& opt,
                             const std::vector<Batch>& window, double clip = 0,
                             bool scalar = false) {
  opt.zero_grad();
  int64_t total = 0;
  for (const Batch& b : window) total += b[0].size(0);
  for (const Batch& b : window) {
    torch::Tensor logits = net->forward(b[0]);
    torch::Tensor loss =
        scalar ? F::cross_entropy(logits, b[1]) / double(window.size())
               : F::cross_entropy(logits, b[1],
                                  F::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                     double(total);
    loss.backward();
  }
  if (clip > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), clip);
  opt.step();
}

// One window of a loop that weights each micro-batch's mean loss itself (a loop normalising
// by the window's token count): zero_grad; (mean * weights[i]).backward() for each; clipping;
// step.
inline void reference_weighted_window(torch::nn::Sequential& net, torch::optim::Optimizer& opt,
                                      const std::vector<Batch>& window,
                                      const std::vector<double>& weights, double clip = 0) {
  opt.zero_grad();
  for (size_t i = 0; i < window.size(); ++i) {
    (F::cross_entropy(net->forward(window[i][0]), window[i][1]) * weights[i]).backward();
  }
  if (clip > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), clip);
  opt.step();
}

// A hand-written EMA (torch.optim.swa_utils' lerp) of a module's parameters and floating-point
// buffers, by name, after each update: avg += (1 - decay) * (t - avg).
struct ReferenceEma {
  ReferenceEma(torch::nn::Module& module, double decay) : module(module), decay(decay) {
    const torch::NoGradGuard no_grad;
    for (const auto& named : module.named_parameters()) {
      averages.emplace(named.key(), named.value().detach().clone());
    }
    for (const auto& named : module.named_buffers()) {
      if (named.value().is_floating_point()) {
        averages.emplace(named.key(), named.value().detach().clone());
      }
    }
  }
  void update() {
    const torch::NoGradGuard no_grad;
    for (const auto& named : module.named_parameters()) {
      averages.at(named.key()).lerp_(named.value(), 1.0 - decay);
    }
    for (const auto& named : module.named_buffers()) {
      if (named.value().is_floating_point()) {
        averages.at(named.key()).lerp_(named.value(), 1.0 - decay);
      }
    }
  }
  // The largest difference between these averages and the Step's (ema_state_dict()); the
  // integer buffers there must be the module's own.
  double max_diff(const torch::OrderedDict<std::string, torch::Tensor>& state,
                  torch::nn::Module& trained) const {
    double worst = 0;
    for (const auto& item : state) {
      const auto it = averages.find(item.key());
      if (it != averages.end()) {
        worst = std::max(worst, (item.value() - it->second).abs().max().item<double>());
        continue;
      }
      const torch::Tensor own = trained.named_buffers()[item.key()];
      EXPECT_TRUE(torch::equal(item.value(), own)) << item.key();
    }
    EXPECT_EQ(state.size(), trained.named_parameters().size() + trained.named_buffers().size());
    return worst;
  }
  torch::nn::Module& module;
  double decay;
  std::map<std::string, torch::Tensor> averages;
};

inline void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

// A model whose second layer runs only from call `from` on (a curriculum, or a branch on host
// data): the first step gives that layer no gradient. Set `call` before each call.
struct LateLayer {
  static torch::nn::Sequential make(torch::Device device) {
    torch::manual_seed(0);
    torch::nn::Sequential net(torch::nn::Linear(8, 4), torch::nn::Linear(4, 4));
    net->to(device);
    return net;
  }
  torch::Tensor logits(torch::nn::Sequential& net, const torch::Tensor& x) const {
    torch::Tensor h = net[0]->as<torch::nn::Linear>()->forward(x);
    return call >= from ? net[1]->as<torch::nn::Linear>()->forward(h) : h;
  }
  ForwardLoss forward_loss(torch::nn::Sequential net) {
    return [this, net](const Batch& b) mutable {
      return F::cross_entropy(logits(net, b[0]), b[1],
                              F::CrossEntropyFuncOptions().reduction(torch::kNone));
    };
  }
  int64_t from;
  int64_t call = 0;
};

// The call is refused: a nimble_train::Error whose message says each of `said`.
inline void expect_refused(Step& step, const Batch& batch,
                           std::initializer_list<const char*> said,
                           const CallOptions& call = CallOptions()) {
  try {
    step(batch, call);
    ADD_FAILURE() << "the call ran; expected a nimble_train::Error saying \""
                  << *said.begin() << "\"";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const char* part : said) EXPECT_NE(what.find(part), std::string::npos) << what;
  }
}

// A random loop (from `seed`) against the hand-written one, window by window: accumulate 1
// to 4, windows ended early, short micro-batches, loss weights given for whole windows,
// clipping, SGD, Adam or AdamW, learning rates changed between windows, an EMA, and an
// evaluator called between calls (mid-window too). The parameters, the averages, stepped()
// and the update count must agree after every window (within `tol`), each evaluation with the
// loop's model evaluated eagerly, and a loss held across an evaluation keeps its value. On a
// GPU the Step captures a graph per kind of call and pads the short micro-batches in them,
// and the evaluator is captured wherever its second full batch falls.
inline void random_loop(uint32_t seed, MlpShape shape, torch::Device device, double tol) {
  std::mt19937 rng(seed);
  const auto pick = [&](int n) { return int(rng() % uint32_t(n)); };
  const int64_t k = 1 + pick(4);
  const int optimizer = pick(3);
  const double clip = pick(2) == 0 ? 0.0 : 0.3 + 0.1 * pick(5);
  const bool ema = pick(2) == 0;
  auto net = make_mlp(100 + seed, shape, device), ref = make_mlp(100 + seed, shape, device);
  const auto make = [&](torch::nn::Sequential& m) -> std::unique_ptr<torch::optim::Optimizer> {
    if (optimizer == 0) {
      return std::make_unique<torch::optim::SGD>(
          m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
    }
    if (optimizer == 1) {
      return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-2));
    }
    return std::make_unique<torch::optim::AdamW>(m->parameters(), torch::optim::AdamWOptions(1e-2));
  };
  auto opt = make(net), ref_opt = make(ref);
  StepOptions options;
  options.set_accumulate(k);
  if (clip > 0) options.set_grad_clip(clip);
  if (ema) options.set_ema(0.7);
  Step step(net, *opt, per_sample(net), options);
  Evaluator evaluate = step.evaluator([net](const Batch& b) mutable {
    return std::vector<at::Tensor>{net->forward(b[0])};
  });
  // Held-out batches: its first call fixes its layout with a full one.
  std::vector<Batch> held_out = make_mlp_batches(2, 16, 7 + seed, shape, device);
  held_out.push_back({held_out[1][0].narrow(0, 0, 5), held_out[1][1].narrow(0, 0, 5)});
  int64_t evaluations = 0;
  std::optional<ReferenceEma> ref_ema;
  if (ema) ref_ema.emplace(*ref, 0.7);
  const std::string run = "seed " + std::to_string(seed) + " (accumulate " + std::to_string(k) +
                          ", optimizer " + std::to_string(optimizer) + ", clip " +
                          std::to_string(clip) + ", ema " + std::to_string(ema) + ")";
  int64_t calls = 0, updates = 0;
  for (int w = 0; w < 8; ++w) {
    const int64_t size = pick(4) == 0 ? 1 + pick(int(k)) : k;  // ended early, or full
    const double lr = (optimizer == 0 ? 0.1 : 1e-2) * (0.5 + 0.1 * pick(10));
    set_lr(*opt, lr);
    set_lr(*ref_opt, lr);
    const bool weighted = k > 1 && pick(3) == 0;
    std::vector<Batch> window;
    std::vector<double> weights;
    for (int64_t i = 0; i < size; ++i) {
      const int64_t samples = calls == 0 || pick(4) != 0 ? 16 : 1 + pick(15);
      torch::manual_seed(1000 * seed + uint32_t(calls));
      window.push_back({torch::randn({samples, shape.features}).to(device),
                        torch::randint(0, shape.classes, {samples}).to(device)});
      weights.push_back(0.1 + 0.2 * pick(5));
      CallOptions call;
      call.set_update(i + 1 == size);
      if (weighted) call.set_loss_weight(weights.back());
      const at::Tensor loss = step(window.back(), call);
      ++calls;
      ASSERT_EQ(step.stepped(), i + 1 == size) << run << ", window " << w;
      if (i + 1 < size && pick(3) == 0) {  // mid-window: the model is the loop's as it was
        const at::Tensor held = loss.clone();
        const Batch& b = held_out[evaluations++ == 0 ? 0 : size_t(pick(3))];
        const at::Tensor out = evaluate(b)[0];
        ASSERT_LT((out - eval_forward(ref, b[0])).abs().max().item<double>(), 10 * tol) << run;
        ASSERT_TRUE(torch::equal(loss, held)) << run << ": an evaluation changed the held loss";
      }
    }
    if (weighted) {
      reference_weighted_window(ref, *ref_opt, window, weights, clip);
    } else {
      reference_window(ref, *ref_opt, window, clip);
    }
    if (ref_ema) ref_ema->update();
    ++updates;
    ASSERT_LT(max_diff(net, ref), tol) << run << ", window " << w;
    if (ref_ema) {
      ASSERT_LT(ref_ema->max_diff(step.ema_state_dict(), *net), tol) << run;
    }
  }
  EXPECT_EQ(step.stats().updates, updates) << run;
  EXPECT_EQ(step.stats().calls, calls) << run;
  EXPECT_EQ(evaluate.stats().eager + evaluate.stats().replays, evaluations) << run;
  if (device.is_cuda()) {  // the graphs ran: the step's, and the evaluator's wherever captured
    EXPECT_GT(step.stats().replays, 0) << run;
    EXPECT_TRUE(evaluate.stats().capture_error.empty()) << run << ": "
                                                        << evaluate.stats().capture_error;
  }
}

}  // namespace nimble_train::testing
