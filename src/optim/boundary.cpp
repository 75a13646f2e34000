// Tensor-level entry points of src/optim (see boundary.h).
#include "optim/boundary.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "common/check.h"
#include "common/torch_dtype.h"
#include "nimble_train/build_config.h"
#include "optim/device_tables.h"
#include "optim/fused_update.h"
#include "optim/step_control.h"

#if NT_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace nimble_train::optim {
namespace {

// Every tensor of one call lives on `device` and is contiguous (pointers index it as flat).
void check_placed(const at::Tensor& x, const at::Device& device, const char* op,
                  const char* name) {
  NT_CHECK(x.defined(), op, ": ", name, " is undefined");
  NT_CHECK(x.device() == device, op, ": ", name, " must be on ", device, " like the other "
           "buffers; got ", x.device());
  NT_CHECK(x.is_contiguous(), op, ": ", name, " must be contiguous; got sizes ", x.sizes(),
           " with strides ", x.strides());
  NT_CHECK(x.is_cuda() || x.is_cpu(), op, ": ", name, " must be a CPU or CUDA tensor; got ",
           x.device());
}

void check_table(const at::Tensor& x, const at::Device& device, at::ScalarType type,
                 int64_t numel, const char* op, const char* name) {
  check_placed(x, device, op, name);
  NT_CHECK(x.scalar_type() == type, op, ": ", name, " must be ", type, "; got ", x.scalar_type());
  NT_CHECK(numel < 0 || x.numel() == numel, op, ": ", name, " must have ", numel,
           " elements; got ", x.numel());
}

// A flat buffer matching `params` in dtype and length.
void check_state(const at::Tensor& x, const at::Tensor& params, const char* op,
                 const char* name) {
  check_placed(x, params.device(), op, name);
  NT_CHECK(x.scalar_type() == params.scalar_type() && x.numel() == params.numel(), op, ": ",
           name, " must match params (", params.numel(), " elements of ", params.scalar_type(),
           "); got ", x.numel(), " elements of ", x.scalar_type());
}

// The update tables, checked against the buffers they describe.
UpdateTables update_tables(const at::Tensor& params, const at::Tensor& chunks,
                           const at::Tensor& hyper, const at::Tensor& control, const char* op) {
  const at::Device device = params.device();
  check_table(chunks, device, at::kLong, -1, op, "chunks");
  NT_CHECK(chunks.dim() == 2 && chunks.size(1) == kChunkColumns, op, ": chunks must be [",
           "num_chunks, ", int(kChunkColumns), "]; got ", chunks.sizes());
  check_table(hyper, device, at::kFloat, -1, op, "hyper");
  NT_CHECK(hyper.dim() == 2 && hyper.size(1) == kHyperColumns, op, ": hyper must be [",
           "num_groups, ", int(kHyperColumns), "]; got ", hyper.sizes());
  check_table(control, device, at::kFloat, kControlSize, op, "control");
  return {chunks.const_data_ptr<int64_t>(), chunks.size(0), hyper.const_data_ptr<float>(),
          control.const_data_ptr<float>()};
}

FlatBuffers flat_buffers(const at::Tensor& params, const at::Tensor& grads,
                         std::initializer_list<const at::Tensor*> state, const char* op) {
  check_placed(params, params.device(), op, "params");
  check_state(grads, params, op, "grads");
  FlatBuffers b;
  b.param = params.data_ptr();
  b.grad = grads.const_data_ptr();
  b.dtype = kernel_dtype(params, op, "params");
  b.numel = params.numel();
  int k = 0;
  for (const at::Tensor* s : state) {
    if (s != nullptr) {
      check_state(*s, params, op, "a state buffer");
      b.state[k] = s->data_ptr();
    }
    ++k;
  }
  return b;
}

#if !NT_HAVE_CUDA
[[noreturn]] void no_cuda(const char* op) {
  NT_FAIL(op, ": the tensors are on CUDA, but nimble_train was built without CUDA (",
          NT_CUDA_REASON, "). Rebuild it: pip install --no-build-isolation -e .");
}
#endif

}  // namespace

