// nimble_train::Step for LibTorch programs (see nimble_train/step.h).
//
// The pieces are the runtime Python's Step drives too: StepGraph (the graph, its private pool,
// its static inputs and the staging ring every launch reads), and the fused step over flat
// buffers (optim/fused_step.h). What is LibTorch's own lives here: reading torch::optim's
// options into staged rows, and keeping torch::optim's state (views into the flat buffers,
// host step counts) valid for torch::save and torch::load.
#include "nimble_train/step.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "capture/kernel_settings.h"
#include "capture/static_inputs.h"
#include "capture/staging_ring.h"
#include "common/check.h"
#include "nimble_train/build_config.h"
#include "optim/device_tables.h"
#include "optim/fused_step.h"
#include "optim/fused_update.h"
#include "step/module_watch.h"

#if NT_HAVE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "capture/step_graph.h"
#endif

namespace nimble_train {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kTemplate: return "template";
    case Phase::kWarmup: return "warm-up";
    case Phase::kCapture: return "capture";
    case Phase::kReplay: return "replay";
    case Phase::kEager: return "eager";
    case Phase::kClosed: return "closed";
  }
  return "unknown";
}

namespace {

using capture::BatchMismatch;
using capture::LeafSpec;
using capture::StaticInputs;
using capture::tuple_text;

// ------------------------------------------------------------------ torch::optim, fused

enum class Kind { kSgd, kAdam, kAdamW, kOther };

Kind kind_of(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return Kind::kSgd;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return Kind::kAdam;
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return Kind::kAdamW;
  return Kind::kOther;
}

// The staged columns of one param group (optim/device_tables.h), from its options now.
void staged_row(Kind kind, const torch::optim::OptimizerOptions& options, float* row) {
  using namespace optim;
  std::fill(row, row + kNumStagedHyper, 0.0f);
  if (kind == Kind::kSgd) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    row[kLr] = float(o.lr());
    row[kWeightDecay] = float(o.weight_decay());
    row[kMomentum] = float(o.momentum());
    row[kDampening] = float(o.dampening());
    row[kNesterov] = o.nesterov() ? 1.0f : 0.0f;
    return;
  }
  double lr, weight_decay, eps;
  std::tuple<double, double> betas;
  if (kind == Kind::kAdam) {
    const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
    lr = o.lr(), weight_decay = o.weight_decay(), eps = o.eps(), betas = o.betas();
  } else {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(options);
    lr = o.lr(), weight_decay = o.weight_decay(), eps = o.eps(), betas = o.betas();
    row[kDecoupledDecay] = 1.0f;
  }
  row[kLr] = float(lr);
  row[kWeightDecay] = float(weight_decay);
  row[kBeta1] = float(std::get<0>(betas));
  row[kBeta2] = float(std::get<1>(betas));
  row[kEps] = float(eps);
}

bool amsgrad_of(Kind kind, const torch::optim::OptimizerOptions& options) {
  if (kind == Kind::kAdam) return static_cast<const torch::optim::AdamOptions&>(options).amsgrad();
  if (kind == Kind::kAdamW) {
    return static_cast<const torch::optim::AdamWOptions&>(options).amsgrad();
  }
  return false;
}

bool momentum_on(Kind kind, const torch::optim::OptimizerOptions& options) {
  return kind == Kind::kSgd &&
         static_cast<const torch::optim::SGDOptions&>(options).momentum() != 0;
}

// The state tensors of one parameter, by the fused update's order (SGD: momentum_buffer;
// Adam/AdamW: exp_avg, exp_avg_sq, max_exp_avg_sq), and its host step count.
struct ParamStateRef {
  torch::optim::OptimizerParamState* state = nullptr;
  Kind kind = Kind::kOther;

  at::Tensor get(size_t k) const {
    switch (kind) {
      case Kind::kSgd: return static_cast<torch::optim::SGDParamState*>(state)->momentum_buffer();
      case Kind::kAdam: {
        auto* s = static_cast<torch::optim::AdamParamState*>(state);
        return k == 0 ? s->exp_avg() : k == 1 ? s->exp_avg_sq() : s->max_exp_avg_sq();
      }
      case Kind::kAdamW: {
        auto* s = static_cast<torch::optim::AdamWParamState*>(state);
        return k == 0 ? s->exp_avg() : k == 1 ? s->exp_avg_sq() : s->max_exp_avg_sq();
      }
      case Kind::kOther: break;
    }
    return at::Tensor();
  }
  void set(size_t k, const at::Tensor& t) const {
    switch (kind) {
      case Kind::kSgd:
        static_cast<torch::optim::SGDParamState*>(state)->momentum_buffer(t);
        return;
      case Kind::kAdam: {
        auto* s = static_cast<torch::optim::AdamParamState*>(state);
        k == 0 ? (void)s->exp_avg(t) : k == 1 ? (void)s->exp_avg_sq(t) : (void)s->max_exp_avg_sq(t);
        return;
      }
      case Kind::kAdamW: {
        auto* s = static_cast<torch::optim::AdamWParamState*>(state);
        k == 0 ? (void)s->exp_avg(t) : k == 1 ? (void)s->exp_avg_sq(t) : (void)s->max_exp_avg_sq(t);
        return;
      }
      case Kind::kOther: return;
    }
  }
  int64_t step() const {
    if (kind == Kind::kAdam) return static_cast<torch::optim::AdamParamState*>(state)->step();
    if (kind == Kind::kAdamW) return static_cast<torch::optim::AdamWParamState*>(state)->step();
    return 0;
  }
  void set_step(int64_t step) const {
    if (kind == Kind::kAdam) static_cast<torch::optim::AdamParamState*>(state)->step(step);
    if (kind == Kind::kAdamW) static_cast<torch::optim::AdamWParamState*>(state)->step(step);
  }
};

std::unique_ptr<torch::optim::OptimizerParamState> new_state(Kind kind) {
  switch (kind) {
    case Kind::kSgd: return std::make_unique<torch::optim::SGDParamState>();
    case Kind::kAdam: return std::make_unique<torch::optim::AdamParamState>();
    case Kind::kAdamW: return std::make_unique<torch::optim::AdamWParamState>();
    case Kind::kOther: break;
  }
  return nullptr;
}

// ------------------------------------------------------------------ amp and sync recording

// Autocast to bfloat16 on `device`'s type for the guard's lifetime, cache off (a cache would
// keep casts made while capturing alive across replays).
class AutocastGuard {
 public:
  AutocastGuard(bool on, at::DeviceType device) : on_(on), device_(device) {
    if (!on_) return;
    enabled_ = at::autocast::is_autocast_enabled(device_);
    dtype_ = at::autocast::get_autocast_dtype(device_);
    cache_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, at::kBFloat16);
    at::autocast::set_autocast_cache_enabled(false);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_, enabled_);
    at::autocast::set_autocast_dtype(device_, dtype_);
    at::autocast::set_autocast_cache_enabled(cache_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool on_;
  at::DeviceType device_;
  bool enabled_ = false;
  at::ScalarType dtype_ = at::kBFloat16;
  bool cache_ = true;
};

// The autocast a call is made under on `device`'s type: its dtype, or nullopt when off.
std::optional<at::ScalarType> ambient_autocast(at::DeviceType device) {
  if (!at::autocast::is_autocast_enabled(device)) return std::nullopt;
  return at::autocast::get_autocast_dtype(device);
}

std::string autocast_text(std::optional<at::ScalarType> dtype) {
  return dtype ? std::string("under autocast to ") + c10::toString(*dtype) : "without autocast";
}

constexpr const char* kSyncMessage = "synchronizing CUDA operation";

// Counts the host syncs CUDA's sync debug mode reports (in "warn" mode) while active; other
// warnings pass through to the handler that was there before.
class SyncRecorder : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    if (warning.msg().find(kSyncMessage) == std::string::npos) {
      if (previous_ != nullptr) previous_->process(warning);
      return;
    }
    ++count;
  }
  int64_t count = 0;

  class Active {
   public:
    Active(SyncRecorder& recorder, bool on) : on_(on) {
#if NT_HAVE_CUDA
      if (!on_) return;
      recorder.previous_ = c10::WarningUtils::get_warning_handler();
      c10::WarningUtils::set_warning_handler(&recorder);
      mode_ = c10::cuda::warning_state().get_sync_debug_mode();
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
      previous_ = recorder.previous_;
#else
      (void)recorder;
#endif
    }
    ~Active() {
#if NT_HAVE_CUDA
      if (!on_) return;
      c10::cuda::warning_state().set_sync_debug_mode(mode_);
      c10::WarningUtils::set_warning_handler(previous_);
#endif
    }
    Active(const Active&) = delete;
    Active& operator=(const Active&) = delete;

   private:
    bool on_;
#if NT_HAVE_CUDA
    c10::cuda::SyncDebugMode mode_ = c10::cuda::SyncDebugMode::L_DISABLED;
    c10::WarningHandler* previous_ = nullptr;
#endif
  };

 private:
  c10::WarningHandler* previous_ = nullptr;
};

bool has_batch_statistics(const torch::nn::Module& module) {
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (!m->is_training()) continue;
    const std::string& name = m->name();
    if (name.find("BatchNorm") != std::string::npos) return true;
    if (name.find("InstanceNorm") != std::string::npos && m->named_buffers(false).size() > 0) {
      return true;  // track_running_stats keeps running_mean and running_var buffers
    }
  }
  return false;
}

#if NT_HAVE_CUDA
// While alive, work goes to `side`, which first waits for the current stream's work; at the
// end (an exception included) the current stream waits for the side stream's.
class SideStream {
 public:
  SideStream(c10::cuda::CUDAStream side, c10::DeviceIndex device)
      : current_(c10::cuda::getCurrentCUDAStream(device)), side_(side) {
    c10::Event before(at::kCUDA);
    before.record(current_);
    before.block(side_);
    guard_.emplace(side_);
  }
  ~SideStream() {
    guard_.reset();
    c10::Event after(at::kCUDA);
    after.record(side_);
    after.block(current_);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

 private:
  c10::cuda::CUDAStream current_;
  c10::cuda::CUDAStream side_;
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
};
#endif

enum class Fault { kNone, kAfterStaging = 1, kAfterCopyIn = 2, kInCapture = 3 };

}  // namespace

