// The CPU reference of batch_norm_act.h.
#include "ops/batch_norm_act.h"

namespace nimble_train::ops {
namespace {

template <typename Traits>
void forward(const void* x_, const void* residual_, void* y_, const BatchNormActParams& p,
             const BatchNormActShape& s) {
  using S = typename Traits::Storage;
  const S* x = static_cast<const S*>(x_);
  const S* residual = static_cast<const S*>(residual_);
  S* y = static_cast<S*>(y_);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.channels; ++c) {
      const int64_t i = r * s.channels + c;
      const float res = residual != nullptr ? Traits::load(residual[i]) : 0.0f;
      y[i] = Traits::store(BatchNormActMath::apply(Traits::load(x[i]), p.mean[c], p.invstd[c],
                                                   p.weight[c], p.bias[c], res));
    }
  }
  if (p.running_mean != nullptr) {
    for (int64_t c = 0; c < s.channels; ++c) {
      BatchNormActMath::update_running(p.mean[c], p.invstd[c], p.momentum, p.eps, s.rows,
                                       p.running_mean + c, p.running_var + c);
    }
  }
}

}  // namespace

void batch_norm_relu_forward_reference(const void* x, const void* residual, void* y,
                                       const BatchNormActParams& p, const BatchNormActShape& s,
                                       DType dtype) {
  optim::dispatch_dtype(dtype,
                        [&](auto traits) { forward<decltype(traits)>(x, residual, y, p, s); });
}

}  // namespace nimble_train::ops
