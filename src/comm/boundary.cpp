// Tensor-level entry points of src/comm (see boundary.h): checks, then plain pointers.
#include "comm/boundary.h"

#include <c10/cuda/CUDAStream.h>

#include "comm/communicator.h"
#include "common/check.h"

namespace nimble_train::comm {
namespace {

ncclDataType_t nccl_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    default:
      NT_CHECK(false, "NCCL collectives here take float32, float64, float16 or bfloat16 "
               "tensors; got ", t.scalar_type());
  }
  return ncclFloat32;  // unreachable
}

// The byte address of flat[offset] after checking flat[offset, offset + count) and the device.
char* checked_range(const at::Tensor& flat, int64_t offset, int64_t count, at::Device device,
                    const char* op) {
  NT_CHECK(flat.device() == device, op, ": the tensor is on ", flat.device().str(),
           ", the communicator on ", device.str());
  NT_CHECK(flat.is_contiguous(), op, ": the tensor must be contiguous (a flat buffer)");
  const int64_t n = flat.numel();
  NT_CHECK(offset >= 0 && count >= 0 && offset + count <= n, op, ": range [", offset, ", ",
           offset + count, ") is outside the tensor's ", n, " elements");
  return static_cast<char*>(flat.data_ptr()) + offset * flat.element_size();
}

ncclRedOp_t reduction(const std::string& op, const char* name) {
  NT_CHECK(op == "avg" || op == "sum", name, ": op must be 'avg' or 'sum'; got '", op, "'");
  return op == "avg" ? ncclAvg : ncclSum;
}

}  // namespace

TensorCommunicator::TensorCommunicator(const std::string& unique_id, int64_t rank, int64_t world,
                                       at::Device device, double timeout_s)
    : device_(device) {
  NT_CHECK(device.is_cuda() && device.has_index(), "Communicator: the device must be a CUDA "
           "device with an index (cuda:N); got ", device.str());
  comm_ = std::make_unique<Communicator>(unique_id, static_cast<int>(rank),
                                         static_cast<int>(world), device.index(), timeout_s);
}

TensorCommunicator::~TensorCommunicator() = default;

void TensorCommunicator::all_reduce_(const at::Tensor& flat, int64_t offset, int64_t count,
                                     const std::string& op) {
  if (count < 0) count = flat.numel() - offset;
  char* base = checked_range(flat, offset, count, device_, "all_reduce_");
  const ncclRedOp_t red = reduction(op, "all_reduce_");
  if (count == 0) return;
  comm_->all_reduce(base, static_cast<size_t>(count), nccl_type(flat), red,
                    c10::cuda::getCurrentCUDAStream(device_.index()).stream());
}

void TensorCommunicator::reduce_scatter_(const at::Tensor& flat, int64_t offset, int64_t count,
                                         const std::string& op) {
  char* base = checked_range(flat, offset, count, device_, "reduce_scatter_");
  const ncclRedOp_t red = reduction(op, "reduce_scatter_");
  const int64_t world = comm_->world();
  NT_CHECK(count % world == 0, "reduce_scatter_: ", count, " elements do not split into ", world,
           " equal parts");
  if (count == 0) return;
  const int64_t part = count / world;
  comm_->reduce_scatter(base, base + comm_->rank() * part * flat.element_size(),
                        static_cast<size_t>(part), nccl_type(flat), red,
                        c10::cuda::getCurrentCUDAStream(device_.index()).stream());
}

void TensorCommunicator::all_gather_(const at::Tensor& flat, int64_t offset, int64_t count) {
  char* base = checked_range(flat, offset, count, device_, "all_gather_");
  const int64_t world = comm_->world();
  NT_CHECK(count % world == 0, "all_gather_: ", count, " elements do not split into ", world,
           " equal parts");
  if (count == 0) return;
  const int64_t part = count / world;
  comm_->all_gather(base + comm_->rank() * part * flat.element_size(), base,
                    static_cast<size_t>(part), nccl_type(flat),
                    c10::cuda::getCurrentCUDAStream(device_.index()).stream());
}

void TensorCommunicator::wait(double timeout_s, const std::string& what) {
  comm_->wait(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), timeout_s, what);
}

void TensorCommunicator::abort() { comm_->abort(); }
int64_t TensorCommunicator::rank() const { return comm_->rank(); }
int64_t TensorCommunicator::world() const { return comm_->world(); }
bool TensorCommunicator::aborted() const { return comm_->aborted(); }

}  // namespace nimble_train::comm
