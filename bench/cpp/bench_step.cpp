// The C++ rows of bench/bench_cpp_step.py: one SGD training step of SmallCnn
// (examples/cpp/model.h) timed on the GPU three ways — LibTorch's eager loop, the whole step
// captured by hand as one CUDA graph, and nimble_train::Step. A shared library with a C
// interface, so that the script loads it into the process that runs its Python rows: one
// torch, one GPU context, one set of cuDNN settings for every row.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nimble_train/step.h>

#include "model.h"

// The script finds these by name (ctypes), so they keep C linkage.
#define NT_BENCH_API extern "C"

namespace {

constexpr double kLr = 0.05;
constexpr double kMomentum = 0.9;
constexpr int64_t kBatches = 4;        // distinct batches, cycled
constexpr int64_t kGraphWarmup = 3;    // the hand-written recipe's side-stream warm-up steps

namespace F = torch::nn::functional;

// kBatches batches of [batch, 3, 32, 32] images and [batch] labels, on the GPU.
struct Data {
  std::vector<at::Tensor> images, labels;

  explicit Data(int64_t batch) {
    const torch::TensorOptions cuda(torch::kCUDA);
    for (int64_t i = 0; i < kBatches; ++i) {
      images.push_back(torch::randn({batch, 3, 32, 32}, cuda));
      labels.push_back(torch::randint(0, 10, {batch}, cuda.dtype(torch::kLong)));
    }
  }
};

torch::optim::SGDOptions sgd_options() {
  return torch::optim::SGDOptions(kLr).momentum(kMomentum);
}

SmallCnn cuda_net() {
  SmallCnn net;
  net->to(torch::kCUDA);
  return net;
}

// One way of running a training step; each builds its own model from the same seed.
class Mode {
 public:
  virtual ~Mode() = default;
  virtual void step(const at::Tensor& images, const at::Tensor& labels) = 0;
  // Empty when the mode ran as intended; otherwise why its times mean something else.
  virtual std::string check() const { return {}; }
};

// What a LibTorch user writes first: zero_grad (to None), forward, loss, backward, step.
class EagerLoop : public Mode {
 public:
  EagerLoop() : optimizer_(net_->parameters(), sgd_options()) {}

  void step(const at::Tensor& images, const at::Tensor& labels) override {
    optimizer_.zero_grad();
    at::Tensor loss = F::cross_entropy(net_->forward(images), labels);
    loss.backward();
    optimizer_.step();
  }

 private:
  SmallCnn net_ = cuda_net();
  torch::optim::SGD optimizer_;
};

// Makes `waiting` wait for the work queued so far on `done`, without blocking the host.
void wait_for(const c10::cuda::CUDAStream& waiting, const c10::cuda::CUDAStream& done) {
  c10::Event event(c10::DeviceType::CUDA);
  event.record(done);
  event.block(waiting);
}

// What a competent LibTorch user writes by hand: PyTorch's whole-network capture recipe.
// Warm-up steps on a side stream create the gradients and the momentum buffers (LibTorch's
// SGD is capturable once they exist) and let cuDNN autotune outside the capture; then
// zero_grad (in place, so the gradients keep their addresses), forward, loss, backward and
// step are captured once on static inputs. Each step copies the batch in and replays. The
// learning rate is baked into the graph: fine at a fixed one.
class HandGraph : public Mode {
 public:
  explicit HandGraph(const Data& data)
      : optimizer_(net_->parameters(), sgd_options()),
        static_images_(data.images[0].clone()),
        static_labels_(data.labels[0].clone()) {
    const c10::cuda::CUDAStream main = c10::cuda::getCurrentCUDAStream();
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    wait_for(side, main);
    {
      const c10::cuda::CUDAStreamGuard on_side(side);
      for (int64_t i = 0; i < kGraphWarmup; ++i) {
        run(data.images[i % kBatches], data.labels[i % kBatches]);
      }
      torch::cuda::synchronize();
      graph_.capture_begin();
      static_loss_ = run(static_images_, static_labels_);
      graph_.capture_end();
    }
    wait_for(main, side);
  }

  void step(const at::Tensor& images, const at::Tensor& labels) override {
    static_images_.copy_(images, /*non_blocking=*/true);
    static_labels_.copy_(labels, /*non_blocking=*/true);
    graph_.replay();
  }

