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
      NT_CHECK(false, "all_reduce_: gradients must be float32, float64, float16 or bfloat16; "
               "got ", t.scalar_type());
  }
  return ncclFloat32;  // unreachable
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
  NT_CHECK(flat.device() == device_, "all_reduce_: the tensor is on ", flat.device().str(),
           ", the communicator on ", device_.str());
  NT_CHECK(flat.is_contiguous(), "all_reduce_: the tensor must be contiguous (a flat buffer)");
  const int64_t n = flat.numel();
  if (count < 0) count = n - offset;
  NT_CHECK(offset >= 0 && count >= 0 && offset + count <= n, "all_reduce_: range [", offset, ", ",
           offset + count, ") is outside the tensor's ", n, " elements");
  NT_CHECK(op == "avg" || op == "sum", "all_reduce_: op must be 'avg' or 'sum'; got '", op, "'");
  if (count == 0) return;
  char* base = static_cast<char*>(flat.data_ptr()) + offset * flat.element_size();
  comm_->all_reduce(base, static_cast<size_t>(count), nccl_type(flat),
                    op == "avg" ? ncclAvg : ncclSum,
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
