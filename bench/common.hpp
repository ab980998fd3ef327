#pragma once
// What the benchmarks share: the median of rounds, and the MLP 784-W-W-10 of the loader and ZeRO benchmarks (each
// derives it with its optimizer).
#include <torch/torch.h>
#include <volt/volt.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace volt_bench {

/// The median (the mean of the middle two for an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// 784 -> width -> width -> 10 with ReLU, seeded; cross entropy. The derived module adds configure_optimizers.
struct WideMlp : torch::nn::Module {
  torch::nn::Sequential net{nullptr};
  explicit WideMlp(int64_t width) {
    torch::manual_seed(0);
    net = register_module("net", torch::nn::Sequential(torch::nn::Linear(784, width), torch::nn::ReLU(),
                                                       torch::nn::Linear(width, width), torch::nn::ReLU(),
                                                       torch::nn::Linear(width, 10)));
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
  }
};

}  // namespace volt_bench
