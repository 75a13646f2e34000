// DType: the element types our kernels take, named without torch or CUDA headers.
#pragma once

#include <cstdint>

namespace nimble_train {

enum class DType : int8_t { kFloat32, kFloat16, kBFloat16 };

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

}  // namespace nimble_train
