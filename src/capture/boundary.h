// Tensor-level entry points of src/capture: device scalars for graphs, graph introspection.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace nimble_train::capture {

class ScalarRing;

// Scalars the host sets before each launch of a captured graph and the graph reads on the
// device (see scalar_ring.h). values() is the [num_scalars] float32 tensor the graph's kernels
// read; it holds the values of the last fetch().
class DeviceScalars {
 public:
  DeviceScalars(int64_t num_scalars, at::Device device, int64_t capacity);
  ~DeviceScalars();

  void stage(const std::vector<double>& values);  // host: the next launch's values
  void unstage();                                 // host: the launch did not happen
  void fetch();                                   // device: on the current stream; capturable

  const at::Tensor& values() const { return values_; }
  int64_t staged() const;
  int64_t consumed() const;

 private:
  std::unique_ptr<ScalarRing> ring_;
  at::Tensor values_;   // [num_scalars] float32
  at::Tensor counter_;  // [1] int64, launches fetched so far
};

// Number of nodes of a cudaGraph_t given as an integer handle (torch's raw_cuda_graph()).
int64_t graph_node_count(uintptr_t graph);

}  // namespace nimble_train::capture
