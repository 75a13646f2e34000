// The pack width of an element-wise kernel over channels-last tensors, chosen at run time.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "optim/dtype_traits.h"

namespace nimble_train::ops {

// Calls launch(traits, pack width): 16-byte packs where the channels and every pointer
// (`aligned`) allow, else one element at a time.
template <typename Launch>
void dispatch_packs(DType dtype, int64_t channels, bool aligned, Launch&& launch) {
  optim::dispatch_dtype(dtype, [&](auto traits) {
    using Traits = decltype(traits);
    constexpr int kVec = 16 / sizeof(typename Traits::Storage);
    if (aligned && channels % kVec == 0) {
      launch(traits, std::integral_constant<int, kVec>{});
    } else {
      launch(traits, std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace nimble_train::ops