// ------------------------------------------------------------------ Step::Impl

// An evaluator's state, shared by its copies; the Step's Impl points each back at itself
// until it is destroyed.
struct Evaluator::State {
  Step::Impl* impl = nullptr;
  EvalFn fn;
  int64_t batch_size = 0;                // the first batch's: a shorter one runs eagerly
  std::vector<LeafSpec> specs;           // the first batch's layout
  // What checks each call against it: its graph's entry in the step's StepGraph (whose static
  // inputs the capture reads), or without a graph (the CPU, no capture, before the step's
  // first call) inputs of its own.
  int64_t entry = -1;
  std::unique_ptr<StaticInputs> layout;
  bool met = false;                      // fn ran eagerly on a full batch (the capture follows)
  std::vector<at::Tensor> outputs;       // the graph's outputs, overwritten by each replay
  std::optional<at::ScalarType> autocast;  // the at::autocast its graph was captured under
  EvaluatorStats stats;
};

class Step::Impl {
 public:
  Impl(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
       ForwardLoss forward_loss, StepOptions options);
  ~Impl() {
    for (const auto& weak : evaluators_) {
      if (auto state = weak.lock()) state->impl = nullptr;
    }
    try {
      release();
    } catch (const std::exception&) {  // a destructor must not throw; close() reports
    }
  }

  // The evaluators (see step.h).
  Evaluator make_evaluator(EvalFn fn);
  std::vector<at::Tensor> evaluate(Evaluator::State& state, const Batch& batch);

  at::Tensor call(const Batch& batch, const CallOptions& call);
  std::optional<at::Tensor> grad_norm() const {
    if (!grad_norm_.defined()) return std::nullopt;
    return grad_norm_;
  }
  StepStats stats() const;
  bool stepped() const { return stepped_; }
  void close() {
    release();
    own_grads();
    watch_.reset();  // its aliases kept the storage the graph read alive
    phase_ = Phase::kClosed;
  }
  void inject(int point);

  // The EMA (see step.h).
  void ema_swap(bool in);
  torch::OrderedDict<std::string, at::Tensor> ema_state_dict() const;
  void load_ema_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state);

 private:
  // fn with the model in eval mode (each module's own mode back after), autograd off, the
  // step's amp; its tensors checked.
  std::vector<at::Tensor> run_eval(const EvalFn& fn, const Batch& batch);
  // Captures the evaluator's fn into the step's pool; false (with a warning, and the cause in
  // its stats) when that failed, and the model as it was.
  bool capture_eval(Evaluator::State& state);
  void ema_init();
  void ema_use_flat();  // after fuse(): the parameters' averages into flat buffers
  void ema_update();    // after each update: device work only (captured in the graph)
  // The average standing for `t` (a parameter or buffer of the module), or undefined.
  at::Tensor ema_average_of(const at::Tensor& t) const;
  void require_ema(const char* what) const;
  // The phases (as Python's Step).
  void make_template(const Batch& batch);
  int64_t check_batch(const Batch& batch) const;
  // A call's place in its accumulation window: whether it starts it (the gradients are
  // zeroed first), whether it ends it (the update runs), and the factor the update multiplies
  // the window's gradients by (per-sample losses: the micro-batches' weights made exact for
  // the window's samples), and the loss weight the caller gave (CallOptions::loss_weight).
  // Without accumulation every call is both.
  struct Window {
    bool first = true;
    bool update = true;
    double correction = 1.0;
    std::optional<double> loss_weight;
    // Its graph: entries_[kind()].
    static int kind_of(bool first, bool update) { return int(first) + 2 * int(update); }
    int kind() const { return kind_of(first, update); }
  };
  Window window_of(int64_t samples, const CallOptions& call) const;
  // The update's gradient factor for a window ending with a call of `samples`: its
  // micro-batches' weights made exact for the window's samples (per-sample losses), else 1
  // (1 too when the call gives its loss weight itself).
  double correction_of(int64_t samples, const Window& window) const;
  // The call's loss weight with accumulation: the caller's, else samples / (accumulate *
  // batch) for per-sample losses, 1 / accumulate for a scalar. Known once the first forward
  // showed which the loss is.
  double weight_of(int64_t samples, const Window& window) const;
  void advance(const Window& window, int64_t samples);
  at::Tensor eager_step(const Batch& batch, int64_t samples, const Window& window, bool warmup);
  at::Tensor eager_body(const Batch& batch, int64_t samples, const Window& window, bool record);
  // The fused update of an eager step, its values staged where the graph's would be.
  void fused_eager_update(int64_t samples, const Window& window, double correction);
  at::Tensor capture_and_launch(const Batch& batch, const Window& window);
#if NT_HAVE_CUDA
  // Captures `body` as `entry`'s graph on the side stream, once the device's queued work is
  // done (as torch.cuda.graph does); an injected in-capture fault fails it after `body`. A
  // failure to begin throws; any exception of `body` abandons the capture, which is then
  // failed, its error the first line of why. `what` names the code for an exception that is
  // not a std::exception.
  capture::CaptureResult capture_on_side(int64_t entry, bool staged,
                                         const std::function<void()>& body, const char* what);
#endif
  at::Tensor launch(const Batch& batch, int64_t samples, const Window& window);
  bool can_pad() const {
    return options_.partial_batch == PartialBatch::kPad && per_sample_ == 1 &&
           !has_batch_statistics(*module_);
  }

  // The loss of one forward: per-sample losses averaged (rows at or past `valid` masked).
  at::Tensor loss_of(const Batch& batch, int64_t batch_size, const at::Tensor& valid);
  // What the backward of an eager micro-batch's loss runs on: with accumulation the loss
  // times weight_of(), without it the loss itself.
  at::Tensor weighted(const at::Tensor& loss, int64_t samples, const Window& window) const;
  // The same in a graph: the loss times the weight staged with each launch (weight_of()'s).
  at::Tensor weighted_in_graph(const at::Tensor& loss) const;
  // torch::optim's step() after an accumulation window: the gradients times the correction.
  void correct_unfused(double correction);
  at::Tensor forward(const Batch& batch);
  void clip_unfused();

  // The fused update.
  void fuse();
  // The first of the optimizer's parameters for which `pred` holds, named for a message (its
  // module's name for it and its place in param_groups()); empty when none.
  std::string first_param_where(const std::function<bool(const at::Tensor&)>& pred) const;
  // The first parameter whose gradient is sparse (an Embedding built with sparse(true)), named
  // for an error; empty when none. The flat buffers hold dense gradients only.
  std::string sparse_grad_name() const;
  std::string sparse_grad_refusal(const std::string& name) const;
  // The first parameter left out of the fused update (no gradient in the first step) that has
  // one now, named; empty when none.
  std::string late_grad_name() const;
  // From here on torch::optim's step() runs every step, eagerly: a parameter the fused update
  // left out got a gradient (`name`), which the update must not drop.
  void unfuse(const std::string& name);
  void check_structure() const;
  void fix_trainable();  // from here on, which parameters train is fixed
  // ... and a parameter frozen or unfrozen since is refused; from capture on, a parameter's or
  // a buffer's data replaced since (`p.set_data(t)`; torch::load(module, ...), which sets each
  // tensor's storage) goes back where the graph reads it, values kept.
  void check_params();
  void check_kernel_settings() const;
  void check_autocast() const;
  void check_call(const CallOptions& call) const;
  // The optimizer's parameters, then the module's others, then its buffers (a BatchNorm's
  // running statistics): every tensor of the model the graph reads.
  std::vector<at::Tensor> watched_tensors() const;
  std::string param_name(int64_t i) const;  // the watch's i-th tensor, for an error
  std::vector<float> staged_values(double correction, double weight) const;
  void bind_state();       // optimizer.state() -> flat buffers, then views of them
  void keep_state_bound(); // a torch::load since the last call: bind again
  void after_update();     // host step counts, as torch::optim's step() would advance them
  at::Tensor fused_update();
  void release();
  // The gradients leave the flat buffers: torch::optim's zero_grad() detaches each gradient in
  // place, which a view refuses. Parameters and state stay views (nothing detaches those).
  void own_grads();

  std::shared_ptr<torch::nn::Module> module_;
  torch::optim::Optimizer& optimizer_;
  ForwardLoss forward_loss_;
  StepOptions options_;
  Kind kind_;
  at::Device device_{at::kCPU};
  bool will_capture_ = false;
  Phase phase_ = Phase::kTemplate;
  int64_t calls_ = 0, eager_steps_ = 0, replays_ = 0, captures_ = 0;
  int per_sample_ = -1;  // does forward_loss return one loss per sample? -1: not seen yet
  Fault fault_ = Fault::kNone;
  SyncRecorder syncs_;

  // The optimizer's structure when the Step was built.
  std::vector<size_t> group_sizes_;
  std::vector<std::vector<at::Tensor>> group_params_;  // each group's tensors (identity)
  std::vector<bool> momentum_on_;
  bool amsgrad_ = false;
  int64_t num_values_ = 0;  // the optimizer's staged values per launch (hyper-parameters)
  // Staged values per launch after the sample count: num_values_, then with accumulation the
  // window's gradient correction (read by the update as its gradient factor) and the call's
  // loss weight (read by the backward).
  int64_t num_staged_ = 0;

  // Gradient accumulation: the place of the next call in its window, the samples of the
  // window's calls so far, the updates applied, and whether the last call applied one.
  int64_t micro_ = 0, window_samples_ = 0, updates_ = 0;
  bool stepped_ = false;

  // The template and where staged values go.
  int64_t batch_size_ = 0;
  std::vector<LeafSpec> specs_;
  std::unique_ptr<StaticInputs> template_;   // the check (no graph: CPU, capture off)
  std::unique_ptr<capture::StagingRing> ring_;  // no graph: eager fused steps stage here
  at::Tensor current_;                       // [1 + num_values]: sample count, then values
