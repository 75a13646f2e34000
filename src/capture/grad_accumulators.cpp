#include "capture/grad_accumulators.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/input_metadata.h>
#include <torch/csrc/autograd/variable.h>

#include "common/check.h"

namespace nimble_train::capture {

int64_t bind_grad_accumulators(const std::vector<at::Tensor>& leaves) {
  int64_t rebound = 0;
  for (const at::Tensor& leaf : leaves) {
    NT_CHECK(leaf.defined() && leaf.is_leaf(), "bind_grad_accumulators takes leaf tensors (the "
             "parameters a step trains); got ", leaf.defined() ? "a non-leaf tensor" :
             "an undefined tensor");
    const auto node = torch::autograd::impl::try_get_grad_accumulator(leaf);
    if (!node || node->num_inputs() != 1) continue;
    // The node's one input is the leaf's gradient: its metadata made anew from the leaf, as
    // the node's constructor makes it, carries the current stream.
    if (node->input_metadata(0).stream() == torch::autograd::InputMetadata(leaf).stream()) {
      continue;
    }
    node->clear_input_metadata();
    node->add_input_metadata(leaf);
    ++rebound;
  }
  return rebound;
}

}  // namespace nimble_train::capture
