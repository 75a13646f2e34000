// train_cnn: the C++ quick start. Trains SmallCnn (model.h) on synthetic CIFAR-shaped data
// with nimble_train::Step: a few eager warm-up steps, then one CUDA graph launch per step.
//
//   train_cnn [--steps N] [--batch B] [--device cpu|cuda] [--no-capture] [--adamw]
//             [--accumulate K]
//
// --accumulate K: K micro-batches (calls) per optimizer update, the learning rate scheduled
// per update. Prints the loss every tenth of the run, then samples/s and the Step's
// statistics. Exit code 0 on success, 1 when training fails (the message says why and how to
// fix it), 2 on a bad argument.
#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <numbers>
#include <optional>
#include <string_view>

#include <nimble_train/step.h>

#include "model.h"

namespace {

constexpr int64_t kWarmup = 3;   // eager steps before the capture
constexpr int64_t kBatches = 4;  // distinct synthetic batches, cycled
constexpr int64_t kHeldOut = 4;  // held-out batches, evaluated after training
constexpr double kSgdLr = 0.05;
constexpr double kAdamWLr = 1e-3;

struct Args {
  int64_t steps = 200;
  int64_t batch = 32;
  bool capture = true;
  bool adamw = false;
  int64_t accumulate = 1;
  torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
};

constexpr const char* kUsage =
    "usage: train_cnn [--steps N] [--batch B] [--device cpu|cuda] [--no-capture] [--adamw] "
    "[--accumulate K]\n";

std::optional<int64_t> positive(std::string_view text) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value < 1) {
    return std::nullopt;
  }
  return value;
}

// The arguments, or std::nullopt after printing what was wrong.
std::optional<Args> parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    const bool has_value = i + 1 < argc;
    if (flag == "--no-capture") {
      args.capture = false;
    } else if (flag == "--adamw") {
      args.adamw = true;
    } else if ((flag == "--steps" || flag == "--batch" || flag == "--accumulate") && has_value) {
      const std::optional<int64_t> value = positive(argv[++i]);
      if (!value) {
        std::fprintf(stderr, "%s needs a positive integer; got '%s'\n%s", argv[i - 1], argv[i],
                     kUsage);
        return std::nullopt;
      }
      (flag == "--steps" ? args.steps : flag == "--batch" ? args.batch : args.accumulate) = *value;
    } else if (flag == "--device" && has_value) {
      const std::string_view device = argv[++i];
      if (device == "cpu") {
        args.device = torch::kCPU;
      } else if (device == "cuda" && torch::cuda::is_available()) {
        args.device = torch::kCUDA;
      } else if (device == "cuda") {
        std::fprintf(stderr, "--device cuda: no CUDA device is visible; use --device cpu\n");
        return std::nullopt;
      } else {
        std::fprintf(stderr, "--device must be cpu or cuda; got '%s'\n%s", argv[i], kUsage);
        return std::nullopt;
      }
    } else {
      std::fprintf(stderr, "unknown argument or missing value: '%s'\n%s", argv[i], kUsage);
      return std::nullopt;
    }
  }
  return args;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(SmallCnn& net, bool adamw) {
  if (adamw) {
    return std::make_unique<torch::optim::AdamW>(net->parameters(),
                                                 torch::optim::AdamWOptions(kAdamWLr));
  }
  return std::make_unique<torch::optim::SGD>(net->parameters(),
                                             torch::optim::SGDOptions(kSgdLr).momentum(0.9));
}

// Cosine decay from `base` at step 0 to base / 10 at the last step. Set through
// param_groups() before every call: the Step reads it there and stages it for the graph, so a
// new learning rate needs no new capture.
double cosine_lr(double base, int64_t step, int64_t steps) {
  const double progress = static_cast<double>(step) / static_cast<double>(steps);
  return base * (0.1 + 0.45 * (1.0 + std::cos(std::numbers::pi * progress)));
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) {
    torch::cuda::synchronize();
  }
}

