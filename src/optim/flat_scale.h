// Multiplies a flat buffer in place by a factor that lives in device memory.
//
// Unscaling (fp16 loss scale) and gradient clipping compute their factor on the device; reading
// it there instead of from the host keeps the step free of host syncs, and lets a captured
// graph apply a new factor on every replay without recapture.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/cuda_fwd.h"
#include "common/dtype.h"

namespace nimble_train::optim {

// Arithmetic type of the update: float for float, half and bfloat16; double for double.
template <typename T>
using ScaleAccum = std::conditional_t<std::is_same_v<T, double>, double, float>;

// CPU reference, and the CPU path: x[i] = round_T(float(x[i]) * scale).
// x: [n] elements of T.
template <typename T>
void flat_scale_reference(T* x, int64_t n, float scale) {
  using Acc = ScaleAccum<T>;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<T>(static_cast<Acc>(x[i]) * static_cast<Acc>(scale));
  }
}

// Defined in CUDA builds only (NT_HAVE_CUDA).
// x: [n] elements of `dtype` in device memory, any alignment (16-byte aligned runs fastest);
// scale: one float in device memory, read when the kernel runs.
void flat_scale_cuda(void* x, DType dtype, int64_t n, const float* scale, cudaStream_t stream);

}  // namespace nimble_train::optim
