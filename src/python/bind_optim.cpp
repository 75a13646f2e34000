// Bindings for src/optim.
#include <torch/csrc/utils/pybind.h>

#include <functional>
#include <optional>
#include <tuple>
#include <utility>

#include "optim/boundary.h"
#include "optim/device_tables.h"
#include "optim/fused_step.h"
#include "optim/fused_update.h"
#include "optim/step_control.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nimble_train {

namespace {

// A Python in-place sum over the ranks as the C++ step calls it (with the GIL released).
std::function<void(const at::Tensor&)> summing(const std::optional<py::function>& fn) {
  if (!fn.has_value()) return {};
  return [fn = *fn](const at::Tensor& t) {
    const py::gil_scoped_acquire gil;
    fn(t);
  };
}

// The table layouts, so that Python builds and reads the tables without repeating numbers.
py::dict layout() {
  using namespace optim;
  py::dict hyper;
  const std::pair<const char*, int> columns[] = {
      {"lr", kLr}, {"weight_decay", kWeightDecay}, {"momentum", kMomentum},
      {"dampening", kDampening}, {"nesterov", kNesterov}, {"maximize", kMaximize},
      {"beta1", kBeta1}, {"beta2", kBeta2}, {"eps", kEps}, {"bias_correction", kBiasCorrection},
      {"decoupled_weight_decay", kDecoupledDecay}, {"always_adapt", kAlwaysAdapt},
      {"step", kStep}};
  for (const auto& [name, column] : columns) hyper[name] = column;
  py::dict d;
  d["hyper"] = hyper;
  d["hyper_columns"] = int(kHyperColumns);
  d["staged_columns"] = int(kNumStagedHyper);
  d["control"] = py::dict(py::arg("grad_norm") = int(kGradNorm),
                          py::arg("grad_factor") = int(kGradFactor),
                          py::arg("found_inf") = int(kFoundInf),
                          py::arg("skip_update") = int(kSkipUpdate));
  d["control_size"] = int(kControlSize);
  d["chunk_columns"] = int(kChunkColumns);
  d["default_chunk_elems"] = kDefaultChunkElems;
  return d;
}

// Whether each of an optimizer's param groups (dicts) holds under "params" the very objects of
// `kept`'s matching sequence, in order: identity, never a Tensor's == (which compares values,
// or refuses). Called on every replay, hence plain CPython: no object is made.
bool same_param_groups(py::handle groups, py::handle kept) {
  PyObject* gs = groups.ptr();
  PyObject* ks = kept.ptr();
  if (!PyList_Check(gs) || !PyList_Check(ks) || PyList_GET_SIZE(gs) != PyList_GET_SIZE(ks)) {
    return false;
  }
  for (Py_ssize_t g = 0; g < PyList_GET_SIZE(gs); ++g) {
    PyObject* group = PyList_GET_ITEM(gs, g);
    PyObject* params = PyDict_Check(group) ? PyDict_GetItemString(group, "params") : nullptr;
    PyObject* was = PyList_GET_ITEM(ks, g);
    const auto sequence = [](PyObject* o) { return o && (PyList_Check(o) || PyTuple_Check(o)); };
    if (!sequence(params) || !sequence(was)) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(params);
    if (n != PySequence_Fast_GET_SIZE(was)) return false;
    PyObject** now = PySequence_Fast_ITEMS(params);
    PyObject** then = PySequence_Fast_ITEMS(was);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (now[i] != then[i]) return false;
    }
  }
  return true;
}

}  // namespace

