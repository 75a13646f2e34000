// StaticInputs: the buffers a captured step reads its batch from, shaped and laid out like the
// first batch's tensors; each later batch is checked against them and copied in.
//
// A batch with fewer samples than the first (a short last batch) fills the leading rows of the
// batched leaves (dimension 0); the other rows keep an earlier batch's samples, which are real,
// finite data, and the step masks them out of the loss. A leaf with a varying dimension (a
// shape bucket's sequence length) may be shorter there than its buffer: it fills the leading
// positions and the rest of each row is set to the leaf's pad value (attention mask 0, label
// -100), which the model masks. Checks raise BatchMismatch with a message that names the leaf,
// what was expected, what was seen and the fix.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace nimble_train::capture {

// A batch that does not fit the template (ShapeError in Python).
class BatchMismatch : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// One tensor leaf of the batch, as the first batch fixed it.
struct LeafSpec {
  std::string path;              // where it sits in the batch, e.g. "batch[0]", "batch['ids']"
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // the static buffer's layout (channels_last stays so)
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  bool batched = false;          // dimension 0 is the batch
  int64_t vary_dim = -1;         // a dimension that may be shorter than `sizes` (-1: none)
  double pad_value = 0;          // what fills the rest of `vary_dim`
};

class StaticInputs {
 public:
  explicit StaticInputs(std::vector<LeafSpec> specs);  // allocates the buffers

  // The number of samples in `leaves` (the tensor leaves of a batch, in template order), or
  // BatchMismatch. A batch without batched leaves has batch_size() samples. Every leaf with a
  // varying dimension must have the same length there, at least 1 and at most the buffer's.
  int64_t check(const std::vector<at::Tensor>& leaves) const;
  // Copies checked leaves in on the current stream. fill_padding: rows past `samples` get
  // copies of the first sample (for the first batch, whose padding holds nothing yet). Leaves
  // shorter along their varying dimension are padded with their pad value there.
  void copy_in(const std::vector<at::Tensor>& leaves, int64_t samples, bool fill_padding = false);

  const std::vector<at::Tensor>& buffers() const { return buffers_; }
  const std::vector<LeafSpec>& specs() const { return specs_; }
  int64_t batch_size() const { return batch_size_; }

 private:
  std::vector<LeafSpec> specs_;
  std::vector<at::Tensor> buffers_;
  int64_t batch_size_ = 0;
};

// "torch.float32", as Python prints a dtype (messages speak the user's language).
std::string torch_dtype_name(at::ScalarType dtype);
// A shape as Python prints a tuple: (8, 12), (8,), ().
std::string tuple_text(at::IntArrayRef sizes);

}  // namespace nimble_train::capture