int train(const Args& args) {
  torch::manual_seed(0);
  if (args.device.is_cuda()) {
    at::globalContext().setBenchmarkCuDNN(true);  // fixed shapes: autotune once, in warm-up
  }
  SmallCnn net;
  net->to(args.device);
  std::unique_ptr<torch::optim::Optimizer> optimizer = make_optimizer(net, args.adamw);
  const double base_lr = args.adamw ? kAdamWLr : kSgdLr;

  // Made once, on the device: the loop measures the step, not a data loader. Each class
  // tints its images with a colour of its own, so the loss has something to learn.
  const torch::TensorOptions on_device(args.device);
  const at::Tensor labels =
      torch::randint(0, 10, {kBatches, args.batch}, on_device.dtype(torch::kLong));
  const at::Tensor colours = 0.5 * torch::randn({10, 3, 1, 1}, on_device);
  const at::Tensor images = torch::randn({kBatches, args.batch, 3, 32, 32}, on_device) +
                            colours.index_select(0, labels.flatten())
                                .view({kBatches, args.batch, 3, 1, 1});
  // Held-out batches of the same classes, for the evaluation after training.
  const at::Tensor held_labels =
      torch::randint(0, 10, {kHeldOut, args.batch}, on_device.dtype(torch::kLong));
  const at::Tensor held_images = torch::randn({kHeldOut, args.batch, 3, 32, 32}, on_device) +
                                 colours.index_select(0, held_labels.flatten())
                                     .view({kHeldOut, args.batch, 3, 1, 1});

  // One loss per sample (reduction none): the Step averages them, and a short last batch can
  // then be padded and masked inside the graph instead of running eagerly.
  nimble_train::Step step(
      net, *optimizer,
      [net](const nimble_train::Batch& b) mutable {
        namespace F = torch::nn::functional;
        return F::cross_entropy(net->forward(b[0]), b[1],
                                F::CrossEntropyFuncOptions().reduction(torch::kNone));
      },
      nimble_train::StepOptions()
          .set_warmup(kWarmup)
          .set_capture(args.capture)
          .set_accumulate(args.accumulate));

  // Timed from the first step after warm-up and the captures (warm-up ends at a window's end;
  // the next window captures a graph per kind of call); a run too short for that is timed
  // whole.
  const int64_t k = args.accumulate;
  const int64_t captured_by = (kWarmup + k - 1) / k * k + k;
  const int64_t first_timed = args.steps > captured_by ? captured_by : 0;
  // Reading a loss is a host sync, so only every tenth of the run.
  const int64_t print_every = std::max<int64_t>(1, args.steps / 10);
  std::chrono::steady_clock::time_point start;
  for (int64_t i = 0; i < args.steps; ++i) {
    if (i == first_timed) {
      synchronize(args.device);
      start = std::chrono::steady_clock::now();
    }
    // Per update: with accumulation the window's last call reads it.
    const double lr = cosine_lr(base_lr, i / args.accumulate,
                                (args.steps + args.accumulate - 1) / args.accumulate);
    optimizer->param_groups()[0].options().set_lr(lr);
    const at::Tensor loss = step({images[i % kBatches], labels[i % kBatches]});
    if ((i + 1) % print_every == 0 || i + 1 == args.steps) {
      std::printf("step %lld lr %.5f loss %.4f\n", static_cast<long long>(i + 1), lr,
                  loss.item<float>());
    }
  }
  synchronize(args.device);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t timed = args.steps - first_timed;

  std::printf("samples/s %.1f over steps %lld..%lld (batch %lld, %s, %s)\n",
              static_cast<double>(timed * args.batch) / seconds,
              static_cast<long long>(first_timed + 1), static_cast<long long>(args.steps),
              static_cast<long long>(args.batch), args.device.is_cuda() ? "cuda" : "cpu",
              args.adamw ? "AdamW" : "SGD");
  // Evaluation: the model in eval mode, autograd off; on a GPU captured into the step's pool
  // after one eager batch, then one launch per batch. Correct predictions are summed on the
  // device: one host sync for the whole held-out set.
  nimble_train::Evaluator evaluate = step.evaluator([net](const nimble_train::Batch& b) mutable {
    return std::vector<at::Tensor>{net->forward(b[0]).argmax(1).eq(b[1]).sum()};
  });
  at::Tensor correct = torch::zeros({}, on_device.dtype(torch::kLong));
  for (int64_t i = 0; i < kHeldOut; ++i) {
    correct += evaluate({held_images[i], held_labels[i]})[0];
  }
  const nimble_train::EvaluatorStats evaluated = evaluate.stats();
  std::printf("eval: accuracy %.4f over %lld held-out samples (evaluator: replays %lld, eager "
              "%lld)\n",
              static_cast<double>(correct.item<int64_t>()) /
                  static_cast<double>(kHeldOut * args.batch),
              static_cast<long long>(kHeldOut * args.batch),
              static_cast<long long>(evaluated.replays), static_cast<long long>(evaluated.eager));

  const nimble_train::StepStats stats = step.stats();
  std::printf(
      "stats: phase %s, calls %lld, eager steps %lld, replays %lld, captures %lld, "
      "updates %lld, graph nodes %lld, update %s, host syncs in warm-up %lld\n",
      nimble_train::phase_name(stats.phase), static_cast<long long>(stats.calls),
      static_cast<long long>(stats.eager_steps), static_cast<long long>(stats.replays),
      static_cast<long long>(stats.captures), static_cast<long long>(stats.updates),
      static_cast<long long>(stats.graph_nodes),
      stats.update.c_str(), static_cast<long long>(stats.host_syncs_in_warmup));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::optional<Args> args = parse(argc, argv);
  if (!args) {
    return 2;
  }
  try {
    return train(*args);
  } catch (const nimble_train::Error& e) {
    std::fprintf(stderr, "nimble_train: %s\n", e.what());
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "torch: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
