// Bindings for src/streams.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "python/bindings.h"
#include "streams/stream_assignment.h"

namespace py = pybind11;

namespace nimble_train {

void bind_streams(py::module_& m) {
  using streams::StreamPlan;
  py::class_<StreamPlan>(m, "StreamPlan",
                         "Operators mapped to CUDA streams, and the cross-stream waits.")
      .def_readonly("stream_of", &StreamPlan::stream_of,
                    "list[int]: the stream of each node, in [0, num_streams).")
      .def_readonly("num_streams", &StreamPlan::num_streams, "int: the number of streams.")
      .def_readonly("syncs", &StreamPlan::syncs,
                    "list[tuple[int, int]]: edges (u, v) where v's stream waits on an event "
                    "recorded after u; sorted.")
      .def("__repr__", [](const StreamPlan& plan) {
        return "StreamPlan(num_nodes=" + std::to_string(plan.stream_of.size()) +
               ", num_streams=" + std::to_string(plan.num_streams) +
               ", syncs=" + std::to_string(plan.syncs.size()) + ")";
      });

  m.def("assign_streams", &streams::assign_streams, py::arg("num_nodes"), py::arg("edges"),
        py::arg("max_streams") = 0, py::call_guard<py::gil_scoped_release>(),
        "Maps the nodes of an operator DAG onto CUDA streams (Nimble's stream assignment).\n\n"
        "num_nodes: nodes are 0 .. num_nodes - 1, numbered in a topological order.\n"
        "edges: (u, v) pairs with u < v; v depends on u. Duplicates count once.\n"
        "max_streams: at most this many streams; 0 means no limit.\n\n"
        "Without a limit, two nodes share a stream only if one depends on the other (maximum\n"
        "logical concurrency), and syncs are the fewest such a plan can have: the edges of\n"
        "the transitive reduction whose ends lie on different streams. With a limit, every\n"
        "dependency is still enforced by stream order (each stream runs its nodes in\n"
        "increasing number) plus syncs. Raises ValueError on bad input.");
}

}  // namespace nimble_train
