// 16-byte (or narrower) packs of elements, loaded and stored in one access: the vector width
// of the element-wise kernels (the fused optimizers, max-pooling).
#pragma once

#include <cstdint>

namespace nimble_train {

template <typename T, int kWidth>
struct alignas(sizeof(T) * kWidth) Pack {
  T v[kWidth];
};

// Whether `p` may be read or written in packs of `bytes` (a null pointer is).
inline bool aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// base + i must be aligned to the pack's size.
template <int kWidth, typename T>
__device__ Pack<T, kWidth> load_pack(const T* base, int64_t i) {
  return *reinterpret_cast<const Pack<T, kWidth>*>(base + i);
}

template <int kWidth, typename T>
__device__ void store_pack(T* base, int64_t i, const Pack<T, kWidth>& p) {
  *reinterpret_cast<Pack<T, kWidth>*>(base + i) = p;
}

}  // namespace nimble_train
