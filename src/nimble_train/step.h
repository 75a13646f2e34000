// nimble_train::Step: a LibTorch training step captured once as a CUDA graph and replayed.
//
//   #include <nimble_train/step.h>
//
//   Net net;                                           // a torch::nn module, on the GPU
//   torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-3));
//   nimble_train::Step step(net, optimizer, [&](const nimble_train::Batch& b) {
//     return torch::nn::functional::cross_entropy(net->forward(b[0]), b[1]);
//   });
//   for (auto& batch : loader) {
//     at::Tensor loss = step({batch.data, batch.target});  // one graph launch, no host sync
//   }
//
// The same lifecycle and semantics as Python's nt.Step (python/nimble_train/step.py), on the
// same runtime (src/capture's StepGraph, src/optim's fused step):
//  - The first batch fixes the batch layout (shapes, dtypes, devices of its tensors).
//  - Warm-up: the first `warmup` calls are ordinary eager training steps, on the capture's
//    side stream; host synchronisations in them are recorded (CUDA's sync debug mode). The
//    first runs the optimizer as it is (it shows which parameters get gradients); from the
//    second on the update is the fused one: parameters, gradients and optimizer state move
//    into flat buffers and every hyper-parameter is read on the device.
//  - Capture: the next call is captured as one CUDA graph (forward, loss, backward, clipping,
//    fused update) in a private memory pool, then launched. Later calls copy the batch into the
//    graph's static inputs and launch it: no host sync, no allocation.
//  - A capture that fails raises SyncError (CUDA invalidated it and warm-up saw host syncs) or
//    CaptureError; the model and optimizer are as after the last completed step and later
//    calls run eagerly.
//  - Learning rates and every other hyper-parameter read from optimizer.param_groups() at each
//    call (param_groups()[i].options().set_lr(...), a scheduler) reach the graph without a
//    new capture. The optimizer's state stays its own: state() holds views of the flat
//    buffers and the step counts advance on the host too, so torch::save(optimizer, ...) and
//    torch::load keep working (a load between calls is copied into the flat buffers).
//  - The model's tensors changed between calls: values changed in place are what the graph
//    reads; a parameter's or buffer's data replaced (p.set_data(t), torch::load(module, ...))
//    is copied where the graph reads it, or refused when it no longer fits there (another
//    shape, dtype or device). A torch::nn module's buffer member assigned anew
//    (bn->running_mean = t) is copied where the graph reads it in the same way. A child module
//    replaced, added or removed, a torch::nn module's parameter member assigned anew
//    (fc->weight = t: the optimizer updates the one the graph reads) and a module switched to
//    another training mode are refused. A module of one's own: its tensor members are its own
//    code's, and only its children are seen; change their values in place, and have its
//    forward update them in place too (avg_.mul_(0.9).add_(m, 0.1)): a forward that assigns a
//    member anew (avg_ = 0.9 * avg_ + ...) leaves the graph reading the tensor it was captured
//    with on every replay.
//  - Host numbers that forward_loss or a forward reads (a label smoothing the lambda captures
//    by reference, a module's options) are baked into the graph when it is captured, as in any
//    CUDA graph, and C++ gives no way to see them change: keep a value that changes during
//    training in a tensor (updated in place), or build a new Step for it.
//  - A batch with fewer samples than the first: padded and masked in the graph when
//    `forward_loss` returns one loss per sample and no layer sees the whole batch (BatchNorm);
//    otherwise it runs eagerly, or raises ShapeError (PartialBatch).
//  - accumulate = K: calls 1..K-1 of each window run the forward and backward into the
//    accumulated gradients, call K also clips and updates (stepped()); the next window's first
//    call zeroes them. Each kind of call (first, middle, last) is a graph of its own over the
//    same static inputs, captured the first time a full batch meets it, in the one pool. With
//    full micro-batches the gradients are the plain loop's `(loss / K).backward()`; with
//    per-sample losses and a short micro-batch the update equals one step on all the window's
//    samples together (each micro-batch weighted by its samples, the update's gradient factor
//    correcting for the window's); a scalar loss is weighted 1 / K. step(batch, true) ends a
//    window early (an epoch's end); CallOptions().set_loss_weight(w) gives a call's loss weight
//    itself (staged, as the weights are). Warm-up ends, and the fused update starts, at a
//    window's end. A call that fails inside a window puts the window's gradients back.
//  - ema = decay: after each update (in the graph too) an average of the weights moves towards
//    them, avg.lerp_(p, 1 - decay), for every trained parameter (in flat buffers of the fused
//    update's layout once it is fused: one lerp_ per buffer) and every floating-point buffer
//    (BatchNorm's running statistics, as timm's ModelEmaV2); integer buffers are the model's
//    own. ema_weights() swaps the averages in for a scope; ema_state_dict() saves them.
//  - evaluator(fn): an evaluation step (validation), captured into the step's pool once the
//    step replays and replayed for each full batch (see Step::evaluator).
//
// Optimizers: torch::optim::SGD, Adam and AdamW are fused. Others run eagerly with
// capture(false); capturing them raises an error that says so (LibTorch's optimizers keep
// step counts on the host and would bake them into a graph).
//
// Streams: one. Planning several (as Python's streams="auto" does for a traced forward) needs
// an operator graph of the forward, which Python gets from torch.fx and C++ does not have; a
// LibTorch program could hand one over as a TorchScript module or an exported program.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/data/example.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace nimble_train {

