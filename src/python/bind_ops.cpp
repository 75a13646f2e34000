// Bindings for src/ops: kernels the step swaps in for torch's where they give the same results.
#include <torch/csrc/utils/pybind.h>

#include "ops/boundary.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nimble_train {

void bind_ops(py::module_& m) {
  m.def("max_pool2d_forward", &ops::max_pool2d_forward, py::arg("x"), py::arg("kernel"),
        py::arg("stride"), py::arg("padding"), py::arg("ceil_mode"),
        py::call_guard<py::gil_scoped_release>(),
        "Max-pooling of a channels-last [N, C, H, W] tensor (float32/16, bfloat16), dilation 1: "
        "(y, argmax), y as torch.nn.functional.max_pool2d gives it, argmax uint8 window codes "
        "for max_pool2d_backward. kernel, stride, padding: (h, w).");
  m.def("max_pool2d_backward", &ops::max_pool2d_backward, py::arg("grad_y"), py::arg("argmax"),
        py::arg("input_size"), py::arg("kernel"), py::arg("stride"), py::arg("padding"),
        py::arg("ceil_mode"), py::call_guard<py::gil_scoped_release>(),
        "The input's gradient of max_pool2d_forward, channels-last: the same values, bit for "
        "bit, as torch's backward of max_pool2d on CUDA.");
  m.def("small_conv2d_forward", &ops::small_conv2d_forward, py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("stride"), py::arg("padding"), py::arg("dilation"),
        py::call_guard<py::gil_scoped_release>(),
        "A 2-D convolution of at most 32 input channels x kernel positions and 256 output "
        "channels (groups 1; x, weight and bias of one dtype, any layout): y, channels-last. "
        "stride, padding, dilation: (h, w).");
  m.def("small_conv2d_weight_grad", &ops::small_conv2d_weight_grad, py::arg("grad_y"),
        py::arg("x"), py::arg("weight_like"), py::arg("stride"), py::arg("padding"),
        py::arg("dilation"), py::arg("with_bias"), py::call_guard<py::gil_scoped_release>(),
        "(grad_weight, grad_bias) of small_conv2d_forward, in weight_like's dtype and layout; "
        "grad_bias None unless with_bias.");
  m.def("batch_norm_stats", &ops::batch_norm_stats, py::arg("x"), py::arg("eps"),
        py::arg("early") = true, py::call_guard<py::gil_scoped_release>(),
        "(mean, invstd) of a channels-last [N, C, H, W] x, as torch.batch_norm_stats(x, eps) "
        "gives them: sums of x minus each channel's first value and of their squares, in two "
        "kernels on CUDA, deterministic. early (here and in the two below): on CUDA, each "
        "kernel may start while the one before it on the stream ends (programmatic dependent "
        "launch), with the same results.");
  m.def("batch_norm_relu_forward", &ops::batch_norm_relu_forward, py::arg("x"), py::arg("mean"),
        py::arg("invstd"), py::arg("weight"), py::arg("bias"), py::arg("residual"),
        py::arg("running_mean"), py::arg("running_var"), py::arg("momentum"), py::arg("eps"),
        py::arg("gelu") = false, py::arg("mask") = false, py::arg("early") = true,
        py::call_guard<py::gil_scoped_release>(),
        "(y, mask): y = relu(weight * (x - mean) * invstd + bias [+ residual]) (gelu: the exact "
        "GELU, no residual) for a channels-last [N, C, H, W] x (float32/16, bfloat16; mean and "
        "invstd from torch.batch_norm_stats, the rest float32 [C]), in one pass; running_mean "
        "and running_var (both or None) updated in place as a training batch norm does. mask "
        "(the ReLU only; else None): int32 words, bit i % 32 of word i / 32 set where y's "
        "element i (channels-last order) is not <= 0, for batch_norm_relu_backward.");
  m.def("batch_norm_relu_backward", &ops::batch_norm_relu_backward, py::arg("grad_y"),
        py::arg("y"), py::arg("x"), py::arg("mean"), py::arg("invstd"), py::arg("weight"),
        py::arg("bias"), py::arg("input_grad"), py::arg("residual_grad"),
        py::arg("gelu") = false, py::arg("mask") = py::none(), py::arg("early") = true,
        py::call_guard<py::gil_scoped_release>(),
        "(grad_x, grad_residual, grad_weight, grad_bias) of batch_norm_relu_forward from the "
        "output's gradient, the output (None when the forward's mask is given; the GELU needs "
        "neither) and the input: torch's batch-norm backward of the gradient through the ReLU "
        "(or GELU), the per-channel sums deterministic; grad_x and grad_residual None unless "
        "asked for.");
}

}  // namespace nimble_train