 private:
  at::Tensor run(const at::Tensor& images, const at::Tensor& labels) {
    optimizer_.zero_grad(/*set_to_none=*/false);
    at::Tensor loss = F::cross_entropy(net_->forward(images), labels);
    loss.backward();
    optimizer_.step();
    return loss.detach();
  }

  SmallCnn net_ = cuda_net();
  torch::optim::SGD optimizer_;
  at::Tensor static_images_, static_labels_, static_loss_;
  at::cuda::CUDAGraph graph_;
};

// nimble_train::Step with its defaults, the loss a mean.
class NimbleStep : public Mode {
 public:
  NimbleStep()
      : optimizer_(net_->parameters(), sgd_options()),
        step_(net_, optimizer_, [net = net_](const nimble_train::Batch& b) mutable {
          return F::cross_entropy(net->forward(b[0]), b[1]);
        }) {}

  void step(const at::Tensor& images, const at::Tensor& labels) override {
    step_(nimble_train::Batch{images, labels});
  }

  std::string check() const override {
    const nimble_train::StepStats stats = step_.stats();
    if (stats.phase == nimble_train::Phase::kReplay && stats.captures == 1) {
      return {};
    }
    return std::string("nimble_train::Step did not replay one graph: phase ") +
           nimble_train::phase_name(stats.phase) + ", captures " +
           std::to_string(stats.captures) + ", update " + stats.update;
  }

 private:
  SmallCnn net_ = cuda_net();
  torch::optim::SGD optimizer_;
  nimble_train::Step step_;
};

std::unique_ptr<Mode> make_mode(std::string_view name, const Data& data) {
  if (name == "eager") {
    return std::make_unique<EagerLoop>();
  }
  if (name == "graph") {
    return std::make_unique<HandGraph>(data);
  }
  if (name == "step") {
    return std::make_unique<NimbleStep>();
  }
  throw std::invalid_argument("mode must be eager, graph or step; got '" + std::string(name) +
                              "'");
}

// Median over `repeats` of the mean time of `timed` consecutive steps, after `warm` untimed
// ones. Events on the current stream bracket the whole run, so the time includes the host's
// launch overhead wherever the GPU waits for it: the cost the modes differ in.
double median_ms(Mode& mode, const Data& data, int64_t warm, int64_t timed, int64_t repeats) {
  int64_t i = 0;
  auto next = [&] {
    mode.step(data.images[i % kBatches], data.labels[i % kBatches]);
    ++i;
  };
  for (int64_t w = 0; w < warm; ++w) {
    next();
  }
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  std::vector<double> samples;
  for (int64_t r = 0; r < repeats; ++r) {
    c10::Event start(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    c10::Event end(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    start.record(stream);
    for (int64_t t = 0; t < timed; ++t) {
      next();
    }
    end.record(stream);
    end.synchronize();
    samples.push_back(start.elapsedTime(end) / static_cast<double>(timed));
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

std::string& last_error() {
  static std::string error;
  return error;
}

}  // namespace

// Milliseconds per step of `mode` ("eager", "graph" or "step") at `batch`: the median over
// `repeats` of the mean of `timed_steps` consecutive steps, after `warm_steps` untimed ones
// (for "step" enough to reach its replays: warm-up 3, capture 1). Negative on failure, with
// the reason in nt_bench_last_error().
NT_BENCH_API double nt_bench_ms_per_step(const char* mode, int batch, int warm_steps,
                                         int timed_steps, int repeats) {
  try {
    if (batch < 1 || warm_steps < 0 || timed_steps < 1 || repeats < 1) {
      throw std::invalid_argument(
          "batch, timed_steps and repeats must be at least 1 and warm_steps at least 0; got " +
          std::to_string(batch) + ", " + std::to_string(timed_steps) + ", " +
          std::to_string(repeats) + ", " + std::to_string(warm_steps));
    }
    at::globalContext().setBenchmarkCuDNN(true);
    torch::manual_seed(0);
    const Data data(batch);
    std::unique_ptr<Mode> runner = make_mode(mode, data);
    const double ms = median_ms(*runner, data, warm_steps, timed_steps, repeats);
    const std::string problem = runner->check();
    if (!problem.empty()) {
      throw std::runtime_error(problem);
    }
    return ms;
  } catch (const c10::Error& e) {
    last_error() = e.what_without_backtrace();
  } catch (const std::exception& e) {
    last_error() = e.what();
  }
  return -1.0;
}

// Why the last nt_bench_ms_per_step failed; valid until the next call.
NT_BENCH_API const char* nt_bench_last_error() { return last_error().c_str(); }
