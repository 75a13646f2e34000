// Bindings for src/comm (present when NCCL was compiled in; has_nccl() says).
#include <torch/csrc/utils/pybind.h>

#include "nimble_train/build_config.h"
#include "python/bindings.h"

#if NT_HAVE_NCCL
#include "comm/boundary.h"
#include "comm/communicator.h"
#endif

namespace py = pybind11;

namespace nimble_train {

void bind_comm([[maybe_unused]] py::module_& m) {
#if NT_HAVE_NCCL
  using comm::TensorCommunicator;
  m.def("nccl_unique_id", [] { return py::bytes(comm::new_unique_id()); },
        "The bytes of a fresh ncclUniqueId (rank 0 makes it; every rank passes it unchanged).");
  py::class_<TensorCommunicator>(
      m, "NcclCommunicator",
      "A non-blocking NCCL communicator of one process per GPU. Joining waits at most\n"
      "timeout_s for every rank; a timeout or NCCL error aborts it and raises.")
      .def(py::init([](py::bytes unique_id, int64_t rank, int64_t world, at::Device device,
                       double timeout_s) {
             std::string id = unique_id;
             py::gil_scoped_release release;
             return std::make_unique<TensorCommunicator>(id, rank, world, device, timeout_s);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("world"), py::arg("device"),
           py::arg("timeout_s") = 300.0)
      .def("all_reduce_", &TensorCommunicator::all_reduce_, py::arg("flat"),
           py::arg("offset") = 0, py::arg("count") = -1, py::arg("op") = "avg",
           py::call_guard<py::gil_scoped_release>(),
           "In place over flat[offset:offset+count] on the current stream (capturable).")
      .def("reduce_scatter_", &TensorCommunicator::reduce_scatter_, py::arg("flat"),
           py::arg("offset"), py::arg("count"), py::arg("op") = "avg",
           py::call_guard<py::gil_scoped_release>(),
           "flat[offset:offset+count] cut in world equal parts: part `rank` becomes the "
           "reduction of every rank's part `rank`; in place, on the current stream.")
      .def("all_gather_", &TensorCommunicator::all_gather_, py::arg("flat"), py::arg("offset"),
           py::arg("count"), py::call_guard<py::gil_scoped_release>(),
           "flat[offset:offset+count] cut in world equal parts: part r becomes rank r's; in "
           "place, on the current stream.")
      .def("wait", &TensorCommunicator::wait, py::arg("timeout_s"), py::arg("what"),
           py::call_guard<py::gil_scoped_release>(),
           "Host waits for the current stream's work so far, at most timeout_s seconds.")
      .def("abort", &TensorCommunicator::abort, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &TensorCommunicator::rank)
      .def_property_readonly("world", &TensorCommunicator::world)
      .def_property_readonly("aborted", &TensorCommunicator::aborted);
#endif
}

}  // namespace nimble_train
