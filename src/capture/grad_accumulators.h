// Gradient accumulation bound to the stream a capture runs on.
//
// Autograd accumulates a leaf's gradient (AccumulateGrad) on the stream recorded in its
// accumulator node when that node was made: the stream the first forward to use the leaf ran
// on. The node is cached on the leaf for as long as any graph holds it, so an autograd graph
// that outlives its step (a loss kept without .detach(), a failed capture's frames) keeps
// every later step's accumulation on that old stream. Inside a capture on another stream
// that breaks it: the legacy default stream cannot wait on a capturing one ("operation would
// make the legacy stream depend on a capturing blocking stream"), and a side stream outside
// the capture cannot join it ("dependency created on uncaptured work in another stream").
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace nimble_train::capture {

// Binds the accumulator node of each leaf that has one alive to the current stream of its
// device, as if that node were made now (a leaf without one gets its node, on the current
// stream, from the forward that uses it first). Returns how many were bound to another
// stream before. Makes no node and launches nothing.
int64_t bind_grad_accumulators(const std::vector<at::Tensor>& leaves);

}  // namespace nimble_train::capture
