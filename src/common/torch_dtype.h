// The DType of a tensor our kernels take, or InvalidArgument naming what was seen.
#pragma once

#include <ATen/core/Tensor.h>

#include "common/check.h"
#include "common/dtype.h"

namespace nimble_train {

inline DType kernel_dtype(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: break;
  }
  NT_CHECK(false, op, ": ", name, " must be float32, float16 or bfloat16; got ", t.scalar_type());
  return DType::kFloat32;  // unreachable
}

}  // namespace nimble_train