// Every error a Step raises on purpose derives from Error; each message says what was
// expected, what was seen and how to fix it.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// Capturing failed because the step synchronises with the host (.item(), .cpu(), a
// data-dependent shape). The model and optimizer are as after the last completed step.
class SyncError : public Error {
 public:
  using Error::Error;
};
// Capturing failed for another reason; the model and optimizer are as after the last step.
class CaptureError : public Error {
 public:
  using Error::Error;
};
// A batch that does not fit the first batch's layout (or a short batch under kError).
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A batch: the tensors forward_loss reads; dimension 0 of each is the batch unless its
// length differs from the first tensor's (a leaf without a batch dimension).
using Batch = std::vector<at::Tensor>;
// The forward and the loss: a scalar, or one loss per sample ([batch size], averaged by the
// Step, which makes padding exact).
using ForwardLoss = std::function<at::Tensor(const Batch&)>;

enum class PartialBatch {
  kPad,    // pad and mask in the graph (per-sample losses, no batch statistics); else eager
  kEager,  // run a short batch eagerly
  kError,  // raise ShapeError
};

enum class Amp { kNone, kBF16 };

struct StepOptions {
  int64_t warmup = 3;                      // eager steps before capture (at least 1)
  Amp amp = Amp::kNone;                    // kBF16: autocast to bfloat16 in forward_loss
  std::optional<double> grad_clip;         // max global gradient norm, on the device
  PartialBatch partial_batch = PartialBatch::kPad;
  bool capture = true;                     // false: every step eager (debugging, the CPU)
  int64_t accumulate = 1;                  // micro-batches (calls) per optimizer update
  std::optional<double> ema;               // decay in (0, 1): an average of the weights

  StepOptions& set_warmup(int64_t v) { warmup = v; return *this; }
  StepOptions& set_amp(Amp v) { amp = v; return *this; }
  StepOptions& set_grad_clip(double v) { grad_clip = v; return *this; }
  StepOptions& set_partial_batch(PartialBatch v) { partial_batch = v; return *this; }
  StepOptions& set_capture(bool v) { capture = v; return *this; }
  StepOptions& set_accumulate(int64_t v) { accumulate = v; return *this; }
  StepOptions& set_ema(double decay) { ema = decay; return *this; }
};

// What a loop says of one call (step(batch, CallOptions().set_update(true))), as Python's
// step(batch, update=..., loss_weight=...). Both are staged with the call: no new capture.
struct CallOptions {
  // With accumulate: true ends the window with this call (its update runs over the window's
  // micro-batches so far: an epoch ending mid-window).
  bool update = false;
  // With accumulate: this micro-batch's loss is multiplied by it instead of the Step's
  // weighting (a loop that normalises by the window's token count). Give it on every call of
  // a window: the update's correction for the window's samples is decided at its last call,
  // and a weight given there means none. Without accumulation only 1 is accepted (scale the
  // loss in forward_loss instead).
  std::optional<double> loss_weight;

  CallOptions& set_update(bool v) { update = v; return *this; }
  CallOptions& set_loss_weight(double v) { loss_weight = v; return *this; }
};

enum class Phase { kTemplate, kWarmup, kCapture, kReplay, kEager, kClosed };
const char* phase_name(Phase phase);

struct StepStats {
  Phase phase = Phase::kTemplate;
  int64_t calls = 0;         // completed calls
  int64_t eager_steps = 0;   // of which eager (warm-up, short batches, after a failed capture)
  int64_t replays = 0;       // of which graph launches (the capturing call included)
  int64_t captures = 0;      // graphs captured
  int64_t updates = 0;       // optimizer updates applied (every call; with accumulate, every
                             // accumulate-th)
  int64_t graph_nodes = -1;  // nodes of the captured graph (-1 before capture)
  int64_t host_syncs_in_warmup = 0;
  std::string update;        // "fused", or "eager" (the optimizer as it is)
  std::string capture_error; // why the capture failed (phase kEager after one), else empty
};

// An evaluation of the model (see Step::evaluator): its outputs for `batch` (logits, a loss
// summed over the batch, a count of correct predictions), as tensors.
using EvalFn = std::function<std::vector<at::Tensor>(const Batch&)>;

struct EvaluatorStats {
  int64_t replays = 0;        // calls answered by a graph launch (the capturing call included)
  int64_t eager = 0;          // calls run eagerly (before the step replays, short batches, the
                              // CPU, after a failed capture)
  int64_t captures = 0;       // 0 or 1
  std::string capture_error;  // why capturing fn failed (it then runs eagerly), else empty
};

class Step;

