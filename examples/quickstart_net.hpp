#pragma once
// The quick start's CNN for Fashion-MNIST (28x28 grey images, 10 classes). test/torch_load_check.py
// builds the same network in Python to read its checkpoints.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <memory>

struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{torch::nn::Conv2dOptions(1, 16, 3).padding(1)};
  torch::nn::BatchNorm2d bn1{16};
  torch::nn::Conv2d conv2{torch::nn::Conv2dOptions(16, 32, 3).padding(1)};
  torch::nn::BatchNorm2d bn2{32};
  torch::nn::Linear fc1{32 * 7 * 7, 128};
  torch::nn::Dropout drop{0.3};
  torch::nn::Linear fc2{128, 10};
  int64_t epochs;

  explicit NetImpl(int64_t epochs_) : epochs(epochs_) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    register_module("fc1", fc1);
    register_module("drop", drop);
    register_module("fc2", fc2);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    x = torch::max_pool2d(torch::relu(bn2(conv2(x))), 2);
    x = drop(torch::relu(fc1(x.flatten(1))));
    return fc2(x);
  }

  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto loss = torch::nn::functional::cross_entropy(forward(batch.data), batch.target);
    ctx.log("train_loss", loss, {.prog_bar = true});
    return loss;
  }

  void validation_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto logits = forward(batch.data);
    ctx.log("val_loss", torch::nn::functional::cross_entropy(logits, batch.target));
    ctx.log("val_acc", logits.argmax(1).eq(batch.target).to(torch::kFloat32).mean(), {.prog_bar = true});
  }

  void test_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    ctx.log("test_acc", forward(batch.data).argmax(1).eq(batch.target).to(torch::kFloat32).mean());
  }

  volt::OptimizerConfig configure_optimizers() {
    auto opt = std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(2e-3));
    // One-step-per-epoch decay: the last epochs fine-tune at a lower rate.
    auto sched = std::make_shared<torch::optim::StepLR>(*opt, /*step_size=*/1, /*gamma=*/0.5);
    return {.optimizer = opt, .scheduler = sched, .interval = volt::Interval::epoch};
  }
};
TORCH_MODULE(Net);