#if NT_HAVE_CUDA
  std::unique_ptr<capture::StepGraph> graph_;
  std::optional<c10::cuda::CUDAStream> side_;
#endif
  // The graphs, one per kind of call (Window::kind(): without accumulation only 3, first and
  // update; with it 1 first, 0 middle, 2 last, 3 a window of one call), over the same static
  // inputs; -1 where none.
  std::array<int64_t, 4> entries_{-1, -1, -1, -1};
  // The graphs' loss output, allocated outside their pool; each graph copies its loss into
  // it. A graph's own tensors may take memory another graph (captured before it) freed, which
  // that graph's replays overwrite: an evaluator's replay would change a loss held from the
  // step's last call. The optimizer's tables (the grad norm) are outside the pool too.
  at::Tensor graph_loss_;
  int64_t entry_ = -1;  // the graph launched last
  std::string capture_error_;
  // torch's settings that chose the graph's kernels (TF32, cuDNN, attention backends, ...),
  // read when it was captured: a replay under others is refused (check_kernel_settings).
  uint64_t kernel_settings_ = 0;
  // The autocast around the call that captured it (at::autocast's, outside the step's own
  // amp): a replay runs its precision, so a call under another is refused (check_autocast).
  std::optional<at::ScalarType> autocast_;

  // Which parameters required gradients when the flat buffers (or the graph) fixed what the
  // step trains, and from capture on the storage the graph reads.
  std::optional<optim::ParamWatch> watch_;
  // The modules, their training modes and torch::nn's tensor members as the graph is captured
  // (a module replaced or switched to eval() since is refused; a buffer assigned anew is
  // copied back where the graph reads it).
  std::optional<ModuleWatch> modules_;

  // The fused update.
  bool fused_ = false;
  // torch::optim's step() runs every step (no capture): a gradient was sparse, or a parameter
  // left out of the fused update got one.
  bool optim_steps_ = false;
  std::vector<at::Tensor> left_out_;  // trained parameters the first step gave no gradient
  std::vector<optim::FlatTensors> flats_;
  std::vector<optim::UpdateTarget> targets_;
  at::Tensor partials_;
  optim::StepTables tables_;
  std::vector<torch::optim::OptimizerParamState*> bound_;  // per fused parameter
  at::Tensor grad_norm_;

  // The EMA (options_.ema): an average per trained parameter and per floating-point buffer;
  // once fused, the parameters' averages are views of flat buffers laid out as the flat
  // parameter buffers (ema_flat_: (flat parameters, flat averages)), and the others loose.
  std::vector<at::Tensor> ema_params_, ema_averages_, ema_buffers_, ema_buffer_averages_;
  std::vector<std::pair<at::Tensor, at::Tensor>> ema_flat_;
  std::vector<size_t> ema_loose_;      // the parameters averaged one by one
  std::vector<at::Tensor> ema_saved_;  // inside ema_weights(): the trained values

  std::vector<std::weak_ptr<Evaluator::State>> evaluators_;
};

Step::Impl::Impl(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
                 ForwardLoss forward_loss, StepOptions options)
    : module_(std::move(module)),
      optimizer_(optimizer),
      forward_loss_(std::move(forward_loss)),
      options_(std::move(options)),
      kind_(kind_of(optimizer)) {
  if (!module_) throw Error("nimble_train::Step: the module is null; pass the model to train");
  if (!forward_loss_) {
    throw Error("nimble_train::Step: forward_loss is empty; pass a callable that runs the "
                "model on a batch and returns the loss");
  }
  if (options_.warmup < 1) {
    throw Error("nimble_train::Step: warmup must be at least 1 (eager steps before capture); "
                "got " + std::to_string(options_.warmup));
  }
  if (options_.accumulate < 1) {
    throw Error("nimble_train::Step: accumulate must be at least 1 (micro-batches per optimizer "
                "update); got " + std::to_string(options_.accumulate));
  }
  if (options_.ema.has_value() && !(*options_.ema > 0.0 && *options_.ema < 1.0)) {
    throw Error("nimble_train::Step: ema must be a decay strictly between 0 and 1 (0.999: each "
                "update moves the average 0.1% of the way to the weights); got " +
                std::to_string(*options_.ema));
  }
  if (options_.grad_clip.has_value() &&
      !(*options_.grad_clip > 0 && std::isfinite(*options_.grad_clip))) {
    throw Error("nimble_train::Step: grad_clip must be a positive finite number; got " +
                std::to_string(*options_.grad_clip) + ". Leave it unset for no clipping.");
  }
  bool any = false;
  for (auto& group : optimizer_.param_groups()) {
    group_sizes_.push_back(group.params().size());
    group_params_.push_back(group.params());
    for (const at::Tensor& p : group.params()) {
      if (!any) device_ = p.device();
      any = true;
      if (p.device() != device_) {
        throw Error("nimble_train::Step: the optimizer's parameters must be on one device; "
                    "found " + device_.str() + " and " + p.device().str() +
                    ". Move the model with module->to(device) before building the optimizer.");
      }
    }
  }
  if (!any) throw Error("nimble_train::Step: the optimizer has no parameters");
  if (kind_ != Kind::kOther) {
    for (auto& group : optimizer_.param_groups()) {
      momentum_on_.push_back(momentum_on(kind_, group.options()));
    }
    amsgrad_ = amsgrad_of(kind_, optimizer_.param_groups()[0].options());
    num_values_ = int64_t(group_sizes_.size()) * optim::kNumStagedHyper;
    num_staged_ = num_values_ + (options_.accumulate > 1 ? 2 : 0);
  }
  will_capture_ = options_.capture && device_.is_cuda();
  if (options_.ema.has_value()) ema_init();
#if !NT_HAVE_CUDA
  if (will_capture_) {
    throw Error("nimble_train::Step: this build of nimble_train has no CUDA (" +
                std::string("see nimble_train/build_config.h") +
                "); set_capture(false) runs the step eagerly");
  }
#endif
  if (will_capture_ && kind_ == Kind::kOther) {
    throw Error("nimble_train::Step captures torch::optim::SGD, Adam and AdamW (fused, every "
                "hyper-parameter read on the device); this optimizer is none of them, and "
                "LibTorch's optimizers keep their step counts on the host, which a CUDA graph "
                "would bake in. Use SGD, Adam or AdamW, or StepOptions().set_capture(false) to "
                "run it eagerly.");
  }
}

void Step::Impl::inject(int point) {
  if (point < 1 || point > 3) {
    throw Error("inject_failure_for_testing: point must be 1, 2 or 3; got " +
                std::to_string(point));
  }
  fault_ = static_cast<Fault>(point);
}

// ------------------------------------------------------------------ the template

namespace {

// The layout a first batch fixes: its batch size and each tensor's spec. `who` starts each
// error ("nimble_train::Step", "nimble_train::Evaluator").
std::pair<int64_t, std::vector<LeafSpec>> layout_of(const Batch& batch, at::Device device,
                                                    const std::string& who) {
  if (batch.empty() || !batch[0].defined() || batch[0].dim() == 0) {
    throw ShapeError(who + ": a batch is a non-empty vector of tensors whose first has the "
                     "batch as dimension 0; got " +
                     (batch.empty() ? std::string("an empty vector")
                                    : "a first tensor of shape " +
                                          (batch[0].defined() ? tuple_text(batch[0].sizes())
                                                              : std::string("(undefined)"))));
  }
  const int64_t size = batch[0].size(0);
  if (size == 0) {
    throw ShapeError(who + ": the first batch is empty (0 samples along dimension 0); the "
                     "first batch fixes the shapes and must be a full one. Skip empty batches.");
  }
  std::vector<LeafSpec> specs;
  for (size_t i = 0; i < batch.size(); ++i) {
    const at::Tensor& t = batch[i];
    const std::string path = "batch[" + std::to_string(i) + "]";
    if (!t.defined()) throw ShapeError(who + ": " + path + " is an undefined tensor");
    if (t.device() != device) {
      throw ShapeError(who + ": " + path + " is on " + t.device().str() + " and the model on " +
                       device.str() + "; move the batch to " + device.str() +
                       " (once, before the loop, for data that fits)");
    }
    LeafSpec spec;
    spec.path = path;
    spec.sizes = t.sizes().vec();
    spec.strides = t.is_non_overlapping_and_dense() ? t.strides().vec()
                                                     : t.contiguous().strides().vec();
    spec.dtype = t.scalar_type();
    spec.device = t.device();
    spec.batched = t.dim() >= 1 && t.size(0) == size;
    specs.push_back(std::move(spec));
  }
  return {size, std::move(specs)};
}

}  // namespace

void Step::Impl::make_template(const Batch& batch) {
  auto [size, specs] = layout_of(batch, device_, "nimble_train::Step");
  batch_size_ = size;
  specs_ = specs;
#if NT_HAVE_CUDA
  if (will_capture_) {
    const int64_t index = device_.has_index() ? device_.index() : c10::cuda::current_device();
    graph_ = std::make_unique<capture::StepGraph>(at::Device(at::kCUDA, index), num_staged_);
    const int64_t base = graph_->add_entry(specs_);
    if (options_.accumulate == 1) {
      entries_[Window::kind_of(true, true)] = base;
    } else {
      entries_[Window::kind_of(true, false)] = base;
      entries_[Window::kind_of(false, true)] = graph_->add_entry_sharing_inputs(base);
      if (options_.accumulate > 2) {
        entries_[Window::kind_of(false, false)] = graph_->add_entry_sharing_inputs(base);
      }
      // A window of one call (ended at its first: step(batch, true)), captured if one comes.
      entries_[Window::kind_of(true, true)] = graph_->add_entry_sharing_inputs(base);
    }
    entry_ = base;
    current_ = graph_->current();
    side_ = c10::cuda::getStreamFromPool(false, index);
    return;
  }
#endif
  template_ = std::make_unique<StaticInputs>(specs_);
  if (kind_ != Kind::kOther) {
    ring_ = std::make_unique<capture::StagingRing>(1 + num_staged_, device_, 16);
    current_ = ring_->current();
  }
}

