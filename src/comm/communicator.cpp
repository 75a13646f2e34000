// NCCL communicator (see communicator.h).
#include "comm/communicator.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "comm/nccl_check.h"
#include "common/cuda_check.h"

namespace nimble_train::comm {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(seconds));
}

}  // namespace

std::string new_unique_id() {
  ncclUniqueId id;
  NT_CHECK_NCCL(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

Communicator::Communicator(const std::string& unique_id, int rank, int world, int device,
                           double timeout_s)
    : rank_(rank), world_(world), device_(device) {
  NT_CHECK(world >= 1 && rank >= 0 && rank < world, "Communicator: rank ", rank,
           " is not in [0, ", world, ")");
  NT_CHECK(unique_id.size() == sizeof(ncclUniqueId::internal), "Communicator: the unique id has ",
           unique_id.size(), " bytes; NCCL's has ", sizeof(ncclUniqueId::internal),
           " (pass the bytes of new_unique_id() from rank 0 unchanged)");
  NT_CHECK(timeout_s > 0, "Communicator: timeout_s must be positive; got ", timeout_s);
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  DeviceGuard guard(device);
  const ncclResult_t status = ncclCommInitRankConfig(&comm_, world, id, rank, &config);
  if (status != ncclSuccess && status != ncclInProgress) {
    comm_ = nullptr;
    NT_FAIL("ncclCommInitRankConfig (rank ", rank, " of ", world, ", device ", device,
            ") failed: ", ncclGetErrorString(status), " (last error: ", ncclGetLastError(nullptr),
            ")");
  }
  settle(detail::concat("joining the NCCL communicator (every one of the ", world,
                        " ranks must create it)"),
         timeout_s);
}

Communicator::~Communicator() {
  if (comm_ == nullptr) return;
  DeviceGuard guard(device_);
  // Finalize flushes this rank's outstanding operations; a non-blocking communicator reports
  // that as in progress, so poll (with a bound: a vanished peer must not hang the exit), and
  // abort instead when it does not finish cleanly.
  ncclResult_t state = ncclCommFinalize(comm_);
  const auto deadline = deadline_after(10.0);
  while (state == ncclInProgress && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
  }
  if (state == ncclSuccess) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
  }
  comm_ = nullptr;
}

void Communicator::abort() {
  if (comm_ == nullptr) return;
  DeviceGuard guard(device_);
  ncclCommAbort(comm_);
  comm_ = nullptr;
}

void Communicator::fail(const std::string& what, const std::string& detail) {
  abort();
  NT_FAIL("rank ", rank_, " of ", world_, ": ", what, ": ", detail,
          "; the communicator was aborted");
}

void Communicator::settle(const std::string& what, double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t status = ncclCommGetAsyncError(comm_, &state);
    if (status != ncclSuccess) {
      fail(what, detail::concat("ncclCommGetAsyncError failed: ", ncclGetErrorString(status)));
    }
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      fail(what, detail::concat(ncclGetErrorString(state), " (last error: ",
                                ncclGetLastError(comm_), ")"));
    }
    if (Clock::now() > deadline) {
      fail(what, detail::concat("no progress within ", timeout_s,
                                " s: another rank did not take part (it crashed, is still "
                                "starting, or runs a different model or configuration)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void Communicator::all_reduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op,
                              cudaStream_t stream) {
  NT_CHECK(comm_ != nullptr, "Communicator::all_reduce: the communicator was aborted after an "
           "earlier error; make a new one");
  DeviceGuard guard(device_);
  enqueued("ncclAllReduce", ncclAllReduce(data, data, count, type, op, comm_, stream));
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t count,
                                  ncclDataType_t type, ncclRedOp_t op, cudaStream_t stream) {
  NT_CHECK(comm_ != nullptr, "Communicator::reduce_scatter: the communicator was aborted after "
           "an earlier error; make a new one");
  DeviceGuard guard(device_);
  enqueued("ncclReduceScatter", ncclReduceScatter(send, recv, count, type, op, comm_, stream));
}

void Communicator::all_gather(const void* send, void* recv, size_t count, ncclDataType_t type,
                              cudaStream_t stream) {
  NT_CHECK(comm_ != nullptr, "Communicator::all_gather: the communicator was aborted after an "
           "earlier error; make a new one");
  DeviceGuard guard(device_);
  enqueued("ncclAllGather", ncclAllGather(send, recv, count, type, comm_, stream));
}

void Communicator::enqueued(const char* call, ncclResult_t status) {
  if (status != ncclSuccess && status != ncclInProgress) {
    fail(call, detail::concat(ncclGetErrorString(status), " (last error: ",
                              ncclGetLastError(comm_), ")"));
  }
  // Enqueueing takes no time that depends on other ranks; the bound is generous.
  settle(detail::concat("enqueueing ", call), 60.0);
}

void Communicator::wait(cudaStream_t stream, double timeout_s, const std::string& what) {
  NT_CHECK(comm_ != nullptr, "Communicator::wait: the communicator was aborted");
  DeviceGuard guard(device_);
  cudaEvent_t done;
  NT_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  NT_CHECK_CUDA(cudaEventRecord(done, stream));
  const auto deadline = deadline_after(timeout_s);
  for (;;) {
    const cudaError_t query = cudaEventQuery(done);
    if (query == cudaSuccess) break;
    if (query != cudaErrorNotReady) {
      cudaEventDestroy(done);
      NT_CHECK_CUDA(query);
    }
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      cudaEventDestroy(done);
      fail(what, detail::concat(ncclGetErrorString(state), " (last error: ",
                                ncclGetLastError(comm_), ")"));
    }
    if (Clock::now() > deadline) {
      cudaEventDestroy(done);
      fail(what, detail::concat("not done within ", timeout_s,
                                " s: another rank did not take part (it crashed, stopped "
                                "early, or runs a different model or configuration)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  cudaEventDestroy(done);
}

}  // namespace nimble_train::comm
