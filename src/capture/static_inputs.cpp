// StaticInputs: checks and copy-in (see static_inputs.h).
#include "capture/static_inputs.h"

#include <ATen/ops/empty_strided.h>

#include <cctype>
#include <sstream>

#include "common/check.h"
#include "nimble_train/build_config.h"

#if NT_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

namespace nimble_train::capture {
namespace {

const char* const kFix =
    "The first batch fixed the template; pad or bucket inputs to that shape (a shorter last "
    "batch is handled), or build a Step per shape.";

std::string describe(const at::Tensor& t) {
  return "a tensor of shape " + tuple_text(t.sizes()) + ", " + torch_dtype_name(t.scalar_type()) +
         ", on " + t.device().str();
}

std::string expected(const LeafSpec& spec) {
  std::ostringstream shape;
  shape << "(";
  for (size_t i = 0; i < spec.sizes.size(); ++i) {
    shape << (i ? ", " : "");
    if (i == 0 && spec.batched) shape << "N<=";
    if (static_cast<int64_t>(i) == spec.vary_dim) shape << "L<=";
    shape << spec.sizes[i];
  }
  shape << ")";  // as the template's message always read: (N<=8), (5), (); a bucket: (N<=8, L<=128)
  return "a tensor of shape " + shape.str() + ", " + torch_dtype_name(spec.dtype) + ", on " +
         spec.device.str();
}

// The leaf's sizes equal the spec's, except dimension 0 of a batched leaf and the varying
// dimension (both checked by the caller).
bool same_fixed_sizes(const LeafSpec& spec, at::IntArrayRef sizes) {
  if (sizes.size() != spec.sizes.size()) return false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    const bool free = (d == 0 && spec.batched) || static_cast<int64_t>(d) == spec.vary_dim;
    if (!free && sizes[d] != spec.sizes[d]) return false;
  }
  return true;
}

[[noreturn]] void mismatch(const std::string& message) { throw BatchMismatch(message); }

// Leaf and buffer (or its leading rows) are laid out alike and densely: one memcpy copies it.
bool same_dense_layout(const at::Tensor& dst, const at::Tensor& src) {
  return dst.scalar_type() == src.scalar_type() && dst.sizes() == src.sizes() &&
         dst.strides() == src.strides() && dst.is_non_overlapping_and_dense() &&
         src.is_non_overlapping_and_dense();
}

void copy(const at::Tensor& dst, const at::Tensor& src) {
#if NT_HAVE_CUDA
  // On one CUDA device, a dense copy is one cudaMemcpyAsync on the current stream: what copy_
  // does, without the dispatcher's cost on every launch of a small step.
  if (dst.is_cuda() && src.is_cuda() && dst.device() == src.device() &&
      same_dense_layout(dst, src)) {
    const c10::cuda::CUDAGuard guard(dst.device());
    NT_CHECK_CUDA(cudaMemcpyAsync(dst.data_ptr(), src.const_data_ptr(), dst.nbytes(),
                                  cudaMemcpyDeviceToDevice, c10::cuda::getCurrentCUDAStream()));
    return;
  }
#endif
  dst.copy_(src, /*non_blocking=*/true);
}

// dst[..., :L, ...] = src and dst[..., L:, ...] = pad along `dim`, L = src.size(dim). When
// both are contiguous on one CUDA device, that is one 2-D copy (rows of L positions into rows
// of the buffer's length) and, for a zero pad, one 2-D memset: no dispatcher on the launch path.
void copy_padded(const at::Tensor& dst, const at::Tensor& src, int64_t dim, double pad) {
  const int64_t length = src.size(dim);
#if NT_HAVE_CUDA
  if (dst.is_cuda() && src.is_cuda() && dst.device() == src.device() &&
      dst.scalar_type() == src.scalar_type() && dst.is_contiguous() && src.is_contiguous()) {
    int64_t rows = 1;
    for (int64_t d = 0; d < dim; ++d) rows *= dst.size(d);
    const size_t inner = static_cast<size_t>(dst.stride(dim)) * dst.element_size();
    const size_t width = static_cast<size_t>(length) * inner;
    const size_t pitch = static_cast<size_t>(dst.size(dim)) * inner;
    const c10::cuda::CUDAGuard guard(dst.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    auto* base = static_cast<char*>(dst.data_ptr());
    NT_CHECK_CUDA(cudaMemcpy2DAsync(base, pitch, src.const_data_ptr(), width, width,
                                    static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream));
    if (pad == 0) {
      NT_CHECK_CUDA(cudaMemset2DAsync(base + width, pitch, 0, pitch - width,
                                      static_cast<size_t>(rows), stream));
    } else {
      dst.narrow(dim, length, dst.size(dim) - length).fill_(pad);
    }
    return;
  }
#endif
  dst.narrow(dim, 0, length).copy_(src, /*non_blocking=*/true);
  dst.narrow(dim, length, dst.size(dim) - length).fill_(pad);
}

}  // namespace

std::string tuple_text(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << (sizes.size() == 1 ? ",)" : ")");
  return os.str();
}

std::string torch_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: break;
  }
  std::string name = c10::toString(dtype);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return "torch." + name;
}

