// Element storage and float conversion for the optimizer kernels, one definition for the CPU
// reference and the CUDA kernels.
//
// float16 and bfloat16 are stored as their 16-bit patterns (uint16_t), so the same template runs
// on the host, where the conversions below are done in software with round-to-nearest-even, and
// on the device, where they are the CUDA intrinsics (which round the same way).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/dtype.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define NT_HOST_DEVICE __host__ __device__
#else
#define NT_HOST_DEVICE
#endif

namespace nimble_train::optim {

NT_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

NT_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

NT_HOST_DEVICE inline float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_float(sign | float_bits(magnitude));
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));  // 112 = 127 - 15
#endif
}

NT_HOST_DEVICE inline uint16_t float_to_half(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t magnitude = x & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  // 65520 = 0x477ff000 is halfway between 65504 (the largest half) and 2^16; ties go to the
  // even neighbour, which is infinity.
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
    // |f| * 2^24 < 1024 is exact; nearbyint rounds half to even in the default rounding mode.
    const float units = std::nearbyint(bits_float(magnitude) * 16777216.0f);
    return sign | static_cast<uint16_t>(units);  // 1024 units is the smallest normal: encoded right
  }
  uint32_t h = ((magnitude >> 23) - 112) << 10 | ((magnitude >> 13) & 0x3ffu);
  const uint32_t rest = magnitude & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
#endif
}

NT_HOST_DEVICE inline float bfloat16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

NT_HOST_DEVICE inline uint16_t float_to_bfloat16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
#endif
}

// Traits: Storage is what the flat buffer holds; load/store convert to and from the float
// arithmetic type of every update (the optimizer math is float32 for all three dtypes).
template <DType D>
struct DTypeTraits;

template <>
struct DTypeTraits<DType::kFloat32> {
  using Storage = float;
  NT_HOST_DEVICE static float load(Storage x) { return x; }
  NT_HOST_DEVICE static Storage store(float x) { return x; }
};

template <>
struct DTypeTraits<DType::kFloat16> {
  using Storage = uint16_t;
  NT_HOST_DEVICE static float load(Storage x) { return half_to_float(x); }
  NT_HOST_DEVICE static Storage store(float x) { return float_to_half(x); }
};

template <>
struct DTypeTraits<DType::kBFloat16> {
  using Storage = uint16_t;
  NT_HOST_DEVICE static float load(Storage x) { return bfloat16_to_float(x); }
  NT_HOST_DEVICE static Storage store(float x) { return float_to_bfloat16(x); }
};

// Calls f(DTypeTraits<dtype>{}) for a runtime dtype.
template <typename F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16: return f(DTypeTraits<DType::kFloat16>{});
    case DType::kBFloat16: return f(DTypeTraits<DType::kBFloat16>{});
    case DType::kFloat32: break;
  }
  return f(DTypeTraits<DType::kFloat32>{});
}

}  // namespace nimble_train::optim