int64_t Step::Impl::check_batch(const Batch& batch) const {
  try {
#if NT_HAVE_CUDA
    if (graph_) return graph_->check(entry_, batch);
#endif
    return template_->check(batch);
  } catch (const BatchMismatch& e) {
    throw ShapeError(std::string("nimble_train::Step: ") + e.what());
  }
}

// ------------------------------------------------------------------ forward and loss

at::Tensor Step::Impl::forward(const Batch& batch) {
  const AutocastGuard autocast(options_.amp == Amp::kBF16, device_.type());
  return forward_loss_(batch);
}

at::Tensor Step::Impl::loss_of(const Batch& batch, int64_t batch_size, const at::Tensor& valid) {
  at::Tensor losses = forward(batch);
  if (!losses.defined()) {
    throw Error("nimble_train::Step: forward_loss returned an undefined tensor");
  }
  int kind;
  if (losses.dim() == 0) {
    kind = 0;
  } else if (losses.dim() == 1 && losses.size(0) == batch_size) {
    kind = 1;
  } else {
    throw Error("nimble_train::Step: forward_loss must return a scalar or one loss per sample "
                "(shape [" + std::to_string(batch_size) + "]); got shape " +
                tuple_text(losses.sizes()) + ". Reduce it yourself, or return per-sample "
                "losses (reduction kNone).");
  }
  if (per_sample_ < 0) per_sample_ = kind;
  if (kind == 0) return losses;
  losses = losses.to(at::kFloat);
  if (!valid.defined()) return losses.mean();
  const at::Tensor keep =
      at::arange(batch_size, at::TensorOptions().device(losses.device()).dtype(at::kFloat)) < valid;
  // where, not a product: a padded row's loss may be inf or NaN, and 0 * NaN is NaN.
  return at::where(keep, losses, at::zeros({}, losses.options())).sum() / valid;
}

at::Tensor Step::Impl::weighted(const at::Tensor& loss, int64_t samples,
                                const Window& window) const {
  if (options_.accumulate == 1) return loss;
  return loss.to(at::kFloat) * weight_of(samples, window);
}

at::Tensor Step::Impl::weighted_in_graph(const at::Tensor& loss) const {
  if (options_.accumulate == 1) return loss;
  return loss.to(at::kFloat) * current_.select(0, 2 + num_values_);
}

void Step::Impl::correct_unfused(double correction) {
  if (correction == 1.0) return;
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer_.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  const c10::AutoGradMode no_grad(false);
  if (!grads.empty()) at::_foreach_mul_(grads, correction);
}

// clip_grad_norm_ without its host sync (LibTorch's returns a double): the total norm stays a
// device tensor, as the fused update's does.
void Step::Impl::clip_unfused() {
  if (!options_.grad_clip.has_value()) return;
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer_.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  if (grads.empty()) return;
  const c10::AutoGradMode no_grad(false);
  std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2);
  const at::Tensor total = at::stack(norms).to(at::kFloat).norm();
  const at::Tensor coef = (*options_.grad_clip / (total + 1e-6)).clamp_max(1.0);
  at::_foreach_mul_(grads, coef);
  grad_norm_ = total;
}

// ------------------------------------------------------------------ the fused update

void Step::Impl::check_structure() const {
  auto& groups = optimizer_.param_groups();
  std::vector<size_t> sizes;
  for (auto& group : groups) sizes.push_back(group.params().size());
  const std::string fix =
      ". The flat buffers and the graph hold the old parameters: add every group and tensor "
      "before building the Step, or build a new Step. Nothing was run for this call.";
  if (sizes != group_sizes_) {
    throw Error("nimble_train::Step: the optimizer's param groups changed after the Step was "
                "built (" + std::to_string(group_sizes_.size()) + " groups before, " +
                std::to_string(sizes.size()) + " now, or their sizes)" + fix);
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<at::Tensor>& now = groups[g].params();
    for (size_t i = 0; i < now.size(); ++i) {
      const at::Tensor& was = group_params_[g][i];
      if (now[i].is_same(was)) continue;
      throw Error("nimble_train::Step: param_groups()[" + std::to_string(g) + "].params()[" +
                  std::to_string(i) + "] is another tensor than the one it held when the Step "
                  "was built (" + (now[i].defined() ? tuple_text(now[i].sizes()) : "undefined") +
                  ", was " + tuple_text(was.sizes()) + "): the step would go on updating the "
                  "old one" + fix);
    }
  }
  if (kind_ == Kind::kOther) return;  // torch::optim's step() runs it, whatever its options
  for (size_t g = 0; g < groups.size(); ++g) {
    if (momentum_on(kind_, groups[g].options()) != momentum_on_[g]) {
      throw Error("nimble_train::Step: param_groups()[" + std::to_string(g) + "]'s momentum "
                  "changed between zero and non-zero; that creates or drops momentum buffers. "
                  "Build a new Step. Nothing was run for this call.");
    }
    if (amsgrad_of(kind_, groups[g].options()) != amsgrad_) {
      throw Error("nimble_train::Step: param_groups()[" + std::to_string(g) + "]'s amsgrad "
                  "changed; it decides which state buffers exist. Build a new Step. Nothing "
                  "was run for this call.");
    }
  }
}

std::vector<at::Tensor> Step::Impl::watched_tensors() const {
  std::vector<at::Tensor> params;
  for (auto& group : optimizer_.param_groups()) {
    for (const at::Tensor& p : group.params()) params.push_back(p);
  }
  const size_t trained = params.size();
  for (const at::Tensor& p : module_->parameters()) {  // frozen ones the forward reads
    const auto end = params.begin() + int64_t(trained);
    if (std::none_of(params.begin(), end, [&](const at::Tensor& q) { return q.is_same(p); })) {
      params.push_back(p);
    }
  }
  for (const at::Tensor& b : module_->buffers()) {
    if (b.defined()) params.push_back(b);
  }
  return params;
}

void Step::Impl::fix_trainable() {
  if (watch_.has_value()) return;
  int64_t trained = 0;
  for (const size_t n : group_sizes_) trained += int64_t(n);
  watch_.emplace(watched_tensors(), trained);
}

std::string Step::Impl::param_name(int64_t i) const {
  const at::Tensor p = watched_tensors().at(size_t(i));
  std::string name;
  for (const auto& named : module_->named_parameters()) {
    if (named.value().is_same(p)) name = "the module's " + named.key();
  }
  for (const auto& named : module_->named_buffers()) {
    if (named.value().is_same(p)) name = "the module's buffer " + named.key();
  }
  if (i >= watch_->trained()) return name;
  size_t g = 0;
  while (g < group_sizes_.size() && i >= int64_t(group_sizes_[g])) i -= int64_t(group_sizes_[g++]);
  const std::string place =
      "param_groups()[" + std::to_string(g) + "].params()[" + std::to_string(i) + "]";
  return name.empty() ? place : name + " (" + place + ")";
}

void Step::Impl::check_params() {
  if (!watch_.has_value() || !watch_->changed()) return;
  const int64_t changed = watch_->first_flag_changed();
  if (changed >= 0) {
    const bool was = watch_->was_trainable(changed);
    throw Error("nimble_train::Step: the requires_grad of " + param_name(changed) +
                " changed from " + (was ? "true to false" : "false to true") +
                " after warm-up fixed which parameters the step trains; the step would " +
                (was ? "go on updating it" : "never compute its gradient or update it") +
                ". Freeze or unfreeze parameters before the Step's first call, or build a new "
                "Step for the new set (close() this one; the optimizer's state carries over). "
                "Nothing was run for this call.");
  }
  for (const int64_t i : watch_->moved()) {
    std::string why = watch_->why_not_restorable(i);
    const int64_t j = why.empty() ? -1 : watch_->shares_memory_with(i);
    if (j >= 0) {
      why = "its data now shares memory with " + param_name(j) +
            "'s, a tie the graph (captured with them apart) cannot keep";
    }
    if (!why.empty()) {
      throw Error("nimble_train::Step: the data of " + param_name(i) + " was replaced after "
                  "capture, and " + why + ". Change a parameter's or buffer's values in place "
                  "(torch::NoGradGuard, p.copy_(t)), or build a new Step for the new model "
                  "(close() this one). Nothing was run for this call.");
    }
  }
  watch_->restore();
}

std::vector<float> Step::Impl::staged_values(double correction, double weight) const {
  std::vector<float> values(size_t(num_staged_), 0.0f);
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    staged_row(kind_, groups[g].options(), values.data() + g * optim::kNumStagedHyper);
  }
  if (num_staged_ > num_values_) {
    values[size_t(num_values_)] = float(correction);
    values[size_t(num_values_) + 1] = float(weight);
  }
  return values;
}

std::string Step::Impl::first_param_where(
    const std::function<bool(const at::Tensor&)>& pred) const {
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!pred(params[i])) continue;
      const std::string place =
          "param_groups()[" + std::to_string(g) + "].params()[" + std::to_string(i) + "]";
      for (const auto& named : module_->named_parameters()) {
        if (named.value().is_same(params[i])) {
          return "the module's " + named.key() + " (" + place + ")";
        }
      }
      return place;
    }
  }
  return "";
}

std::string Step::Impl::sparse_grad_name() const {
  return first_param_where([](const at::Tensor& p) {
    return p.grad().defined() && p.grad().layout() != at::kStrided;
  });
}

std::string Step::Impl::late_grad_name() const {
  if (std::none_of(left_out_.begin(), left_out_.end(),
                   [](const at::Tensor& p) { return p.grad().defined(); })) {
    return "";  // the common case: a name is looked up only when one is due
  }
  return first_param_where([this](const at::Tensor& p) {
    return p.grad().defined() &&
           std::any_of(left_out_.begin(), left_out_.end(),
                       [&](const at::Tensor& q) { return q.is_same(p); });
  });
}

