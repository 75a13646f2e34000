// The extension module nimble_train._C: one pybind11 module over the runtime library.
#include <pybind11/pybind11.h>

#include "python/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "Bindings over nimble_train's C++/CUDA runtime library; use it through the nimble_train "
      "package.";
  nimble_train::bind_build(m);
  nimble_train::bind_optim(m);
  nimble_train::bind_streams(m);
  nimble_train::bind_capture(m);
  nimble_train::bind_comm(m);
  nimble_train::bind_layout(m);
  nimble_train::bind_ops(m);
  nimble_train::bind_watch(m);
}
