// Bindings for src/capture.
#include <torch/csrc/utils/pybind.h>

#include "capture/boundary.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nimble_train {

void bind_capture(py::module_& m) {
  using capture::DeviceScalars;
  py::class_<DeviceScalars>(
      m, "DeviceScalars",
      "Scalars set on the host before each launch of a captured graph and read by the graph\n"
      "on the device: a ring of mapped pinned slots, so the host may run ahead of the GPU.")
      .def(py::init<int64_t, at::Device, int64_t>(), py::arg("num_scalars"), py::arg("device"),
           py::arg("capacity") = 1024)
      .def("stage", &DeviceScalars::stage, py::arg("values"),
           py::call_guard<py::gil_scoped_release>(),
           "Host: writes the next launch's values (a list of num_scalars floats).")
      .def("unstage", &DeviceScalars::unstage, py::call_guard<py::gil_scoped_release>(),
           "Host: takes back the last stage() when its launch did not happen.")
      .def("fetch", &DeviceScalars::fetch, py::call_guard<py::gil_scoped_release>(),
           "Device: copies the staged values into values() on the current stream (capturable).")
      .def_property_readonly("values", &DeviceScalars::values,
                             "[num_scalars] float32 device tensor the graph reads.")
      .def_property_readonly("staged", &DeviceScalars::staged)
      .def_property_readonly("consumed", &DeviceScalars::consumed);

  m.def("graph_node_count", &capture::graph_node_count, py::arg("graph"),
        py::call_guard<py::gil_scoped_release>(),
        "Number of nodes in a cudaGraph_t given as an integer (torch's raw_cuda_graph()).");
}

}  // namespace nimble_train
