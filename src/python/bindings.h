// One registration function per component; module.cpp calls them all.
#pragma once

#include <pybind11/pybind11.h>

namespace nimble_train {

void bind_build(pybind11::module_& m);    // build_info, has_cuda, has_nccl, runtime versions
void bind_optim(pybind11::module_& m);    // src/optim
void bind_streams(pybind11::module_& m);  // src/streams
void bind_capture(pybind11::module_& m);  // src/capture
void bind_comm(pybind11::module_& m);     // src/comm (NCCL)
void bind_layout(pybind11::module_& m);   // src/optim/flat_layout.h
void bind_ops(pybind11::module_& m);      // src/ops
void bind_watch(pybind11::module_& m);    // EntryWatch: a module tree's dict entries

}  // namespace nimble_train
