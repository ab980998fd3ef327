// A program using volt as a user would: fits a linear model and checks that the loss fell. It also removes a
// folder tree with std::filesystem, which crashes when the program's link line lets pip's LibTorch own those
// calls (volt::volt puts libstdc++ first; see docs/install.md).
#include <torch/torch.h>
#include <volt/volt.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include <unistd.h>

struct Lin : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  Lin() { lin = register_module("lin", torch::nn::Linear(2, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return torch::mse_loss(lin(b.data), b.target);
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.1); }
};

int main() {
  torch::manual_seed(0);
  auto x = torch::randn({64, 2});
  auto y = x.sum(1, true);
  Lin m;
  const double before = torch::mse_loss(m.lin(x), y).item<double>();
  volt::data::TensorLoader loader(x, y, {.batch_size = 16});
  volt::Trainer<> trainer({.max_epochs = 20});
  trainer.fit(m, loader);
  const double after = torch::mse_loss(m.lin(x), y).item<double>();
  std::cout << "volt " << volt::version_string << ": loss " << before << " -> " << after << "\n";
  const auto dir = std::filesystem::temp_directory_path() / ("volt_consumer_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "f") << "x";
  std::cout << "removed " << std::filesystem::remove_all(dir) << " entries\n";
  return after < 0.01 * before ? 0 : 1;
}
