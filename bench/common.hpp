#pragma once
// What the benchmarks share: the BLAS field of their JSON lines, the median of rounds, and the MLP (784-W-W-10 by
// default) of the loader and ZeRO benchmarks (each derives it with its optimizer).
#include <torch/torch.h>
#include <volt/volt.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace volt_bench {

/// `,"blas":"<name>"`: the BLAS LibTorch's matrix products ran on (volt::blas_info()), a field of every JSON line,
/// so that a CPU figure says whether it was measured on the reference BLAS.
inline std::string blas_field() { return ",\"blas\":\"" + volt::blas_info().name + "\""; }

/// The median (the mean of the middle two for an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// An MLP with ReLU, seeded; cross entropy. The derived module adds configure_optimizers.
struct WideMlp : torch::nn::Module {
  torch::nn::Sequential net{nullptr};
  /// 784 -> width (-> width, hidden - 1 times) -> 10, ReLU between.
  explicit WideMlp(int64_t width, int hidden = 2) {
    torch::manual_seed(0);
    torch::nn::Sequential layers(torch::nn::Linear(784, width), torch::nn::ReLU());
    for (int i = 1; i < hidden; ++i) {
      layers->push_back(torch::nn::Linear(width, width));
      layers->push_back(torch::nn::ReLU());
    }
    layers->push_back(torch::nn::Linear(width, 10));
    net = register_module("net", layers);
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
  }
};

}  // namespace volt_bench
