// The CPU reference of batch_norm_act.h.
#include "ops/batch_norm_act.h"

#include <algorithm>

namespace nimble_train::ops {
namespace {

template <typename Traits>
void forward(const void* x_, const void* residual_, void* y_, uint32_t* mask,
             const BatchNormActParams& p, const BatchNormActShape& s) {
  using S = typename Traits::Storage;
  const S* x = static_cast<const S*>(x_);
  const S* residual = static_cast<const S*>(residual_);
  S* y = static_cast<S*>(y_);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.channels; ++c) {
      const int64_t i = r * s.channels + c;
      const float res = residual != nullptr ? Traits::load(residual[i]) : 0.0f;
      y[i] = Traits::store(BatchNormActMath::apply(Traits::load(x[i]), p.mean[c], p.invstd[c],
                                                   p.weight[c], p.bias[c], res, p.activation));
    }
  }
  if (mask != nullptr) {
    std::fill(mask, mask + relu_mask_words(s), 0u);
    for (int64_t i = 0; i < s.rows * s.channels; ++i) {
      mask[i >> 5] |= BatchNormActBackwardMath::kept(Traits::load(y[i])) << (i & 31);
    }
  }
  if (p.running_mean != nullptr) {
    for (int64_t c = 0; c < s.channels; ++c) {
      BatchNormActMath::update_running(p.mean[c], p.invstd[c], p.momentum, p.eps, s.rows,
                                       p.running_mean + c, p.running_var + c);
    }
  }
}

template <typename Traits>
void backward(const void* grad_y_, const void* y_, const uint32_t* mask, const void* x_,
              const BatchNormActParams& p, const BatchNormActGrads& g,
              const BatchNormActShape& s) {
  using S = typename Traits::Storage;
  const S* grad_y = static_cast<const S*>(grad_y_);
  const S* y = static_cast<const S*>(y_);
  const S* x = static_cast<const S*>(x_);
  S* grad_x = static_cast<S*>(g.grad_x);
  S* grad_residual = static_cast<S*>(g.grad_residual);
  const float inv_rows = 1.0f / static_cast<float>(s.rows);
  for (int64_t c = 0; c < s.channels; ++c) {
    const auto through = [&](int64_t i) {  // the gradient through the activation
      const float z = BatchNormActMath::normalised(Traits::load(x[i]), p.mean[c], p.invstd[c],
                                                   p.weight[c], p.bias[c], 0.0f);
      const float gy = Traits::load(grad_y[i]);
      if (p.activation == Activation::kGelu) return BatchNormActBackwardMath::gelu_through(gy, z);
      const bool kept = mask != nullptr ? BatchNormActBackwardMath::kept_at(mask, i)
                                        : BatchNormActBackwardMath::kept(Traits::load(y[i]));
      return kept ? gy : 0.0f;
    };
    float sum_dy = 0.0f, sum_dy_xmu = 0.0f;
    for (int64_t r = 0; r < s.rows; ++r) {
      const int64_t i = r * s.channels + c;
      const float gz = through(i);
      sum_dy += gz;
      sum_dy_xmu += gz * (Traits::load(x[i]) - p.mean[c]);
    }
    g.grad_weight[c] = sum_dy_xmu * p.invstd[c];
    g.grad_bias[c] = sum_dy;
    for (int64_t r = 0; r < s.rows; ++r) {
      const int64_t i = r * s.channels + c;
      const float gz = through(i);
      if (grad_residual != nullptr) grad_residual[i] = Traits::store(gz);
      if (grad_x != nullptr) {
        grad_x[i] = Traits::store(BatchNormActBackwardMath::grad_input(
            gz, Traits::load(x[i]), p.mean[c], p.invstd[c], p.weight[c], sum_dy, sum_dy_xmu,
            inv_rows));
      }
    }
  }
}

template <typename Traits>
void stats(const void* x_, const BatchNormStats& out, const BatchNormActShape& s) {
  using S = typename Traits::Storage;
  const S* x = static_cast<const S*>(x_);
  for (int64_t c = 0; c < s.channels; ++c) {
    const float shift = Traits::load(x[c]);
    float sum_d = 0.0f, sum_dd = 0.0f;
    for (int64_t r = 0; r < s.rows; ++r) {
      const float d = Traits::load(x[r * s.channels + c]) - shift;
      sum_d += d;
      sum_dd += d * d;
    }
    BatchNormStatsMath::finish(shift, sum_d, sum_dd, s.rows, out.eps, out.mean + c,
                               out.invstd + c);
  }
}

}  // namespace

void batch_norm_stats_reference(const void* x, const BatchNormStats& out,
                                const BatchNormActShape& s, DType dtype) {
  optim::dispatch_dtype(dtype, [&](auto traits) { stats<decltype(traits)>(x, out, s); });
}

void batch_norm_relu_backward_reference(const void* grad_y, const void* y, const uint32_t* mask,
                                        const void* x, const BatchNormActParams& p,
                                        const BatchNormActGrads& g, const BatchNormActShape& s,
                                        DType dtype) {
  optim::dispatch_dtype(dtype, [&](auto traits) {
    backward<decltype(traits)>(grad_y, y, mask, x, p, g, s);
  });
}

void batch_norm_relu_forward_reference(const void* x, const void* residual, void* y,
                                       uint32_t* mask, const BatchNormActParams& p,
                                       const BatchNormActShape& s, DType dtype) {
  optim::dispatch_dtype(dtype, [&](auto traits) {
    forward<decltype(traits)>(x, residual, y, mask, p, s);
  });
}

}  // namespace nimble_train::ops
