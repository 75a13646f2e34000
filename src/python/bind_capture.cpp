// Bindings for src/capture: the staging ring, static inputs and the step-graph runtime.
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "capture/grad_accumulators.h"
#include "capture/kernel_settings.h"
#include "capture/static_inputs.h"
#include "capture/staging_ring.h"
#include "common/check.h"
#include "nimble_train/build_config.h"
#include "python/bindings.h"

#if NT_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "capture/graph_nodes.h"
#include "capture/graph_structure.h"
#include "capture/step_graph.h"
#include "common/cuda_check.h"
#endif

namespace py = pybind11;

namespace nimble_train {
namespace {

using capture::LeafSpec;

// (path, example tensor, strides, batched[, vary_dim, pad_value]) per tensor leaf: the example
// gives sizes, dtype and device (the first batch's leaf), strides the static buffer's layout.
using LeafTuple = py::tuple;

std::vector<LeafSpec> leaf_specs(const std::vector<LeafTuple>& leaves) {
  std::vector<LeafSpec> specs;
  specs.reserve(leaves.size());
  for (const py::tuple& leaf : leaves) {
    NT_CHECK(leaf.size() == 4 || leaf.size() == 6, "a leaf spec is (path, example, strides, "
             "batched[, vary_dim, pad_value]); got a tuple of ", leaf.size());
    const auto example = leaf[1].cast<at::Tensor>();
    LeafSpec spec;
    spec.path = leaf[0].cast<std::string>();
    spec.sizes = example.sizes().vec();
    spec.strides = leaf[2].cast<std::vector<int64_t>>();
    spec.dtype = example.scalar_type();
    spec.device = example.device();
    spec.batched = leaf[3].cast<bool>();
    if (leaf.size() == 6) {
      spec.vary_dim = leaf[4].cast<int64_t>();
      spec.pad_value = leaf[5].cast<double>();
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

const char* const kLeavesDoc =
    "leaves: one (path, example, strides, batched[, vary_dim, pad_value]) per tensor leaf of the "
    "batch, in flattening order: path names it in messages (\"batch[0]\"), example is a tensor "
    "of the buffer's sizes, dtype and device, strides the static buffer's layout, batched whether "
    "dimension 0 is the batch, vary_dim a dimension along which a batch may be shorter (padded "
    "with pad_value; -1: none).";

void bind_staging(py::module_& m) {
  using capture::StagingRing;
  py::class_<StagingRing>(
      m, "StagingRing",
      "The one host-to-graph staging mechanism: per launch one slot of float32 values in\n"
      "mapped pinned memory (CUDA) that the launch's first kernel (fetch) copies into\n"
      "`current`; back-pressure, a stale-slot check and rollback (unstage). See\n"
      "src/capture/slot_ring.h.")
      .def(py::init<int64_t, at::Device, int64_t>(), py::arg("num_values"), py::arg("device"),
           py::arg("capacity") = 1024)
      .def("stage", &StagingRing::stage, py::arg("values"),
           py::call_guard<py::gil_scoped_release>(),
           "Host: the next launch's values (num_values floats); returns its sequence number.")
      .def("restage", &StagingRing::restage, py::arg("values"),
           py::call_guard<py::gil_scoped_release>(),
           "Host: rewrites the newest slot that no launch has consumed yet.")
      .def("unstage", &StagingRing::unstage, py::call_guard<py::gil_scoped_release>(),
           "Host: takes back the newest pending slot (its launch did not happen).")
      .def("launched", &StagingRing::launched, py::arg("n") = 1,
           py::call_guard<py::gil_scoped_release>(),
           "Host: n launches that fetch were enqueued (each consumes one pending slot).")
      .def("fetch", &StagingRing::fetch, py::call_guard<py::gil_scoped_release>(),
           "Device: copies the next slot into current, on the current stream (capturable); on "
           "the CPU at once.")
      .def_property_readonly("current", &StagingRing::current,
                             "[num_values] float32 tensor on the device: the values the "
                             "running launch fetched.")
      .def_property_readonly("staged", [](const StagingRing& r) { return r.ring().staged(); })
      .def_property_readonly("launches", [](const StagingRing& r) { return r.ring().launches(); })
      .def_property_readonly("pending", [](const StagingRing& r) { return r.ring().pending(); })
      .def_property_readonly("consumed", [](const StagingRing& r) { return r.ring().consumed(); },
                             "Launches whose fetch has run, as the device last published.")
      .def_property_readonly("stale", [](const StagingRing& r) { return r.ring().stale(); },
                             "Launches that found a slot not staged for them.")
      .def("set_timeout", [](StagingRing& r, double seconds) {
             r.set_timeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3)));
           }, py::arg("seconds"), "How long stage() waits for a free slot before raising.");
}

void bind_static_inputs(py::module_& m) {
  using capture::StaticInputs;
  py::class_<StaticInputs>(
      m, "StaticInputs",
      "The buffers a captured step reads its batch from; checks batches against them and\n"
      "copies them in (a short batch fills the leading rows). A mismatch raises ShapeError.")
      .def(py::init([](const std::vector<LeafTuple>& leaves) {
             return std::make_unique<StaticInputs>(leaf_specs(leaves));
           }),
           py::arg("leaves"), kLeavesDoc)
      .def("check", &StaticInputs::check, py::arg("leaves"),
           py::call_guard<py::gil_scoped_release>(),
           "The number of samples of a batch's tensor leaves, or ShapeError.")
      .def("copy_in", &StaticInputs::copy_in, py::arg("leaves"), py::arg("samples"),
           py::arg("fill_padding") = false, py::call_guard<py::gil_scoped_release>(),
           "Copies checked leaves in on the current stream; fill_padding copies the first "
           "sample into the rows past `samples`.")
      .def_property_readonly("buffers", &StaticInputs::buffers)
      .def_property_readonly("batch_size", &StaticInputs::batch_size);
}

#if NT_HAVE_CUDA
capture::LaunchFault launch_fault(const std::string& name) {
  if (name == "after_staging") return capture::LaunchFault::kAfterStaging;
  if (name == "after_copy_in") return capture::LaunchFault::kAfterCopyIn;
  NT_CHECK(name == "none", "fail_next_launch: point must be \"after_staging\", "
           "\"after_copy_in\" or \"none\"; got \"", name, "\"");
  return capture::LaunchFault::kNone;
}

void bind_step_graph(py::module_& m) {
  using capture::CaptureResult;
  using capture::StepGraph;
  py::class_<CaptureResult>(m, "CaptureResult", "How a capture ended.")
      .def_readonly("ok", &CaptureResult::ok)
      .def_readonly("invalidated", &CaptureResult::invalidated,
                    "CUDA invalidated the capture: a call it forbids while capturing ran "
                    "(a host synchronisation, a synchronous copy).")
      .def_readonly("error", &CaptureResult::error);

  py::class_<StepGraph>(
      m, "StepGraph",
      "A training step's CUDA graphs, captured into one private pool, each with its static\n"
      "inputs, and the staging ring every launch reads (value 0: the valid-sample count).\n"
      "See src/capture/step_graph.h.")
      .def(py::init<at::Device, int64_t, int64_t>(), py::arg("device"), py::arg("num_values"),
           py::arg("ring_capacity") = 1024)
      .def("add_entry", [](StepGraph& g, const std::vector<LeafTuple>& leaves) {
             return g.add_entry(leaf_specs(leaves));
           }, py::arg("leaves"), kLeavesDoc)
      .def("add_entry_sharing_inputs", &StepGraph::add_entry_sharing_inputs, py::arg("other"),
           "A new entry whose graph reads entry `other`'s static inputs (the same buffers).")
      .def("inputs", [](const StepGraph& g, int64_t entry) {
             return g.inputs(entry).buffers();
           }, py::arg("entry"), "The static input buffers of an entry, in leaf order.")
      .def("check", &StepGraph::check, py::arg("entry"), py::arg("leaves"),
           py::call_guard<py::gil_scoped_release>())
      .def("copy_in", &StepGraph::copy_in, py::arg("entry"), py::arg("leaves"),
           py::arg("samples"), py::arg("fill_padding") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("stage_eager", &StepGraph::stage_eager, py::arg("samples"), py::arg("values"),
           py::call_guard<py::gil_scoped_release>(),
           "For an eager step that reads current: stages [samples, values...] and fetches it "
           "now, on the current stream.")
      .def("begin_capture", &StepGraph::begin_capture, py::arg("entry"),
           py::arg("staged") = true, py::arg("memsets_as_kernels") = true,
           py::call_guard<py::gil_scoped_release>(),
           "Starts capturing the entry's graph on the current (side) stream; the fetch is its "
           "first node (staged=False: none, for a graph that reads no staged value). "
           "memsets_as_kernels: its memset nodes become kernel nodes before instantiation (a "
           "graph of kernels alone launches in one cheap submission).")
      .def("end_capture", &StepGraph::end_capture, py::call_guard<py::gil_scoped_release>(),
           "Ends and instantiates the capture; a failed one is abandoned. Returns a "
           "CaptureResult.")
      .def("abandon_capture", &StepGraph::abandon_capture,
           py::call_guard<py::gil_scoped_release>(),
           "Ends and discards the capture after the step's code failed inside it.")
      .def("launch", &StepGraph::launch, py::arg("entry"), py::arg("leaves"), py::arg("values"),
           py::call_guard<py::gil_scoped_release>(),
           "The replay path: checks the leaves, stages [samples, values...], copies the batch "
           "in and replays; a failure after staging gives the slot back.")
      .def("drop", &StepGraph::drop, py::arg("entry"))
      .def("release", &StepGraph::release, py::call_guard<py::gil_scoped_release>(),
           "Waits for the device, then frees every graph and the pool.")
      .def("captured", &StepGraph::captured, py::arg("entry"))
      .def("node_count", &StepGraph::node_count, py::arg("entry"))
      .def_property_readonly("blas_workspaces", &StepGraph::blas_workspaces,
                             "The cuBLAS workspaces the captures use, held by the step graph "
                             "(src/capture/blas_workspaces.h).")
      .def_property_readonly("blas_workspace_addresses", [](const StepGraph& g) {
             std::vector<uintptr_t> out;
             for (void* p : g.blas_workspace_addresses()) {
               out.push_back(reinterpret_cast<uintptr_t>(p));
             }
             return out;
           }, "Where each held cuBLAS workspace lies (device addresses).")
      .def("memset_nodes", &StepGraph::memset_nodes, py::arg("entry"),
           "Of the entry's nodes, the memsets its capture rewrote as kernels.")
      .def("structure", [](StepGraph& g, int64_t entry) {
             const capture::GraphStructure s = g.structure(entry);
             return py::make_tuple(s.kinds, s.dependencies);
           }, py::arg("entry"),
           "(kinds, dependencies) of the entry's captured graph, its nodes in one topological "
           "order: per node its kind (\"kernel\", \"memcpy\", \"memset\", ...) and the "
           "positions of the nodes it depends on. See src/capture/graph_structure.h.")
      .def("replay_serially", &StepGraph::replay_serially, py::arg("entry"),
           py::arg("serially"), py::call_guard<py::gil_scoped_release>(),
           "Whether the entry's launches replay its graph one node at a time, in structure()'s "
           "order (each node alone on the GPU: to time them), or as captured.")
      .def_property_readonly("pool_id", &StepGraph::pool_id)
      .def_property_readonly("num_entries", &StepGraph::num_entries)
      .def_property_readonly("current", &StepGraph::current)
      .def_property_readonly("staged", [](const StepGraph& g) {
             return g.staging().ring().staged();
           })
      .def_property_readonly("launches", [](const StepGraph& g) {
             return g.staging().ring().launches();
           })
      .def_property_readonly("consumed", [](const StepGraph& g) {
             return g.staging().ring().consumed();
           })
      .def_property_readonly("stale", [](const StepGraph& g) {
             return g.staging().ring().stale();
           })
      .def("fail_next_launch", [](StepGraph& g, const std::string& point) {
             g.fail_next_launch(launch_fault(point));
           }, py::arg("point"),
           "Makes the next launch fail once at \"after_staging\" or \"after_copy_in\" (rollback "
           "tests).")
      .def("fail_next_capture_end", &StepGraph::fail_next_capture_end,
           "Makes the next end_capture fail once, after the memset rewrite and before "
           "instantiation (rollback tests).");
  m.def("graph_memsets_as_kernels", [](uintptr_t graph, int device) {
          return capture::memsets_as_kernels(reinterpret_cast<cudaGraph_t>(graph), device);
        }, py::arg("graph"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
        "Rewrites the memset nodes of a captured, not yet instantiated torch.cuda.CUDAGraph "
        "(keep_graph=True; graph: its raw_cuda_graph()) on `device` as kernel nodes; returns "
        "how many. Instantiate it after.");
  m.def("graph_structure", [](uintptr_t graph) {
          const capture::GraphStructure s =
              capture::graph_structure(reinterpret_cast<cudaGraph_t>(graph));
          return py::make_tuple(s.kinds, s.dependencies);
        }, py::arg("graph"),
        "(kinds, dependencies) of a captured torch.cuda.CUDAGraph (keep_graph=True; graph: its "
        "raw_cuda_graph()), as StepGraph.structure gives them.");
  py::class_<capture::SerialGraph>(
      m, "SerialGraph",
      "A captured graph replayed one node at a time, in graph_structure()'s order (each node\n"
      "alone on the GPU: to time them). It reads and writes the graph's memory. See\n"
      "src/capture/graph_structure.h.")
      .def(py::init([](uintptr_t graph, int device) {
             return std::make_unique<capture::SerialGraph>(reinterpret_cast<cudaGraph_t>(graph),
                                                           device);
           }), py::arg("graph"), py::arg("device"),
           "graph: a torch.cuda.CUDAGraph's raw_cuda_graph() (made with keep_graph=True); "
           "device: its device index.")
      .def("launch", [](capture::SerialGraph& g) {
             g.launch(c10::cuda::getCurrentCUDAStream());
           }, py::call_guard<py::gil_scoped_release>(), "Replays it on the current stream.")
      .def_property_readonly("added_edges", &capture::SerialGraph::added_edges,
                             "The edges the clone gained (0: the graph was serial already).");
  m.def("cuda_memset", [](const at::Tensor& t, int64_t value) {
          NT_CHECK(t.is_cuda() && t.is_contiguous(), "cuda_memset: t must be a contiguous CUDA "
                   "tensor; got ", t.device(), t.is_contiguous() ? "" : ", not contiguous");
          const c10::cuda::CUDAGuard guard(t.device());
          NT_CHECK_CUDA(cudaMemsetAsync(t.data_ptr(), static_cast<int>(value), t.nbytes(),
                                        c10::cuda::getCurrentCUDAStream()));
        }, py::arg("t"), py::arg("value"),
        "cudaMemsetAsync of t's bytes to `value` on the current stream: a memset as libraries "
        "such as cuDNN enqueue them (a capture records a memset node).");
}
#endif

}  // namespace

void bind_capture(py::module_& m) {
  bind_staging(m);
  bind_static_inputs(m);
  m.def("bind_grad_accumulators", &capture::bind_grad_accumulators, py::arg("leaves"),
        "Binds the gradient accumulator of each leaf that has one alive (an earlier autograd "
        "graph holds it) to the current stream, as if made now; returns how many were bound "
        "to another stream. See src/capture/grad_accumulators.h.");
  m.def("kernel_settings", &capture::kernel_settings,
        "torch's settings that choose a step's kernels (float32's precision, cuDNN, the "
        "attention backends, ...) packed into one int. See src/capture/kernel_settings.h.");
  m.def("kernel_setting_changes", &capture::kernel_setting_changes, py::arg("captured"),
        py::arg("now"), "'name is now, was captured' for each setting that differs.");
#if NT_HAVE_CUDA
  bind_step_graph(m);
#endif
  // A batch that does not fit the template is the user's ShapeError, raised as that class.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const capture::BatchMismatch& e) {
      py::object error = py::module_::import("nimble_train.errors").attr("ShapeError");
      PyErr_SetString(error.ptr(), e.what());
    }
  });
}

}  // namespace nimble_train
