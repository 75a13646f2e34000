// Tensor-level entry points of src/comm: the communicator over torch tensors and streams.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

namespace nimble_train::comm {

class Communicator;

// A Communicator whose collectives take tensors and run on the current CUDA stream.
class TensorCommunicator {
 public:
  TensorCommunicator(const std::string& unique_id, int64_t rank, int64_t world,
                     at::Device device, double timeout_s);
  ~TensorCommunicator();

  // In place over flat[offset, offset + count) (count < 0: to the end); op "avg" or "sum".
  void all_reduce_(const at::Tensor& flat, int64_t offset, int64_t count, const std::string& op);
  // Over flat[offset, offset + count), count a multiple of the world size, cut in world equal
  // parts: rank r's part becomes the reduction of every rank's part r (the others keep their
  // values). In place; op "avg" or "sum".
  void reduce_scatter_(const at::Tensor& flat, int64_t offset, int64_t count,
                       const std::string& op);
  // The inverse cut: every rank's part r of flat[offset, offset + count) becomes rank r's.
  void all_gather_(const at::Tensor& flat, int64_t offset, int64_t count);
  // Host waits for the current stream's work so far, at most timeout_s (see Communicator::wait).
  void wait(double timeout_s, const std::string& what);
  void abort();

  int64_t rank() const;
  int64_t world() const;
  bool aborted() const;

 private:
  std::unique_ptr<Communicator> comm_;
  at::Device device_;
};

}  // namespace nimble_train::comm