std::tuple<at::Tensor, at::Tensor> make_chunk_table(const at::Tensor& offsets,
                                                     const at::Tensor& tensor_group,
                                                     int64_t chunk_elems) {
  const char* op = "build_chunk_table";
  const at::Device cpu(at::kCPU);
  check_table(offsets, cpu, at::kLong, -1, op, "offsets");
  NT_CHECK(offsets.dim() == 1 && offsets.numel() >= 1, op,
           ": offsets must be [num_tensors + 1]; got sizes ", offsets.sizes());
  const int64_t num_tensors = offsets.numel() - 1;
  check_table(tensor_group, cpu, at::kLong, num_tensors, op, "tensor_group");
  NT_CHECK(chunk_elems > 0 && chunk_elems % 8 == 0, op,
           ": chunk_elems must be a positive multiple of 8 (16-byte aligned chunks); got ",
           chunk_elems);
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tensors; ++t) {
    NT_CHECK(off[t] <= off[t + 1] && off[t] >= 0, op, ": offsets must be non-decreasing from 0;",
             " got offsets[", t, "] = ", off[t], ", offsets[", t + 1, "] = ", off[t + 1]);
  }
  std::vector<int64_t> first;
  std::vector<int64_t> table = optim::build_chunk_table(
      off, tensor_group.const_data_ptr<int64_t>(), num_tensors, chunk_elems, &first);
  const int64_t num_chunks = static_cast<int64_t>(table.size()) / kChunkColumns;
  at::Tensor chunks = at::empty({num_chunks, kChunkColumns}, at::kLong);
  std::copy(table.begin(), table.end(), chunks.data_ptr<int64_t>());
  at::Tensor first_chunk = at::empty({num_tensors + 1}, at::kLong);
  std::copy(first.begin(), first.end(), first_chunk.data_ptr<int64_t>());
  return {chunks, first_chunk};
}

int64_t grad_stats_partial_rows(int64_t n) {
  NT_CHECK(n >= 0, "grad_stats_partial_rows: element count must be >= 0; got ", n);
  return optim::grad_stats_rows(n);
}

void grad_stats_(const at::Tensor& grads, const std::optional<at::Tensor>& inv_scale,
                 const at::Tensor& partials) {
  const char* op = "grad_stats_";
  check_placed(grads, grads.device(), op, "grads");
  const DType dtype = kernel_dtype(grads, op, "grads");
  const int64_t rows = optim::grad_stats_rows(grads.numel());
  check_table(partials, grads.device(), at::kFloat, 2 * rows, op, "partials");
  const float* s = nullptr;
  if (inv_scale) {
    check_table(*inv_scale, grads.device(), at::kFloat, 1, op, "inv_scale");
    s = inv_scale->const_data_ptr<float>();
  }
  float* out = partials.data_ptr<float>();
  if (grads.is_cuda()) {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(grads.device());
    grad_stats_cuda(grads.const_data_ptr(), dtype, grads.numel(), s, out,
                    c10::cuda::getCurrentCUDAStream());
    return;
#else
    no_cuda(op);
#endif
  }
  dispatch_dtype(dtype, [&](auto traits) {
    using Traits = decltype(traits);
    grad_stats_reference<Traits>(
        static_cast<const typename Traits::Storage*>(grads.const_data_ptr()), grads.numel(), s,
        out);
  });
}

void prepare_step_(const StepTables& tables, const std::optional<at::Tensor>& partials,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf, double max_norm,
                   bool skip_nonfinite) {
  const char* op = "prepare_step_";
  const at::Device device = tables.hyper.device();
  check_table(tables.hyper, device, at::kFloat, -1, op, "hyper");
  NT_CHECK(tables.hyper.dim() == 2 && tables.hyper.size(1) == kHyperColumns, op,
           ": hyper must be [num_groups, ", int(kHyperColumns), "]; got ", tables.hyper.sizes());
  const int64_t num_groups = tables.hyper.size(0);
  check_table(tables.staged, device, at::kFloat, num_groups * kNumStagedHyper, op, "staged");
  check_table(tables.param_steps, device, at::kFloat, -1, op, "param_steps");
  const int64_t num_params = tables.param_steps.numel();
  check_table(tables.param_group, device, at::kLong, num_params, op, "param_group");
  check_table(tables.control, device, at::kFloat, kControlSize, op, "control");

  PrepareArgs a;
  if (partials) {
    check_table(*partials, device, at::kFloat, -1, op, "partials");
    NT_CHECK(partials->numel() % 2 == 0, op, ": partials must be [rows, 2]; got ",
             partials->sizes());
    a.partials = partials->const_data_ptr<float>();
    a.num_partials = partials->numel() / 2;
  }
  if (inv_scale) {
    check_table(*inv_scale, device, at::kFloat, 1, op, "inv_scale");
    a.inv_scale = inv_scale->const_data_ptr<float>();
  }
  if (found_inf) {
    check_table(*found_inf, device, at::kFloat, 1, op, "found_inf");
    a.found_inf = found_inf->data_ptr<float>();
  }
  NT_CHECK(std::isfinite(max_norm), op, ": max_norm must be finite (<= 0: no clipping); got ",
           max_norm);
  a.max_norm = static_cast<float>(max_norm);
  a.skip_nonfinite = skip_nonfinite;
  a.staged = tables.staged.const_data_ptr<float>();
  a.hyper = tables.hyper.data_ptr<float>();
  a.num_groups = num_groups;
  a.param_steps = tables.param_steps.data_ptr<float>();
  a.param_group = tables.param_group.const_data_ptr<int64_t>();
  a.num_params = num_params;
  a.control = tables.control.data_ptr<float>();

  if (device.is_cuda()) {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(device);
    prepare_step_cuda(a, c10::cuda::getCurrentCUDAStream());
    return;
#else
    no_cuda(op);
#endif
  }
  prepare_step_reference(a);
}

