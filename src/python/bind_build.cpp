// Bindings that say what this build has compiled in, and which libraries it runs with.
#include <pybind11/pybind11.h>

#include "nimble_train/build_config.h"
#include "python/bindings.h"

#if NT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#if NT_HAVE_NCCL
#include "comm/nccl_info.h"
#endif

namespace py = pybind11;

namespace nimble_train {
namespace {

py::dict feature(bool present, const char* version, const char* reason) {
  py::dict d;
  d["available"] = present;
  d["version"] = present ? py::object(py::str(version)) : py::object(py::none());
  d["reason"] = present ? py::object(py::none()) : py::object(py::str(reason));
  return d;
}

py::dict build_info() {
  py::dict info;
  info["version"] = NT_VERSION;
  info["torch_version"] = NT_TORCH_VERSION;
  info["cuda"] = feature(NT_HAVE_CUDA, NT_CUDA_VERSION, NT_CUDA_REASON);
  info["cuda_archs"] = NT_HAVE_CUDA ? py::object(py::str(NT_CUDA_ARCHS)) : py::object(py::none());
  info["nccl"] = feature(NT_HAVE_NCCL, NT_NCCL_VERSION, NT_NCCL_REASON);
  return info;
}

// Versions of the libraries actually loaded in this process; none of these calls needs a GPU.
py::dict runtime_versions() {
  py::dict out;
#if NT_HAVE_CUDA
  int runtime = 0;
  out["cuda_runtime"] = cudaRuntimeGetVersion(&runtime) == cudaSuccess
                            ? py::object(py::int_(runtime)) : py::object(py::none());
#endif
#if NT_HAVE_NCCL
  out["nccl"] = comm::nccl_runtime_version();
#endif
  return out;
}

}  // namespace

void bind_build(py::module_& m) {
  m.def("build_info", &build_info,
        "What this build compiled in: a dict with 'version', 'torch_version' (the torch it was "
        "compiled against), 'cuda_archs', and for 'cuda' and 'nccl' a dict "
        "{'available', 'version', 'reason'} where 'reason' says why a feature was left out.");
  m.def("has_cuda", [] { return bool(NT_HAVE_CUDA); },
        "True when the CUDA kernels and the capture runtime were compiled in.");
  m.def("has_nccl", [] { return bool(NT_HAVE_NCCL); },
        "True when the NCCL communication layer was compiled in.");
  m.def("runtime_versions", &runtime_versions,
        "Versions of the CUDA libraries loaded in this process (CUDA runtime as an int, e.g. "
        "13000; NCCL as 'major.minor.patch'); only those compiled in.");
}

}  // namespace nimble_train