void Step::Impl::unfuse(const std::string& name) {
  own_grads();  // torch::optim's zero_grad() detaches gradients in place, which a view refuses
  fused_ = false;
  optim_steps_ = true;
  const std::string why =
      name + " got a gradient at call " + std::to_string(calls_ + 1) + ", and none in the "
      "first step, so the fused update had left it out (as torch::optim's step() skips a "
      "parameter without a gradient). From here on torch::optim's step() runs every step, "
      "eagerly, and trains it";
  if (will_capture_) {
    TORCH_WARN("nimble_train::Step: ", why, ", without a CUDA graph (the graph's update holds "
               "the parameters the first step gave gradients). For the graph, give every "
               "trained parameter a gradient in the first step, or freeze the others "
               "(requires_grad false) before building the Step.");
    capture_error_ = why;
  }
  will_capture_ = false;
  if (phase_ != Phase::kClosed) phase_ = Phase::kEager;
}

std::string Step::Impl::sparse_grad_refusal(const std::string& name) const {
  return "nimble_train::Step: " + name + " gets a sparse gradient (an Embedding or "
         "EmbeddingBag built with sparse(true)), and a captured step keeps every gradient dense: "
         "in the fused update's flat buffers, and in a graph, whose tensors cannot change size "
         "with the batch's indices. Build the layer with sparse(false), or "
         "StepOptions().set_capture(false), whose steps give the sparse gradient to "
         "torch::optim's step(). Nothing was run for this call; the steps before it trained as "
         "torch::optim does.";
}

void Step::Impl::fuse() {
  const std::string sparse = sparse_grad_name();  // warmup == 1: the first step showed it
  if (!sparse.empty()) throw Error(sparse_grad_refusal(sparse));
  // Parameters that got no gradient in the first step are left out, as torch::optim skips
  // them: no update, no state.
  std::vector<std::pair<int64_t, at::Tensor>> params;
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const at::Tensor& p : groups[g].params()) {
      if (!p.requires_grad()) continue;
      if (p.grad().defined()) {
        params.emplace_back(int64_t(g), p);
      } else {
        left_out_.push_back(p);
      }
    }
  }
  fix_trainable();
  if (params.empty()) {
    throw Error("nimble_train::Step: no parameter got a gradient in the first step; check that "
                "forward_loss uses the model and returns a loss that depends on it");
  }
  int64_t num_state = 0;
  if (kind_ == Kind::kSgd) {
    num_state = std::any_of(momentum_on_.begin(), momentum_on_.end(), [](bool b) { return b; });
  } else {
    num_state = amsgrad_ ? 3 : 2;
  }
  flats_ = optim::build_flat_buffers(params, num_state, device_, 1, optim::kDefaultChunkElems,
                                     false);
  targets_.clear();
  for (const optim::FlatTensors& flat : flats_) targets_.push_back(optim::target_of(flat));
  partials_ = optim::assign_partials(targets_, device_);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  std::vector<int64_t> param_group(params.size());
  for (size_t i = 0; i < params.size(); ++i) param_group[i] = params[i].first;
  tables_.staged = current_.narrow(0, 1, num_values_);
  tables_.hyper = at::zeros({int64_t(groups.size()), optim::kHyperColumns}, f32);
  tables_.param_steps = at::zeros({int64_t(params.size())}, f32);
  tables_.param_group = at::tensor(param_group, at::kLong).to(device_);
  tables_.control = at::zeros({optim::kControlSize}, f32);
  fused_ = true;
  bind_state();
  ema_use_flat();
  // Fused after warm-up, before any graph (a capture's call, or a window's eager first call on
  // a short batch): the watch fixed the storage at warm-up's end and follows the data into the
  // flat buffers, where the graphs read it. Left at the old storage it would count every
  // parameter as given new data and move it back there on each call, off what the graphs train.
  if (phase_ == Phase::kCapture) watch_->fix_storage();
}

void Step::Impl::bind_state() {
  auto& state = optimizer_.state();
  const size_t groups = optimizer_.param_groups().size();
  std::vector<std::set<int64_t>> group_steps(groups);
  bound_.clear();
  const c10::AutoGradMode no_grad(false);
  for (optim::FlatTensors& flat : flats_) {
    for (size_t i = 0; i < flat.params.size(); ++i) {
      const int64_t g = flat.groups[i];
      void* key = flat.params[i].unsafeGetTensorImpl();
      if (kind_ == Kind::kSgd && !momentum_on_[size_t(g)]) {
        bound_.push_back(nullptr);
        continue;  // torch keeps no state for SGD without momentum
      }
      auto it = state.find(key);
      const bool existed = it != state.end();
      if (!existed) it = state.emplace(key, new_state(kind_)).first;
      const ParamStateRef ref{it->second.get(), kind_};
      if (kind_ == Kind::kSgd) {
        group_steps[size_t(g)].insert(existed && ref.get(0).defined() ? 1 : 0);
      } else {
        group_steps[size_t(g)].insert(ref.step());
      }
      for (size_t k = 0; k < flat.state.size(); ++k) {
        at::Tensor view = flat.segment(flat.state[k], int64_t(i));
        const at::Tensor old = ref.get(k);
        if (!old.defined()) {
          view.zero_();
        } else if (old.const_data_ptr() != view.const_data_ptr()) {
          view.copy_(old);
        }
        ref.set(k, view);
      }
      bound_.push_back(it->second.get());
    }
  }
  std::vector<float> steps(groups, 0.0f);
  for (size_t g = 0; g < groups; ++g) {
    if (group_steps[g].size() > 1) {
      throw Error("nimble_train::Step: the parameters of param_groups()[" + std::to_string(g) +
                  "] have different step counts in the optimizer's state; the fused update "
                  "keeps one step count per group. Put parameters with different histories in "
                  "different groups.");
    }
    if (!group_steps[g].empty()) steps[g] = float(*group_steps[g].begin());
  }
  const at::Tensor host = at::tensor(steps, at::kFloat);
  tables_.hyper.select(1, optim::kStep).copy_(host.to(device_));
  tables_.param_steps.copy_(host.to(device_).index_select(0, tables_.param_group));
}

void Step::Impl::keep_state_bound() {
  auto& state = optimizer_.state();
  size_t index = 0;
  for (const optim::FlatTensors& flat : flats_) {
    const char* base =
        flat.state.empty() ? nullptr : static_cast<const char*>(flat.state[0].const_data_ptr());
    const int64_t element_size = flat.param.element_size();
    for (size_t i = 0; i < flat.params.size(); ++i, ++index) {
      if (bound_[index] == nullptr) continue;
      auto it = state.find(flat.params[i].unsafeGetTensorImpl());
      if (it == state.end() || it->second.get() != bound_[index]) {
        bind_state();  // a torch::load replaced the state: copy it in
        return;
      }
      const at::Tensor first = ParamStateRef{bound_[index], kind_}.get(0);
      if (!first.defined() || first.const_data_ptr() != base + flat.offsets[i] * element_size) {
        bind_state();  // a torch::load (or a hand edit) replaced the state: copy it in
        return;
      }
    }
  }
}

void Step::Impl::after_update() {
  if (kind_ == Kind::kSgd) return;  // torch::optim::SGD keeps no step count
  for (torch::optim::OptimizerParamState* s : bound_) {
    if (s != nullptr) {
      const ParamStateRef ref{s, kind_};
      ref.set_step(ref.step() + 1);
    }
  }
}

at::Tensor Step::Impl::fused_update() {
  optim::FusedStepArgs args;
  args.max_grad_norm = options_.grad_clip.value_or(0.0);
  if (num_staged_ > num_values_) args.grad_scale = current_.narrow(0, 1 + num_values_, 1);
  at::Tensor norm = optim::fused_step(kind_ == Kind::kSgd ? optim::Algorithm::kSgd
                                                          : optim::Algorithm::kAdam,
                                      targets_, tables_, partials_, args);
  if (norm.defined()) grad_norm_ = norm;
  return norm;
}

// ------------------------------------------------------------------ the steps

void Step::Impl::fused_eager_update(int64_t samples, const Window& window, double correction) {
  const std::vector<float> values = staged_values(correction, weight_of(samples, window));
  std::vector<float> slot;
#if NT_HAVE_CUDA
  if (graph_) {
    graph_->stage_eager(samples, values);
  } else
#endif
  {
    slot.reserve(values.size() + 1);
    slot.push_back(float(samples));
    slot.insert(slot.end(), values.begin(), values.end());
    ring_->stage(slot);
    try {
      ring_->fetch();
    } catch (...) {
      ring_->unstage();
      throw;
    }
    ring_->launched();
  }
  fused_update();
  after_update();
  ema_update();
}

Step::Impl::Window Step::Impl::window_of(int64_t samples, const CallOptions& call) const {
  Window window;
  const int64_t k = options_.accumulate;
  if (k == 1) return window;
  window.first = micro_ == 0;
  window.update = micro_ + 1 == k || call.update;
  window.loss_weight = call.loss_weight;
  if (window.update) window.correction = correction_of(samples, window);
  return window;
}

double Step::Impl::correction_of(int64_t samples, const Window& window) const {
  if (options_.accumulate == 1 || per_sample_ != 1 || window.loss_weight.has_value()) return 1.0;
  return double(options_.accumulate * batch_size_) / double(window_samples_ + samples);
}

double Step::Impl::weight_of(int64_t samples, const Window& window) const {
  const int64_t k = options_.accumulate;
  if (k == 1) return 1.0;
  if (window.loss_weight.has_value()) return *window.loss_weight;
  if (per_sample_ != 1) return 1.0 / double(k);
  return double(samples) / double(k * batch_size_);
}

void Step::Impl::advance(const Window& window, int64_t samples) {
  stepped_ = window.update;
  if (window.update) {
    micro_ = 0;
    window_samples_ = 0;
    ++updates_;
  } else {
    ++micro_;
    window_samples_ += samples;
  }
}

