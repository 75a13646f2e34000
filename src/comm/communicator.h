// An NCCL communicator of one process per GPU, and the collectives data parallelism needs: the
// all-reduce of gradients, and the reduce-scatter and all-gather of a sharded optimizer.
//
// No torch here: plain pointers, element counts and a cudaStream_t. The unique id comes from
// rank 0 (new_unique_id) and reaches the other ranks through any channel the caller has (the
// Python layer uses the torch.distributed store).
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0) so that nothing waits without
// a deadline: joining waits at most `timeout_s` for every rank, and wait() bounds how long the
// host waits for a collective (the first one tells whether every rank takes part). A timeout
// aborts the communicator and raises, naming what was waited for; errors carry
// ncclGetErrorString and ncclGetLastError.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <string>

namespace nimble_train::comm {

// The bytes of a fresh ncclUniqueId (NCCL_UNIQUE_ID_BYTES of them).
std::string new_unique_id();

class Communicator {
 public:
  // Joins the communicator of `world` ranks named by `unique_id` as `rank`, on CUDA `device`.
  Communicator(const std::string& unique_id, int rank, int world, int device, double timeout_s);
  ~Communicator();  // finalizes and destroys; after abort(), only frees
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // In-place all-reduce of `count` elements at `data`, enqueued on `stream` (capturable).
  void all_reduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op,
                  cudaStream_t stream);

  // Rank r receives the reduction of every rank's send[r * count, (r + 1) * count) in recv
  // (count elements); in place when recv == send + r * count elements.
  void reduce_scatter(const void* send, void* recv, size_t count, ncclDataType_t type,
                      ncclRedOp_t op, cudaStream_t stream);

  // recv[r * count, (r + 1) * count) receives rank r's `count` elements at send; in place when
  // send == recv + rank * count elements.
  void all_gather(const void* send, void* recv, size_t count, ncclDataType_t type,
                  cudaStream_t stream);

  // Host waits until the work enqueued so far on `stream` is done, at most `timeout_s`;
  // on timeout or an asynchronous NCCL error, aborts the communicator and raises.
  void wait(cudaStream_t stream, double timeout_s, const std::string& what);

  // Tears the communicator down without waiting for other ranks (after an error).
  void abort();

  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  bool aborted() const { return comm_ == nullptr; }

 private:
  // Polls ncclCommGetAsyncError while the last call is in progress, at most `timeout_s`.
  void settle(const std::string& what, double timeout_s);
  [[noreturn]] void fail(const std::string& what, const std::string& detail);
  // After enqueueing `call` (an NCCL collective): raises on an error, else settles.
  void enqueued(const char* call, ncclResult_t status);

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int world_ = 0;
  int device_ = 0;
};

}  // namespace nimble_train::comm
