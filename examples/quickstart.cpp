// Quick start: a small CNN on Fashion-MNIST with volt's Trainer.
//   quickstart [--epochs N] [--fast-dev-run] [--data-dir DIR] [--out DIR]
// Trains, validates on the test split each epoch, shows a progress bar, writes metrics.csv and prints the
// final test accuracy.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "fashion_mnist.hpp"

#include <cstring>
#include <iostream>
#include <string>

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

int main(int argc, char** argv) try {
  int64_t epochs = 3;
  bool fast_dev_run = false;
  std::string data_dir = fashion_mnist::default_dir, out_dir = ".";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--epochs" && i + 1 < argc) {
      epochs = std::stoll(argv[++i]);
    } else if (a == "--fast-dev-run") {
      fast_dev_run = true;
    } else if (a == "--data-dir" && i + 1 < argc) {
      data_dir = argv[++i];
    } else if (a == "--out" && i + 1 < argc) {
      out_dir = argv[++i];
    } else {
      std::cerr << "usage: quickstart [--epochs N] [--fast-dev-run] [--data-dir DIR] [--out DIR]\n";
      return 2;
    }
  }

  const auto [train_x, train_y] = fashion_mnist::load(data_dir, /*train=*/true);
  const auto [test_x, test_y] = fashion_mnist::load(data_dir, /*train=*/false);
  volt::data::TensorLoader train(train_x, train_y, {.batch_size = 128, .shuffle = true, .seed = 42});
  volt::data::TensorLoader test(test_x, test_y, {.batch_size = 256});

  Net net(epochs);
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      {.max_epochs = epochs, .fast_dev_run = fast_dev_run, .seed = 42, .log_every_n_steps = 50,
       .default_root_dir = out_dir},
      volt::ProgressBar{}, volt::CSVLogger{}, volt::LearningRateMonitor{});

  const auto start = std::chrono::steady_clock::now();
  trainer.fit(net, train, test);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto metrics = trainer.test(net, test);

  std::cout << "training took " << seconds << " s\n";
  std::cout << "test accuracy: " << metrics.at("test_acc") * 100.0 << "%\n";
  if (!fast_dev_run) std::cout << "metrics: " << trainer.callback<volt::CSVLogger>().metrics_file().string() << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "quickstart: " << e.what() << "\n";
  return 1;
}