void sgd_update_(const at::Tensor& params, const at::Tensor& grads,
                 const std::optional<at::Tensor>& momentum, const at::Tensor& chunks,
                 const at::Tensor& hyper, const at::Tensor& control) {
  const char* op = "sgd_update_";
  const FlatBuffers b =
      flat_buffers(params, grads, {momentum ? &*momentum : nullptr}, op);
  const UpdateTables t = update_tables(params, chunks, hyper, control, op);
  if (params.is_cuda()) {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(params.device());
    sgd_update_cuda(b, t, c10::cuda::getCurrentCUDAStream());
    return;
#else
    no_cuda(op);
#endif
  }
  dispatch_dtype(b.dtype, [&](auto traits) { sgd_update_reference<decltype(traits)>(b, t); });
}

void adam_update_(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                  const at::Tensor& chunks, const at::Tensor& hyper, const at::Tensor& control) {
  const char* op = "adam_update_";
  const bool amsgrad = max_exp_avg_sq.has_value();
  const FlatBuffers b = flat_buffers(
      params, grads, {&exp_avg, &exp_avg_sq, amsgrad ? &*max_exp_avg_sq : nullptr}, op);
  const UpdateTables t = update_tables(params, chunks, hyper, control, op);
  if (params.is_cuda()) {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(params.device());
    adam_update_cuda(b, t, amsgrad, c10::cuda::getCurrentCUDAStream());
    return;
#else
    no_cuda(op);
#endif
  }
  dispatch_dtype(b.dtype, [&](auto traits) {
    if (amsgrad) {
      adam_update_reference<decltype(traits), true>(b, t);
    } else {
      adam_update_reference<decltype(traits), false>(b, t);
    }
  });
}

void lamb_update_(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& chunks,
                  const at::Tensor& first_chunk, const at::Tensor& hyper,
                  const at::Tensor& control, const at::Tensor& chunk_norms,
                  const at::Tensor& trust, const std::optional<at::Tensor>& sums,
                  LambPasses passes) {
  const char* op = "lamb_update_";
  const FlatBuffers b = flat_buffers(params, grads, {&exp_avg, &exp_avg_sq, nullptr}, op);
  const UpdateTables t = update_tables(params, chunks, hyper, control, op);
  const at::Device device = params.device();
  check_table(first_chunk, device, at::kLong, -1, op, "first_chunk");
  NT_CHECK(first_chunk.numel() >= 1, op, ": first_chunk must be [num_tensors + 1]; got sizes ",
           first_chunk.sizes());
  const int64_t num_tensors = first_chunk.numel() - 1;
  check_table(chunk_norms, device, at::kFloat, 2 * t.num_chunks, op, "chunk_norms");
  check_table(trust, device, at::kFloat, num_tensors, op, "trust");
  LambTables l{first_chunk.const_data_ptr<int64_t>(), num_tensors,
               chunk_norms.data_ptr<float>(), trust.data_ptr<float>()};
  if (passes != LambPasses::kAll) {
    NT_CHECK(sums.has_value(), op, ": the passes of a sharded step need sums, float32 "
             "[num_tensors, 2]; got none");
    check_table(*sums, device, at::kFloat, 2 * num_tensors, op, "sums");
    l.sums = sums->data_ptr<float>();
  }
  if (params.is_cuda()) {
#if NT_HAVE_CUDA
    const c10::cuda::CUDAGuard guard(device);
    lamb_update_cuda(b, t, l, passes, c10::cuda::getCurrentCUDAStream());
    return;
#else
    no_cuda(op);
#endif
  }
  dispatch_dtype(b.dtype,
                 [&](auto traits) { lamb_update_reference<decltype(traits)>(b, t, l, passes); });
}

}  // namespace nimble_train::optim