StaticInputs::StaticInputs(std::vector<LeafSpec> specs) : specs_(std::move(specs)) {
  buffers_.reserve(specs_.size());
  for (const LeafSpec& spec : specs_) {
    NT_CHECK(spec.sizes.size() == spec.strides.size(), "StaticInputs: ", spec.path, " has ",
             spec.sizes.size(), " sizes but ", spec.strides.size(), " strides");
    NT_CHECK(!spec.batched || !spec.sizes.empty(), "StaticInputs: ", spec.path,
             " is batched but has no dimension");
    NT_CHECK(spec.vary_dim == -1 ||
             (spec.vary_dim >= 1 && spec.vary_dim < static_cast<int64_t>(spec.sizes.size())),
             "StaticInputs: ", spec.path, " varies along dimension ", spec.vary_dim,
             ", which is not one of its dimensions 1..", spec.sizes.size() - 1);
    if (spec.batched) {
      NT_CHECK(batch_size_ == 0 || batch_size_ == spec.sizes[0], "StaticInputs: batched leaves ",
               "disagree on the batch size (", batch_size_, " and ", spec.sizes[0], " at ",
               spec.path, ")");
      batch_size_ = spec.sizes[0];
    }
    const auto options = at::TensorOptions().dtype(spec.dtype).device(spec.device);
    buffers_.push_back(at::empty_strided(spec.sizes, spec.strides, options));
  }
}

int64_t StaticInputs::check(const std::vector<at::Tensor>& leaves) const {
  NT_CHECK(leaves.size() == specs_.size(), "StaticInputs.check: expected ", specs_.size(),
           " tensor leaves; got ", leaves.size());
  int64_t samples = -1;
  const LeafSpec* first_varying = nullptr;  // the leaf that set the varying length
  int64_t length = -1;
  for (size_t i = 0; i < specs_.size(); ++i) {
    const LeafSpec& spec = specs_[i];
    const at::Tensor& t = leaves[i];
    if (!t.defined()) mismatch(spec.path + " must be " + expected(spec) + "; got None");
    if (t.scalar_type() != spec.dtype || t.device() != spec.device) {
      mismatch(spec.path + " must be " + expected(spec) + "; got " + describe(t) + ". " + kFix);
    }
    const at::IntArrayRef sizes = t.sizes();
    if (!same_fixed_sizes(spec, sizes)) {
      mismatch(spec.path + " must be " + expected(spec) + "; got " + describe(t) + ". " + kFix);
    }
    if (spec.vary_dim >= 0) {
      const int64_t d = spec.vary_dim;
      if (first_varying != nullptr && sizes[d] != length) {
        mismatch(spec.path + " has length " + std::to_string(sizes[d]) + " along dimension " +
                 std::to_string(d) + " but " + first_varying->path + " has " +
                 std::to_string(length) + "; every entry that varies along dimension " +
                 std::to_string(d) + " must have the same length (pad them together).");
      }
      if (sizes[d] < 1 || sizes[d] > spec.sizes[d]) {
        mismatch(spec.path + " has length " + std::to_string(sizes[d]) + " along dimension " +
                 std::to_string(d) + "; this bucket holds 1 to " + std::to_string(spec.sizes[d]) +
                 " (got " + describe(t) + ").");
      }
      first_varying = first_varying ? first_varying : &spec;
      length = sizes[d];
    }
    if (!spec.batched) continue;
    if (sizes[0] > spec.sizes[0]) {
      mismatch(spec.path + " has " + std::to_string(sizes[0]) + " samples, more than the " +
               std::to_string(spec.sizes[0]) + " of the first batch; got " + describe(t) +
               ". Use the same batch size throughout (the first batch must be a full one), or "
               "build a Step for the larger size.");
    }
    if (sizes[0] < 1) {
      mismatch(spec.path + " must be " + expected(spec) + "; got " + describe(t) + ". " + kFix);
    }
    if (samples >= 0 && sizes[0] != samples) {
      mismatch(spec.path + " has " + std::to_string(sizes[0]) + " samples but an earlier entry "
               "of the batch has " + std::to_string(samples) + "; all batched entries must "
               "agree.");
    }
    samples = sizes[0];
  }
  return samples >= 0 ? samples : batch_size_;
}

void StaticInputs::copy_in(const std::vector<at::Tensor>& leaves, int64_t samples,
                           bool fill_padding) {
  NT_CHECK(leaves.size() == specs_.size(), "StaticInputs.copy_in: expected ", specs_.size(),
           " tensor leaves; got ", leaves.size());
  NT_CHECK(samples >= 1 && (batch_size_ == 0 || samples <= batch_size_),
           "StaticInputs.copy_in: samples must be in [1, ", batch_size_, "]; got ", samples);
  for (size_t i = 0; i < specs_.size(); ++i) {
    const LeafSpec& spec = specs_[i];
    const at::Tensor& buffer = buffers_[i];
    const bool short_rows = spec.batched && samples < spec.sizes[0];
    const at::Tensor rows = short_rows ? buffer.narrow(0, 0, samples) : buffer;
    if (spec.vary_dim >= 0 && leaves[i].size(spec.vary_dim) < spec.sizes[spec.vary_dim]) {
      copy_padded(rows, leaves[i], spec.vary_dim, spec.pad_value);
    } else {
      copy(rows, leaves[i]);
    }
    if (short_rows && fill_padding) {
      at::Tensor rest = buffer.narrow(0, samples, spec.sizes[0] - samples);
      rest.copy_(buffer.narrow(0, 0, 1).expand_as(rest), /*non_blocking=*/true);
    }
  }
}

}  // namespace nimble_train::capture