// An evaluation step of a Step's model, made by Step::evaluator(fn). Copies share one state.
class Evaluator {
 public:
  Evaluator() = default;  // empty until assigned one from Step::evaluator (calls raise)

  // fn(batch) with the model in eval mode (each module's own mode back after), autograd off
  // and the Step's amp; returns its tensors, fresh (not overwritten by a later call).
  std::vector<at::Tensor> operator()(const Batch& batch);
  EvaluatorStats stats() const;

  struct State;  // the Step's and the evaluator's (step.cpp)

 private:
  friend class Step;
  explicit Evaluator(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class Step {
 public:
  Step(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
       ForwardLoss forward_loss, StepOptions options = {});
  template <typename Impl>
  Step(const torch::nn::ModuleHolder<Impl>& module, torch::optim::Optimizer& optimizer,
       ForwardLoss forward_loss, StepOptions options = {})
      : Step(module.ptr(), optimizer, std::move(forward_loss), std::move(options)) {}
  ~Step();
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  Step(Step&&) noexcept;
  Step& operator=(Step&&) noexcept;

  // One training step on `batch`; returns the loss as a 0-dim float32 tensor on the device
  // without a host sync. After capture it is the graphs' output buffer, overwritten by the
  // next call (not by its evaluators'): clone() it to keep it.
  at::Tensor operator()(const Batch& batch);
  // With accumulate: `update` true ends the window with this call (its update runs, over the
  // window's micro-batches so far: an epoch ending mid-window); false as operator()(batch).
  // Without accumulation every call updates.
  at::Tensor operator()(const Batch& batch, bool update);
  // With what the loop says of this call (see CallOptions).
  at::Tensor operator()(const Batch& batch, const CallOptions& call);
  // A torch::data example: the batch {data, target}. (A template, so that step({x, y}) is
  // always a Batch.)
  template <typename Data = at::Tensor, typename Target = at::Tensor>
  at::Tensor operator()(const torch::data::Example<Data, Target>& example) {
    return (*this)(Batch{example.data, example.target});
  }
  template <typename Data = at::Tensor, typename Target = at::Tensor>
  at::Tensor operator()(const torch::data::Example<Data, Target>& example,
                        const CallOptions& call) {
    return (*this)(Batch{example.data, example.target}, call);
  }

  // The global gradient norm before clipping of the last call (0-dim, on the device), with
  // grad_clip; std::nullopt without it or before the first fused step.
  std::optional<at::Tensor> grad_norm() const;
  // Whether the last call applied the optimizer update (with accumulate, every accumulate-th
  // call does): step a learning-rate scheduler then.
  bool stepped() const;
  StepStats stats() const;
  // Frees the graph and its pool; the model and optimizer stay usable (they keep their flat
  // buffers). Later calls raise.
  void close();

  // With StepOptions::ema: the averages in the model's parameters and floating-point buffers
  // for the guard's lifetime (evaluate or save the averaged model), the trained values put
  // back when it ends; the step refuses to train meanwhile.
  class EmaWeights {
   public:
    EmaWeights(EmaWeights&& other) noexcept;
    EmaWeights& operator=(EmaWeights&&) = delete;
    EmaWeights(const EmaWeights&) = delete;
    EmaWeights& operator=(const EmaWeights&) = delete;
    ~EmaWeights();

   private:
    friend class Step;
    explicit EmaWeights(Step* step) : step_(step) {}
    Step* step_;
  };
  [[nodiscard]] EmaWeights ema_weights();
  // The module's named parameters and buffers (as named_parameters() and named_buffers()
  // name them), the averages in place of what is averaged: copies, for torch::save.
  torch::OrderedDict<std::string, at::Tensor> ema_state_dict() const;
  // Restores the averages from ema_state_dict()'s format; checked whole first (names and
  // shapes), so a state that does not fit changes nothing.
  void load_ema_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state);

  // An evaluation step of the model (validation every epoch), as Python's step.evaluator(fn):
  // fn(batch) runs with the model in eval mode, autograd off and the step's amp. The first
  // batch fixes its layout; once the step replays its training graphs (its parameters keep
  // their addresses from then on) and fn has run once on a full batch, fn is captured into
  // the step's private pool (no second pool) and each later full batch is a copy-in and one
  // replay, reading the weights where training writes them (inside ema_weights(): the
  // averages). Shorter batches, the calls before, the CPU and a step without capture run
  // eagerly. A capture that fails (a host sync in fn) warns, and fn runs eagerly from then on
  // (stats().capture_error says why). A call under another at::autocast than the capture's
  // is refused. Host numbers fn reads are baked into its graph, as forward_loss's are. The
  // Step must outlive its evaluators' calls; after close() they raise.
  Evaluator evaluator(EvalFn fn);

  // Makes the next launch fail at `point` (1: after staging its values, 2: after copying the
  // batch in; an evaluator's, which stages nothing, after its copy-in at either) or the next
  // capture fail (3: inside the capture, an evaluator's too), for rollback tests.
  void inject_failure_for_testing(int point);

 private:
  friend class Evaluator;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nimble_train