at::Tensor Step::Impl::eager_step(const Batch& batch, int64_t samples, const Window& window,
                                  bool warmup) {
  const bool record = warmup && device_.is_cuda();
#if NT_HAVE_CUDA
  // Warm-up runs on the capture's side stream (per-stream workspaces then exist before the
  // capture, outside its pool), ordered after the current stream's work and before its later
  // work, however the step ends.
  std::optional<SideStream> on_side;
  if (warmup && side_.has_value()) on_side.emplace(*side_, device_.index());
#endif
  // The first step runs the optimizer as it is (it shows which parameters get gradients); the
  // update is fused from the next window on, unless a gradient is sparse: then, without a
  // capture, torch::optim's step() takes it every step.
  if (!fused_ && !optim_steps_ && kind_ != Kind::kOther && updates_ >= 1 && window.first) {
    const std::string sparse = sparse_grad_name();
    if (!sparse.empty() && will_capture_) throw Error(sparse_grad_refusal(sparse));
    optim_steps_ = !sparse.empty();
    if (!optim_steps_) fuse();
  }
  if (window.first) return eager_body(batch, samples, window, record);
  // Inside a window the gradients hold the window's micro-batches so far: a call that fails
  // puts them back (copied into them where they are still there: the flat buffers' views).
  std::vector<at::Tensor> kept;
  for (auto& group : optimizer_.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      kept.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    }
  }
  try {
    return eager_body(batch, samples, window, record);
  } catch (...) {
    size_t i = 0;
    for (auto& group : optimizer_.param_groups()) {
      for (at::Tensor p : group.params()) {
        const at::Tensor& was = kept[i++];
        if (was.defined() && p.grad().defined()) {
          p.mutable_grad().copy_(was);
        } else {
          p.mutable_grad() = was;
        }
      }
    }
    throw;
  }
}

at::Tensor Step::Impl::eager_body(const Batch& batch, int64_t samples, const Window& window,
                                  bool record) {
  at::Tensor loss;
  // After the forward: the first call is the one that shows whether the losses are per sample.
  const auto correction = [&] { return correction_of(samples, window); };
  if (fused_) {
    keep_state_bound();
    optim::reattach(flats_);
    if (window.first) optim::zero_grads(flats_);
    {
      const SyncRecorder::Active recording(syncs_, record);
      loss = loss_of(batch, samples, at::Tensor());
      weighted(loss, samples, window).backward();
    }
    const std::string late = late_grad_name();
    if (late.empty()) {
      if (window.update) fused_eager_update(samples, window, correction());
    } else {
      unfuse(late);  // this window's update too: torch::optim's step() over these gradients
      if (window.update) {
        correct_unfused(correction());
        clip_unfused();
        optimizer_.step();
        ema_update();
      }
    }
  } else {
    if (window.first) optimizer_.zero_grad(true);
    {
      const SyncRecorder::Active recording(syncs_, record);
      loss = loss_of(batch, samples, at::Tensor());
      weighted(loss, samples, window).backward();
    }
    if (window.update) {
      correct_unfused(correction());
      clip_unfused();
      optimizer_.step();
      ema_update();
    }
  }
  ++eager_steps_;
  return loss.detach().to(at::kFloat);
}

#if NT_HAVE_CUDA
capture::CaptureResult Step::Impl::capture_on_side(int64_t entry, bool staged,
                                                   const std::function<void()>& body,
                                                   const char* what) {
  c10::cuda::device_synchronize();  // no work queued from before
  const c10::cuda::CUDAStreamGuard on_side(*side_);
  graph_->begin_capture(entry, staged);
  capture::CaptureResult result;
  try {
    body();
    if (fault_ == Fault::kInCapture) {
      fault_ = Fault::kNone;
      throw std::runtime_error("injected failure inside the capture (a rollback test)");
    }
    result = graph_->end_capture();
  } catch (const std::exception& e) {
    result = graph_->abandon_capture();
    result.error = e.what();
  } catch (...) {  // never leave a capture open: every later allocation would join it
    result = graph_->abandon_capture();
    result.error = std::string(what) + " threw an exception that is not a std::exception";
  }
  result.error = result.error.substr(0, result.error.find('\n'));
  return result;
}
#endif

at::Tensor Step::Impl::capture_and_launch(const Batch& batch, const Window& window) {
#if NT_HAVE_CUDA
  // Not fused yet (warmup == 1, or accumulation: warm-up ended with the first window's update):
  // the first update showed which parameters get gradients. The data moves into the flat
  // buffers, which is where the graph reads it.
  if (!fused_) fuse();
  entry_ = entries_[size_t(window.kind())];
  keep_state_bound();
  optim::reattach(flats_);
  if (!graph_loss_.defined()) {
    graph_loss_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  }
  const std::vector<at::Tensor>& statics = graph_->inputs(entry_).buffers();
  const bool masked = per_sample_ == 1;
  std::string late;
  capture::CaptureResult result;
  try {
    result = capture_on_side(entry_, /*staged=*/true, [&] {
      if (window.first) optim::zero_grads(flats_);
      const at::Tensor valid = masked ? current_.select(0, 0) : at::Tensor();
      at::Tensor loss = loss_of(statics, batch_size_, valid);
      weighted_in_graph(loss).backward();
      late = late_grad_name();
      if (!late.empty()) throw std::runtime_error(late + " got a gradient it had not had");
      if (window.update) {
        fused_update();
        ema_update();
      }
      // A kernel, not copy_(): a copy of one dtype is a memcpy node, and a graph that is not
      // all kernels launches at microseconds of host time per node (capture/graph_nodes.h).
      at::mul_out(graph_loss_, loss.detach(), 1);
    }, "the step's code (forward_loss, the backward, a hook)");
  } catch (const std::exception& e) {  // it failed to begin
    throw CaptureError(std::string("nimble_train::Step: capturing the step as a CUDA graph "
                                   "failed to start: ") + e.what() +
                       ". The model and optimizer are as after the last completed step.");
  }
  if (!late.empty()) {
    // A parameter the fused update left out got a gradient in the captured forward: nothing
    // captured ran, so this step runs eagerly with torch::optim's step(), as every later one.
    for (at::Tensor& p : left_out_) p.mutable_grad().reset();
    unfuse(late);
    return eager_step(batch, batch_size_, window, false);
  }
  if (!result.ok) {
    capture_error_ = result.error;
    grad_norm_ = at::Tensor();
    phase_ = Phase::kEager;
    if (result.invalidated && syncs_.count > 0) {
      throw SyncError(
          "nimble_train::Step: capturing the step failed because it synchronises with the host; "
          "warm-up saw " + std::to_string(syncs_.count) + " host synchronisation(s) in "
          "forward_loss or the backward (CUDA's sync debug mode). Keep values on the device: "
          "no .item(), .cpu(), printing CUDA tensors or data-dependent shapes (nonzero, boolean "
          "indexing) inside the step; or set_capture(false). The model and optimizer are as "
          "after the last step; later calls run eagerly. Cause: " + result.error);
    }
    throw CaptureError(
        std::string("nimble_train::Step: capturing the step as a CUDA graph failed") +
        (result.invalidated ? " (CUDA invalidated the capture: a call it forbids while "
                              "capturing ran, such as a host synchronisation)" : "") +
        ": " + result.error + ". The model and optimizer are as after the last completed step; "
        "later calls run eagerly (set_capture(false) does that from the start).");
  }
  ++captures_;
  kernel_settings_ = capture::kernel_settings();
  autocast_ = ambient_autocast(device_.type());
  phase_ = Phase::kReplay;
  return launch(batch, batch_size_, window);
#else
  (void)batch;
  (void)window;
  throw Error("nimble_train::Step: this build has no CUDA");
#endif
}

at::Tensor Step::Impl::launch(const Batch& batch, int64_t samples, const Window& window) {
#if NT_HAVE_CUDA
  keep_state_bound();
  entry_ = entries_[size_t(window.kind())];
  const std::vector<float> values = staged_values(window.correction, weight_of(samples, window));
  if (fault_ == Fault::kAfterStaging) graph_->fail_next_launch(capture::LaunchFault::kAfterStaging);
  if (fault_ == Fault::kAfterCopyIn) graph_->fail_next_launch(capture::LaunchFault::kAfterCopyIn);
  if (fault_ != Fault::kInCapture) fault_ = Fault::kNone;
  graph_->launch(entry_, batch, values);
  if (window.update) after_update();
  ++replays_;
  return graph_loss_;
#else
  (void)batch;
  (void)samples;
  (void)window;
  throw Error("nimble_train::Step: this build has no CUDA");
#endif
}

void Step::Impl::check_kernel_settings() const {
  const uint64_t now = capture::kernel_settings();
  if (now == kernel_settings_) return;
  std::string changes;
  for (const std::string& change : capture::kernel_setting_changes(kernel_settings_, now)) {
    changes += (changes.empty() ? "" : "; ") + change;
  }
  throw Error("nimble_train::Step: torch's settings changed since the step's graph was "
              "captured (at::globalContext()'s, named as Python sets them): " + changes +
              ". A replay runs the kernels its capture chose, where an eager step would run "
              "others: the precision or algorithms asked for would not be met. Set them back "
              "before calling the step, set them before building it, or build a new Step under "
              "the new settings (close() this one). Nothing was run for this call.");
}

void Step::Impl::check_autocast() const {
  const std::optional<at::ScalarType> now = ambient_autocast(device_.type());
  if (now == autocast_) return;
  throw Error("nimble_train::Step: called " + autocast_text(now) + " (at::autocast), where the "
              "step's graph was captured " + autocast_text(autocast_) + "; a replay runs the "
              "precision it was captured with. Make every call under the same autocast (for "
              "mixed precision, StepOptions().set_amp(Amp::kBF16) applies autocast inside the "
              "step), or build a new Step (close() this one). Nothing was run for this call.");
}

