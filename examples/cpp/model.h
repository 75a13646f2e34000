// SmallCnn: the example's model, a small CNN for 3x32x32 images in 10 classes (CIFAR-10's
// shape). Header-only so that bench/cpp/bench_step.cpp times the very same network.
//
// Three 3x3 convolutions and a linear layer, 94,538 parameters; no BatchNorm, so a short
// last batch can be padded inside the captured step (no layer sees the whole batch).
#pragma once

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

struct SmallCnnImpl : torch::nn::Module {
  SmallCnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(
                                           torch::nn::Conv2dOptions(3, 32, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(
                                           torch::nn::Conv2dOptions(32, 64, 3).padding(1)))),
        conv3(register_module("conv3", torch::nn::Conv2d(
                                           torch::nn::Conv2dOptions(64, 128, 3).padding(1)))),
        fc(register_module("fc", torch::nn::Linear(128, 10))) {}

  // x: [batch, 3, 32, 32] images; returns [batch, 10] logits.
  at::Tensor forward(const at::Tensor& x) {
    namespace F = torch::nn::functional;
    at::Tensor h = F::relu(conv1->forward(x));
    h = F::relu(conv2->forward(h));
    h = F::max_pool2d(h, F::MaxPool2dFuncOptions(2));             // [batch, 64, 16, 16]
    h = F::relu(conv3->forward(h));
    h = F::adaptive_avg_pool2d(h, F::AdaptiveAvgPool2dFuncOptions(1));  // [batch, 128, 1, 1]
    return fc->forward(h.flatten(1));
  }

  torch::nn::Conv2d conv1, conv2, conv3;
  torch::nn::Linear fc;
};
TORCH_MODULE(SmallCnn);