void bind_optim(py::module_& m) {
  m.def("same_param_groups", &same_param_groups, py::arg("groups"), py::arg("kept"),
        "Whether each param group (optimizer.param_groups) holds under 'params' the very "
        "objects of kept's matching list or tuple, in order (identity, not ==).");
  m.def("optim_layout", &layout,
        "The layouts of the fused optimizer's tables (columns of hyper and control, the staged "
        "columns per group, the chunk table width), as in src/optim/device_tables.h.");

  m.def("optim_build_chunk_table", &optim::make_chunk_table, py::arg("offsets"),
        py::arg("tensor_group"), py::arg("chunk_elems") = optim::kDefaultChunkElems,
        py::call_guard<py::gil_scoped_release>(),
        "Cuts flat buffers into chunks that straddle no tensor.\n\n"
        "offsets: int64 [num_tensors + 1] CPU, offsets into flat (elements); tensor_group: int64 "
        "[num_tensors] CPU. Returns (chunks int64 [num_chunks, 4], first_chunk int64 "
        "[num_tensors + 1]).");

  m.def("optim_grad_stats_rows", &optim::grad_stats_partial_rows, py::arg("n"),
        "Rows of partials that optim_grad_stats_ writes for a gradient buffer of n elements.");

  m.def("optim_grad_stats_", &optim::grad_stats_, py::arg("grads"), py::arg("inv_scale"),
        py::arg("partials"), py::call_guard<py::gil_scoped_release>(),
        "partials[rows, 2] = per block (sum of (grad * inv_scale)^2, non-finite flag).\n\n"
        "grads: flat float32/float16/bfloat16 buffer; inv_scale: float32 [1] or None; "
        "partials: float32 [optim_grad_stats_rows(grads.numel()), 2].");

  py::class_<optim::StepTables>(m, "OptimStepTables",
                                "The persistent tables of one fused optimizer (see "
                                "src/optim/device_tables.h).")
      .def(py::init([](at::Tensor staged, at::Tensor hyper, at::Tensor param_steps,
                       at::Tensor param_group, at::Tensor control) {
             return optim::StepTables{staged, hyper, param_steps, param_group, control};
           }),
           py::kw_only(), py::arg("staged"), py::arg("hyper"), py::arg("param_steps"),
           py::arg("param_group"), py::arg("control"))
      .def_readonly("staged", &optim::StepTables::staged)
      .def_readonly("hyper", &optim::StepTables::hyper)
      .def_readonly("param_steps", &optim::StepTables::param_steps)
      .def_readonly("param_group", &optim::StepTables::param_group)
      .def_readonly("control", &optim::StepTables::control);

  m.def("optim_prepare_step_", &optim::prepare_step_, py::arg("tables"), py::arg("partials"),
        py::arg("inv_scale"), py::arg("found_inf"), py::arg("max_norm"),
        py::arg("skip_nonfinite"), py::call_guard<py::gil_scoped_release>(),
        "One block of device work per step: takes the staged hyper-parameters (tables.staged, "
        "fetched by the step's staging ring), reduces the partials (None: no stats) to the "
        "norm, clip factor (max_norm <= 0: none) and overflow "
        "flag, writes found_inf (float32 [1] or None), advances the step counts unless the step "
        "is skipped (skip_nonfinite and a non-finite gradient).");

  m.def("optim_sgd_update_", &optim::sgd_update_, py::arg("params"), py::arg("grads"),
        py::arg("momentum"), py::arg("chunks"), py::arg("hyper"), py::arg("control"),
        py::call_guard<py::gil_scoped_release>(),
        "SGD (momentum, dampening, Nesterov, weight decay, maximize) over flat buffers, in place. "
        "momentum: the flat momentum buffer, or None when no group uses momentum.");

  m.def("optim_adam_update_", &optim::adam_update_, py::arg("params"), py::arg("grads"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"),
        py::arg("chunks"), py::arg("hyper"), py::arg("control"),
        py::call_guard<py::gil_scoped_release>(),
        "Adam / AdamW over flat buffers, in place. max_exp_avg_sq: the flat buffer (amsgrad) or "
        "None.");

  m.def("optim_lamb_update_",
        [](const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
           const at::Tensor& exp_avg_sq, const at::Tensor& chunks, const at::Tensor& first_chunk,
           const at::Tensor& hyper, const at::Tensor& control, const at::Tensor& chunk_norms,
           const at::Tensor& trust) {
          optim::lamb_update_(params, grads, exp_avg, exp_avg_sq, chunks, first_chunk, hyper,
                              control, chunk_norms, trust);
        },
        py::arg("params"), py::arg("grads"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("chunks"), py::arg("first_chunk"),
        py::arg("hyper"), py::arg("control"), py::arg("chunk_norms"), py::arg("trust"),
        py::call_guard<py::gil_scoped_release>(),
        "LAMB over flat buffers, in place: moments and per-chunk norms, per-tensor trust ratios, "
        "parameter update. chunk_norms: float32 [num_chunks, 2], trust: float32 [num_tensors] "
        "scratch.");

  py::class_<optim::FlatTensors>(m, "FlatTensors",
                                 "The flat buffers of one dtype (src/optim/fused_step.h).")
      .def_readonly("params", &optim::FlatTensors::params)
      .def_readonly("param_index", &optim::FlatTensors::param_index)
      .def_readonly("groups", &optim::FlatTensors::groups)
      .def_readonly("offsets", &optim::FlatTensors::offsets)
      .def_readonly("param", &optim::FlatTensors::param)
      .def_readonly("grad", &optim::FlatTensors::grad)
      .def_readonly("state", &optim::FlatTensors::state)
      .def_readonly("grad_views", &optim::FlatTensors::grad_views)
      .def_readonly("chunks", &optim::FlatTensors::chunks)
      .def_readonly("first_chunk", &optim::FlatTensors::first_chunk)
      .def_readonly("chunk_norms", &optim::FlatTensors::chunk_norms)
      .def_readonly("trust", &optim::FlatTensors::trust);

  m.def("optim_build_flat_buffers", &optim::build_flat_buffers, py::arg("params"),
        py::arg("num_state"), py::arg("device"), py::arg("shard_world"), py::arg("chunk_elems"),
        py::arg("lamb"),
        "Moves (group, parameter) pairs into flat buffers per dtype: data and gradients become "
        "views (values copied). Returns [FlatTensors], in order of first appearance.");
  m.def("optim_reattach", &optim::reattach, py::arg("flats"),
        "Puts back the parameter and gradient views user code moved away, values copied in.");
  m.def("optim_attach_grads", &optim::attach_grads, py::arg("flats"),
        "Undefined gradients go back to their views, keeping what the views hold.");
  m.def("optim_zero_grads", &optim::zero_grads, py::arg("flats"),
        "One memset per flat gradient buffer; undefined gradients go back to their views.");

  py::class_<optim::ParamWatch>(m, "ParamWatch",
                                "A step's parameters as it fixed them: which required gradients, "
                                "and (from fix_storage() on) the storage its graphs read.")
      .def(py::init<std::vector<at::Tensor>, int64_t>(), py::arg("params"), py::arg("trained"),
           "params: the optimizer's `trained` parameters (flags watched), then others the graphs "
           "read (storage only).")
      .def("fix_storage", &optim::ParamWatch::fix_storage, py::arg("others") = py::none(),
           "From here on the graphs read each parameter's data where it is now; others, when "
           "given, first take the place of the parameters after the trained ones.")
      .def("changed", &optim::ParamWatch::changed,
           "Whether a flag changed or a parameter's data moved since.")
      .def("first_flag_changed", &optim::ParamWatch::first_flag_changed,
           "The index of the first parameter whose requires_grad differs from then, or -1.")
      .def("was_trainable", &optim::ParamWatch::was_trainable, py::arg("i"))
      .def("moved", &optim::ParamWatch::moved,
           "The parameters whose data is no longer the storage the graphs read.")
      .def("why_not_restorable", &optim::ParamWatch::why_not_restorable, py::arg("i"),
           "Why parameter i's new data cannot go back where the graphs read it, or ''.")
      .def("shares_memory_with", &optim::ParamWatch::shares_memory_with, py::arg("i"),
           "The first other parameter whose data shares memory with parameter i's, or -1.")
      .def("restore", &optim::ParamWatch::restore,
           "Copies each moved parameter's values where the graphs read them; it views them again.")
      .def("undo_moves", &optim::ParamWatch::undo_moves,
           "Each moved parameter views the storage the graphs read again, values untouched.")
      .def("adopt", &optim::ParamWatch::adopt, py::arg("others"),
           "The graphs captured next read these parameters outside the trained ones where "
           "their data is now.");

  py::class_<optim::UpdateTarget>(m, "UpdateTarget",
                                  "What one pass of the fused update reads and writes.")
      .def(py::init([](at::Tensor param, at::Tensor grad, std::vector<at::Tensor> state,
                       at::Tensor chunks, std::optional<at::Tensor> first_chunk,
                       std::optional<at::Tensor> chunk_norms, std::optional<at::Tensor> trust,
                       std::optional<at::Tensor> tensor_rows,
                       std::optional<at::Tensor> tensor_sums,
                       std::optional<at::Tensor> global_sums,
                       std::optional<at::Tensor> range_sums) {
             const auto or_none = [](const std::optional<at::Tensor>& t) {
               return t.value_or(at::Tensor());
             };
             return optim::UpdateTarget{param, grad, std::move(state), chunks,
                                        or_none(first_chunk), or_none(chunk_norms),
                                        or_none(trust), at::Tensor(), or_none(tensor_rows),
                                        or_none(tensor_sums), or_none(global_sums),
                                        or_none(range_sums)};
           }),
           py::kw_only(), py::arg("param"), py::arg("grad"), py::arg("state"), py::arg("chunks"),
           py::arg("first_chunk") = py::none(), py::arg("chunk_norms") = py::none(),
           py::arg("trust") = py::none(), py::arg("tensor_rows") = py::none(),
           py::arg("tensor_sums") = py::none(), py::arg("global_sums") = py::none(),
           py::arg("range_sums") = py::none(),
           "LAMB: first_chunk, chunk_norms and trust of the target's own chunk table; sharded, "
           "tensor_rows (each local tensor's row of global_sums), tensor_sums, global_sums and "
           "range_sums (see src/optim/fused_step.h).")
      .def_readonly("partials", &optim::UpdateTarget::partials);
  m.def("optim_target_of", &optim::target_of, py::arg("flat"),
        "The update target of a whole FlatTensors.");
  m.def("optim_assign_partials",
        [](std::vector<optim::UpdateTarget> targets, at::Device device) {
          at::Tensor partials = optim::assign_partials(targets, device);
          return std::make_pair(partials, targets);
        },
        py::arg("targets"), py::arg("device"),
        "(partials, targets): one float32 [rows, 2] buffer for the gradient statistics of "
        "every target, and the targets with their rows assigned.");
  m.def("optim_fused_step",
        [](const std::string& algorithm, const std::vector<optim::UpdateTarget>& targets,
           const optim::StepTables& tables, const at::Tensor& partials,
           std::optional<at::Tensor> inv_scale, std::optional<at::Tensor> found_inf,
           std::optional<at::Tensor> grad_scale, double max_grad_norm,
           std::optional<py::function> reduce_partials,
           bool stats_done) -> std::optional<at::Tensor> {
          const optim::FusedStepArgs args{inv_scale, found_inf, grad_scale, max_grad_norm,
                                          summing(reduce_partials), stats_done};
          at::Tensor norm;
          {
            const py::gil_scoped_release release;
            norm = optim::fused_step(optim::parse_algorithm(algorithm), targets, tables,
                                     partials, args);
          }
          if (!norm.defined()) return std::nullopt;
          return norm;
        },
        py::arg("algorithm"), py::arg("targets"), py::arg("tables"), py::arg("partials"),
        py::arg("inv_scale"), py::arg("found_inf"), py::arg("grad_scale"),
        py::arg("max_grad_norm"), py::arg("reduce_partials"), py::arg("stats_done") = false,
        "The fused step (src/optim/fused_step.h): gradient statistics when asked for (and not "
        "done already, stats_done), the sum over ranks (reduce_partials, sharded), prepare, the "
        "updates. Returns the global gradient norm (0-dim) when computed, else None.");
  m.def("optim_gradient_factor",
        [](std::optional<at::Tensor> inv_scale, std::optional<at::Tensor> found_inf,
           std::optional<at::Tensor> grad_scale, double max_grad_norm,
           at::Device device) -> std::optional<at::Tensor> {
          const optim::FusedStepArgs args{inv_scale, found_inf, grad_scale, max_grad_norm, {},
                                          false};
          const py::gil_scoped_release release;
          return optim::gradient_factor(args, device);
        },
        py::arg("inv_scale"), py::arg("found_inf"), py::arg("grad_scale"),
        py::arg("max_grad_norm"), py::arg("device"),
        "Checks a step's arguments; the factor its statistics and update multiply the "
        "gradients by (None: 1).");
  m.def("optim_grad_stats_parts",
        [](const std::vector<optim::UpdateTarget>& targets, std::optional<at::Tensor> factor) {
          const py::gil_scoped_release release;
          optim::grad_stats_parts_(targets, factor);
        },
        py::arg("targets"), py::arg("factor"),
        "The gradient statistics of these targets into their rows of partials, for a step "
        "whose statistics go in parts (then optim_fused_step with stats_done).");
  m.def("optim_prepare_update",
        [](const optim::StepTables& tables, std::optional<at::Tensor> grad_scale) {
          const py::gil_scoped_release release;
          optim::prepare_update_(tables, grad_scale);
        },
        py::arg("tables"), py::arg("grad_scale"),
        "The first part of a step split in two (src/optim/fused_step.h): prepare without "
        "gradient statistics.");
  m.def("optim_update",
        [](const std::string& algorithm, const std::vector<optim::UpdateTarget>& targets,
           const optim::StepTables& tables, std::optional<py::function> reduce) {
          const optim::Algorithm parsed = optim::parse_algorithm(algorithm);
          const std::function<void(const at::Tensor&)> sum = summing(reduce);
          const py::gil_scoped_release release;
          optim::update_(parsed, targets, tables, sum);
        },
        py::arg("algorithm"), py::arg("targets"), py::arg("tables"),
        py::arg("reduce") = py::none(),
        "The second part: the updates of these targets, after optim_prepare_update. Sharded "
        "LAMB's slices add their tensors' norms over the ranks with reduce (an in-place sum).");
}

}  // namespace nimble_train