void Step::Impl::check_call(const CallOptions& call) const {
  if (!call.loss_weight.has_value()) return;
  const double w = *call.loss_weight;
  if (!std::isfinite(w)) {
    throw Error("nimble_train::Step: CallOptions::loss_weight must be a finite number; got " +
                std::to_string(w) + ". Nothing was run for this call.");
  }
  if (options_.accumulate == 1 && w != 1.0) {
    throw Error("nimble_train::Step: CallOptions::loss_weight " + std::to_string(w) +
                " needs StepOptions::accumulate > 1 (the weight is staged with the "
                "accumulation's scales); scale the loss in forward_loss instead. Nothing was "
                "run for this call.");
  }
}

at::Tensor Step::Impl::call(const Batch& batch, const CallOptions& call) {
  if (phase_ == Phase::kClosed) {
    throw Error("nimble_train::Step: the step was closed; build a new Step to train further");
  }
  check_call(call);
  if (!ema_saved_.empty()) {
    throw Error("nimble_train::Step: called inside ema_weights(), while the model holds the "
                "averaged weights; training them would lose the trained ones. Call the step "
                "after the guard's scope. Nothing was run for this call.");
  }
  if (!c10::GradMode::is_enabled()) {
    throw Error("nimble_train::Step: called with autograd off (inside torch::NoGradGuard or "
                "c10::InferenceMode); a training step needs autograd for its backward, and a "
                "captured step would train all the same. Call the step outside that scope. "
                "Nothing was run for this call.");
  }
  if (phase_ == Phase::kTemplate) {
    make_template(batch);
    phase_ = will_capture_ ? Phase::kWarmup : Phase::kEager;
  }
  check_structure();
  if (phase_ == Phase::kCapture || phase_ == Phase::kReplay) modules_->check();
  if (phase_ == Phase::kReplay) {
    check_autocast();
    check_kernel_settings();
  }
  check_params();
  const int64_t samples = check_batch(batch);
  const bool short_batch = samples < batch_size_;
  if (short_batch && options_.partial_batch == PartialBatch::kError) {
    throw ShapeError("nimble_train::Step: a batch of " + std::to_string(samples) +
                     " samples, fewer than the first batch's " + std::to_string(batch_size_) +
                     ", with PartialBatch::kError. Drop short batches, or use kPad (padded and "
                     "masked in the graph) or kEager.");
  }
  const Window window = window_of(samples, call);
  at::Tensor loss;
  switch (phase_) {
    case Phase::kWarmup:
      loss = eager_step(batch, samples, window, /*warmup=*/true);
      // The capture comes at a window's first call, once warm-up has run its steps.
      if (phase_ == Phase::kWarmup && eager_steps_ >= options_.warmup && window.update) {
        fix_trainable();  // an optimizer captured as it is: from here on
        watch_->fix_storage();  // the graph reads the data where the warm-up left it
        modules_.emplace(module_);
        phase_ = Phase::kCapture;
      }
      break;
    case Phase::kCapture:
      if (short_batch) {  // the capture waits for a full batch
        loss = eager_step(batch, samples, window, false);
      } else {
        loss = capture_and_launch(batch, window);
      }
      break;
    case Phase::kReplay: {
#if NT_HAVE_CUDA
      // With accumulation each kind of call is captured the first time a full batch meets it.
      const bool captured = graph_->captured(entries_[size_t(window.kind())]);
#else
      const bool captured = false;
#endif
      if (short_batch && (!can_pad() || !captured)) {
        loss = eager_step(batch, samples, window, false);
      } else if (!captured) {
        loss = capture_and_launch(batch, window);
      } else {
        loss = launch(batch, samples, window);
      }
      break;
    }
    default:
      loss = eager_step(batch, samples, window, false);
      break;
  }
  advance(window, samples);
  ++calls_;
  return loss;
}

StepStats Step::Impl::stats() const {
  StepStats s;
  s.phase = phase_;
  s.calls = calls_;
  s.eager_steps = eager_steps_;
  s.replays = replays_;
  s.captures = captures_;
  s.updates = updates_;
  s.host_syncs_in_warmup = syncs_.count;
#if NT_HAVE_CUDA
  if (graph_ && entry_ >= 0 && graph_->num_entries() > 0) {
    s.graph_nodes = graph_->node_count(entry_);
  }
#endif
  s.update = fused_ ? "fused" : "eager";
  s.capture_error = capture_error_;
  return s;
}

void Step::Impl::own_grads() {
  const c10::AutoGradMode no_grad(false);
  for (optim::FlatTensors& flat : flats_) {
    for (at::Tensor& p : flat.params) {
      if (p.grad().defined()) p.mutable_grad() = p.grad().clone();
    }
  }
}

void Step::Impl::release() {
#if NT_HAVE_CUDA
  if (graph_) {
    for (const auto& weak : evaluators_) {
      if (auto state = weak.lock()) {
        state->outputs.clear();
        state->entry = -1;
      }
    }
    grad_norm_ = at::Tensor();
    graph_->release();  // waits for the device: no replay still writes the loss
    graph_.reset();
    graph_loss_ = at::Tensor();
  }
#endif
}

// ------------------------------------------------------------------ the evaluators

namespace {

// The module in eval mode for the guard's lifetime; every module's own mode back after (a
// child the user keeps in eval stays so).
class Evaluating {
 public:
  explicit Evaluating(torch::nn::Module& root) {
    for (const auto& m : root.modules(/*include_self=*/true)) {
      modes_.emplace_back(m, m->is_training());
    }
    root.eval();
  }
  ~Evaluating() {
    // modules() is in pre-order and train() is recursive: each module's own call comes last.
    for (const auto& [module, training] : modes_) module->train(training);
  }
  Evaluating(const Evaluating&) = delete;
  Evaluating& operator=(const Evaluating&) = delete;

 private:
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> modes_;
};

}  // namespace

Evaluator Step::Impl::make_evaluator(EvalFn fn) {
  if (!fn) {
    throw Error("nimble_train::Step::evaluator: fn is empty; pass a function of the batch that "
                "returns the model's outputs as tensors ([&](const Batch& b) { return "
                "std::vector<at::Tensor>{net->forward(b[0])}; })");
  }
  auto state = std::make_shared<Evaluator::State>();
  state->impl = this;
  state->fn = std::move(fn);
  evaluators_.erase(std::remove_if(evaluators_.begin(), evaluators_.end(),
                                   [](const auto& weak) { return weak.expired(); }),
                    evaluators_.end());
  evaluators_.push_back(state);
  return Evaluator(std::move(state));
}

std::vector<at::Tensor> Step::Impl::run_eval(const EvalFn& fn, const Batch& batch) {
  std::vector<at::Tensor> out;
  {
    const Evaluating evaluating(*module_);
    const c10::AutoGradMode no_grad(false);
    const AutocastGuard autocast(options_.amp == Amp::kBF16, device_.type());
    out = fn(batch);
  }
  if (out.empty()) {
    throw Error("nimble_train::Evaluator: fn returned no tensors; return the outputs to keep "
                "(logits, a loss summed over the batch, a count of correct predictions)");
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].defined()) {
      throw Error("nimble_train::Evaluator: fn's output " + std::to_string(i) +
                  " is an undefined tensor; return defined tensors only");
    }
  }
  return out;
}

std::vector<at::Tensor> Step::Impl::evaluate(Evaluator::State& state, const Batch& batch) {
  if (phase_ == Phase::kClosed) {
    throw Error("nimble_train::Evaluator: its step was closed; build a new Step and make a new "
                "evaluator from it (step.evaluator(fn))");
  }
  // What the graphs read is as the step holds it: the optimizer's parameters, the modules and
  // their members (modes aside: an evaluation sets its own), data replaced since capture.
  check_structure();
  const bool replaying = phase_ == Phase::kReplay;
  if (replaying) {
    check_kernel_settings();
    if (state.outputs.size() > 0 && ambient_autocast(device_.type()) != state.autocast) {
      throw Error("nimble_train::Evaluator: called " +
                  autocast_text(ambient_autocast(device_.type())) + " (at::autocast), where its "
                  "graph was captured " + autocast_text(state.autocast) + "; a replay runs the "
                  "precision it was captured with. Evaluate under the same autocast at every "
                  "call, or make another evaluator for the other (step.evaluator(fn)). Nothing "
                  "was run for this call.");
    }
    modules_->check(/*modes=*/false);
  }
  check_params();
  if (state.batch_size == 0) {
    auto [size, specs] = layout_of(batch, device_, "nimble_train::Evaluator");
    state.batch_size = size;
    state.specs = std::move(specs);
  }
  int64_t samples = 0;
  try {
#if NT_HAVE_CUDA
    if (graph_ && state.entry < 0) state.entry = graph_->add_entry(state.specs);
    if (graph_) {
      samples = graph_->check(state.entry, batch);
    } else
#endif
    {
      if (!state.layout) state.layout = std::make_unique<StaticInputs>(state.specs);
      samples = state.layout->check(batch);
    }
  } catch (const BatchMismatch& e) {
    throw ShapeError(std::string("nimble_train::Evaluator: ") + e.what());
  }
  const bool full = samples == state.batch_size;
#if NT_HAVE_CUDA
  // A graph once the step replays and fn ran eagerly on a full batch (cuDNN and cuBLAS met
  // its shapes outside a capture), unless capturing it failed.
  bool graph = replaying && full && state.met && state.stats.capture_error.empty();
  if (graph && state.outputs.empty()) graph = capture_eval(state);
  if (graph) {
    // Its graph stages nothing: either launch point fails it after the copy-in.
    if (fault_ == Fault::kAfterStaging || fault_ == Fault::kAfterCopyIn) {
      graph_->fail_next_launch(capture::LaunchFault::kAfterCopyIn);
      fault_ = Fault::kNone;
    }
    graph_->launch(state.entry, batch, {});
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : state.outputs) out.push_back(t.clone());
    ++state.stats.replays;
    return out;
  }
#endif
  std::vector<at::Tensor> out = run_eval(state.fn, batch);
  state.met = state.met || full;
  ++state.stats.eager;
  return out;
}

