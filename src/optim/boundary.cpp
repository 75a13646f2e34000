// Tensor-level entry points of src/optim (see boundary.h).
#include "optim/boundary.h"

#include <ATen/Dispatch.h>

#include "common/check.h"
#include "nimble_train/build_config.h"
#include "optim/flat_scale.h"

#if NT_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace nimble_train::optim {
namespace {

#if NT_HAVE_CUDA
DType kernel_dtype(const at::Tensor& x, const char* op) {
  switch (x.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: break;
  }
  NT_CHECK(false, op, ": CUDA tensors must be float32, float16 or bfloat16; got ",
           x.scalar_type());
  return DType::kFloat32;  // unreachable
}
#endif

}  // namespace

void flat_scale_(const at::Tensor& x, const at::Tensor& scale) {
  NT_CHECK(x.is_contiguous(), "flat_scale_: x must be contiguous (a flat buffer); got sizes ",
           x.sizes(), " with strides ", x.strides(), ". Pass x.contiguous() and copy back.");
  NT_CHECK(x.is_floating_point(), "flat_scale_: x must be a floating-point tensor; got ",
           x.scalar_type());
  NT_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat,
           "flat_scale_: scale must be a one-element float32 tensor; got ", scale.numel(),
           " elements of ", scale.scalar_type());
  NT_CHECK(scale.device() == x.device(), "flat_scale_: scale must be on x's device (", x.device(),
           "); got ", scale.device());

  if (x.is_cuda()) {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    flat_scale_cuda(x.data_ptr(), kernel_dtype(x, "flat_scale_"), x.numel(),
                    scale.const_data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
#else
    NT_CHECK(false, "flat_scale_: x is a CUDA tensor, but nimble_train was built without CUDA (",
             NT_CUDA_REASON, "). Rebuild it: pip install --no-build-isolation -e .");
#endif
    return;
  }
  NT_CHECK(x.is_cpu(), "flat_scale_: x must be a CPU or CUDA tensor; got ", x.device());
  const float s = scale.item<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "flat_scale_", [&] {
    flat_scale_reference(x.data_ptr<scalar_t>(), x.numel(), s);
  });
}

}  // namespace nimble_train::optim
