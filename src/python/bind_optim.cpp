// Bindings for src/optim.
#include <torch/csrc/utils/pybind.h>

#include "optim/boundary.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nimble_train {

void bind_optim(py::module_& m) {
  m.def("flat_scale_", &optim::flat_scale_, py::arg("x"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>(),
        "x *= scale, in place, with scale read on x's device (no host sync on CUDA).\n\n"
        "x: contiguous float tensor (float32, float16 or bfloat16 on CUDA; any float on CPU).\n"
        "scale: one-element float32 tensor on x's device.");
}

}  // namespace nimble_train