bool Step::Impl::capture_eval(Evaluator::State& state) {
#if NT_HAVE_CUDA
  const std::vector<at::Tensor>& statics = graph_->inputs(state.entry).buffers();
  std::vector<at::Tensor> out;
  capture::CaptureResult result;
  try {
    result = capture_on_side(state.entry, /*staged=*/false,
                             [&] { out = run_eval(state.fn, statics); }, "fn");
  } catch (const std::exception& e) {  // it failed to begin
    result.error = std::string("failed to start: ") + e.what();
    result.error = result.error.substr(0, result.error.find('\n'));
  }
  if (!result.ok) {
    state.stats.capture_error = result.error.empty() ? std::string("unknown") : result.error;
    TORCH_WARN("nimble_train::Evaluator: capturing fn as a CUDA graph failed (",
               state.stats.capture_error, "), so it runs eagerly from now on (correct, at "
               "eager speed). The usual cause is a host synchronisation in fn (.item(), "
               "printing, a data-dependent shape): keep fn on the device to have it captured.");
    return false;
  }
  state.outputs = std::move(out);
  state.autocast = ambient_autocast(device_.type());
  ++state.stats.captures;
  return true;
#else
  (void)state;
  return false;
#endif
}

// ------------------------------------------------------------------ the EMA

void Step::Impl::ema_init() {
  const c10::AutoGradMode no_grad(false);
  for (auto& group : optimizer_.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      const bool seen = std::any_of(ema_params_.begin(), ema_params_.end(),
                                    [&](const at::Tensor& q) { return q.is_same(p); });
      if (!p.requires_grad() || seen) continue;
      ema_params_.push_back(p);
      ema_averages_.push_back(p.detach().clone());
      ema_loose_.push_back(ema_params_.size() - 1);
    }
  }
  for (const at::Tensor& b : module_->buffers()) {
    const bool seen = std::any_of(ema_buffers_.begin(), ema_buffers_.end(),
                                  [&](const at::Tensor& q) { return q.is_same(b); });
    if (!b.defined() || !b.is_floating_point() || seen) continue;
    ema_buffers_.push_back(b);
    ema_buffer_averages_.push_back(b.detach().clone());
  }
}

void Step::Impl::ema_use_flat() {
  if (!options_.ema.has_value()) return;
  const c10::AutoGradMode no_grad(false);
  std::vector<bool> placed(ema_params_.size(), false);
  for (const optim::FlatTensors& flat : flats_) {
    at::Tensor averages = at::zeros_like(flat.param);  // padding stays zero under lerp_
    for (size_t i = 0; i < flat.params.size(); ++i) {
      for (size_t j = 0; j < ema_params_.size(); ++j) {
        if (placed[j] || !ema_params_[j].is_same(flat.params[i])) continue;
        at::Tensor view = flat.segment(averages, int64_t(i));
        view.copy_(ema_averages_[j]);
        ema_averages_[j] = view;
        placed[j] = true;
      }
    }
    ema_flat_.emplace_back(flat.param, averages);
  }
  ema_loose_.clear();
  for (size_t j = 0; j < placed.size(); ++j) {
    if (!placed[j]) ema_loose_.push_back(j);
  }
}

void Step::Impl::ema_update() {
  if (!options_.ema.has_value()) return;
  const double weight = 1.0 - *options_.ema;
  const c10::AutoGradMode no_grad(false);
  for (auto& [params, averages] : ema_flat_) averages.lerp_(params, weight);
  if (!ema_loose_.empty()) {
    std::vector<at::Tensor> averages, params;
    for (const size_t j : ema_loose_) {
      averages.push_back(ema_averages_[j]);
      params.push_back(ema_params_[j].detach());
    }
    at::_foreach_lerp_(averages, params, weight);
  }
  if (!ema_buffers_.empty()) at::_foreach_lerp_(ema_buffer_averages_, ema_buffers_, weight);
}

void Step::Impl::require_ema(const char* what) const {
  if (!options_.ema.has_value()) {
    throw Error(std::string("nimble_train::Step::") + what + ": this Step keeps no EMA; build it "
                "with StepOptions().set_ema(0.999)");
  }
}

void Step::Impl::ema_swap(bool in) {
  require_ema("ema_weights");
  const c10::AutoGradMode no_grad(false);
  std::vector<at::Tensor> targets = ema_params_;
  targets.insert(targets.end(), ema_buffers_.begin(), ema_buffers_.end());
  if (in) {
    if (!ema_saved_.empty()) {
      throw Error("nimble_train::Step::ema_weights: the averages are in the model already (a "
                  "guard is alive); end its scope before taking another");
    }
    std::vector<at::Tensor> averages = ema_averages_;
    averages.insert(averages.end(), ema_buffer_averages_.begin(), ema_buffer_averages_.end());
    std::vector<at::Tensor> saved;
    for (const at::Tensor& t : targets) saved.push_back(t.detach().clone());
    for (size_t i = 0; i < targets.size(); ++i) targets[i].detach().copy_(averages[i]);
    ema_saved_ = std::move(saved);
  } else {
    for (size_t i = 0; i < targets.size(); ++i) targets[i].detach().copy_(ema_saved_[i]);
    ema_saved_.clear();
  }
}

at::Tensor Step::Impl::ema_average_of(const at::Tensor& t) const {
  for (size_t j = 0; j < ema_params_.size(); ++j) {
    if (ema_params_[j].is_same(t)) return ema_averages_[j];
  }
  for (size_t j = 0; j < ema_buffers_.size(); ++j) {
    if (ema_buffers_[j].is_same(t)) return ema_buffer_averages_[j];
  }
  return at::Tensor();
}

torch::OrderedDict<std::string, at::Tensor> Step::Impl::ema_state_dict() const {
  require_ema("ema_state_dict");
  torch::OrderedDict<std::string, at::Tensor> out;
  const c10::AutoGradMode no_grad(false);
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    const at::Tensor average = ema_average_of(t);
    out.insert(name, (average.defined() ? average : t).detach().clone());
  };
  for (const auto& named : module_->named_parameters()) add(named.key(), named.value());
  for (const auto& named : module_->named_buffers()) {
    if (named.value().defined()) add(named.key(), named.value());
  }
  return out;
}

void Step::Impl::load_ema_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state) {
  require_ema("load_ema_state_dict");
  const std::string fix = " Load a state saved by ema_state_dict() for the same model.";
  std::vector<std::pair<at::Tensor, at::Tensor>> pending;  // (average, value)
  std::set<std::string> names;
  const auto take = [&](const std::string& name, const at::Tensor& t) {
    names.insert(name);
    const at::Tensor average = ema_average_of(t);
    if (!average.defined()) return;
    const at::Tensor* value = state.find(name);
    if (value == nullptr) {
      throw Error("nimble_train::Step::load_ema_state_dict: the state has no '" + name +
                  "', which the EMA averages." + fix);
    }
    if (!value->defined() || value->sizes() != average.sizes()) {
      throw Error("nimble_train::Step::load_ema_state_dict: '" + name + "' has shape " +
                  tuple_text(average.sizes()) + " in this model; the state holds " +
                  (value->defined() ? tuple_text(value->sizes()) : std::string("undefined")) +
                  "." + fix);
    }
    pending.emplace_back(average, *value);
  };
  for (const auto& named : module_->named_parameters()) take(named.key(), named.value());
  for (const auto& named : module_->named_buffers()) {
    if (named.value().defined()) take(named.key(), named.value());
  }
  for (const auto& item : state) {
    if (names.count(item.key()) == 0) {
      throw Error("nimble_train::Step::load_ema_state_dict: the state holds '" + item.key() +
                  "', which this model does not have." + fix);
    }
  }
  const c10::AutoGradMode no_grad(false);  // checked whole first: a bad state changes nothing
  for (auto& [average, value] : pending) average.copy_(value);
}

// ------------------------------------------------------------------ Step

Step::Step(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
           ForwardLoss forward_loss, StepOptions options)
    : impl_(std::make_unique<Impl>(std::move(module), optimizer, std::move(forward_loss),
                                   std::move(options))) {}
Step::~Step() = default;
Step::Step(Step&&) noexcept = default;
Step& Step::operator=(Step&&) noexcept = default;

at::Tensor Step::operator()(const Batch& batch) { return impl_->call(batch, CallOptions()); }
at::Tensor Step::operator()(const Batch& batch, bool update) {
  return impl_->call(batch, CallOptions().set_update(update));
}
at::Tensor Step::operator()(const Batch& batch, const CallOptions& call) {
  return impl_->call(batch, call);
}
bool Step::stepped() const { return impl_->stepped(); }
std::optional<at::Tensor> Step::grad_norm() const { return impl_->grad_norm(); }
StepStats Step::stats() const { return impl_->stats(); }
void Step::close() { impl_->close(); }
void Step::inject_failure_for_testing(int point) { impl_->inject(point); }

Evaluator Step::evaluator(EvalFn fn) { return impl_->make_evaluator(std::move(fn)); }

std::vector<at::Tensor> Evaluator::operator()(const Batch& batch) {
  if (!state_) {
    throw Error("nimble_train::Evaluator: this evaluator is empty (default-constructed); assign "
                "it one made by step.evaluator(fn)");
  }
  if (state_->impl == nullptr) {
    throw Error("nimble_train::Evaluator: its Step was destroyed; an evaluator is used while "
                "the Step it came from lives");
  }
  return state_->impl->evaluate(*state_, batch);
}

EvaluatorStats Evaluator::stats() const { return state_ ? state_->stats : EvaluatorStats(); }

Step::EmaWeights Step::ema_weights() {
  impl_->ema_swap(true);
  return EmaWeights(this);
}
Step::EmaWeights::EmaWeights(EmaWeights&& other) noexcept : step_(other.step_) {
  other.step_ = nullptr;
}
Step::EmaWeights::~EmaWeights() {
  if (step_ == nullptr) return;
  try {
    step_->impl_->ema_swap(false);
  } catch (const std::exception&) {  // a destructor must not throw
  }
}
torch::OrderedDict<std::string, at::Tensor> Step::ema_state_dict() const {
  return impl_->ema_state_dict();
}
void Step::load_ema_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state) {
  impl_->load_ema_state_dict(state);
}

}  // namespace nimble_train
