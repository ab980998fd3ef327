// volt::optim against torch::optim: the same MLP (784-256-256-10, batch 128, as the design's benchmark), the same
// batches, one process, rounds interleaved (torch, volt, torch, volt, ...). Two figures per algorithm: whole
// training steps (forward, backward, step) and the optimizer step alone. Prints one JSON line per algorithm and
// figure with the median steps/s of each and their ratio (volt / torch; goal: >= 1 on the CPU).
//   optim [--rounds 7] [--steps 100] [--warmup 10] [--device cpu|cuda]

#include <torch/torch.h>
#include <volt/optim.hpp>

#include "common.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

using volt_bench::median;

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  MlpImpl() {
    torch::manual_seed(0);
    a = register_module("a", torch::nn::Linear(784, 256));
    b = register_module("b", torch::nn::Linear(256, 256));
    c = register_module("c", torch::nn::Linear(256, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return c(torch::relu(b(torch::relu(a(x))))); }
};
TORCH_MODULE(Mlp);

using Make = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

struct Algorithm {
  std::string name;
  Make torch_optim, volt_optim;
};

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

/// Steps per second over `steps` steps; `whole`: forward, backward and step; otherwise the step alone on fixed
/// gradients.
double rate(Mlp& net, torch::optim::Optimizer& opt, const torch::Tensor& x, const torch::Tensor& y, int steps,
            bool whole) {
  const auto device = x.device();
  auto one = [&] {
    if (whole) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net(x), y).backward();
    }
    opt.step();
  };
  sync(device);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) one();
  sync(device);
  return steps / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 7, steps = 100, warmup = 10;
  std::string device_name = "cpu";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--rounds") {
      rounds = std::stoi(next());
    } else if (a == "--steps") {
      steps = std::stoi(next());
    } else if (a == "--warmup") {
      warmup = std::stoi(next());
    } else if (a == "--device") {
      device_name = next();
    } else {
      std::cerr << "optim: unknown argument " << a << "; allowed: --rounds N --steps N --warmup N --device cpu|cuda\n";
      return 2;
    }
  }
  if (device_name != "cpu" && device_name != "cuda") {
    std::cerr << "optim: --device " << device_name << " is not one of cpu, cuda\n";
    return 2;
  }
  if (device_name == "cuda" && !torch::cuda::is_available()) {
    std::cerr << "optim: --device cuda, but no CUDA device is available\n";
    return 77;
  }
  const torch::Device device(device_name);
  using namespace torch::optim;
  const std::vector<Algorithm> algorithms = {
      {"adam", [](auto p) { return std::make_unique<Adam>(p, AdamOptions(1e-3)); },
       [](auto p) { return std::make_unique<volt::optim::Adam>(p, AdamOptions(1e-3)); }},
      {"adamw", [](auto p) { return std::make_unique<AdamW>(p, AdamWOptions(1e-3)); },
       [](auto p) { return std::make_unique<volt::optim::AdamW>(p, AdamWOptions(1e-3)); }},
      {"sgd_momentum", [](auto p) { return std::make_unique<SGD>(p, SGDOptions(0.01).momentum(0.9)); },
       [](auto p) { return std::make_unique<volt::optim::SGD>(p, SGDOptions(0.01).momentum(0.9)); }},
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const auto x = torch::randn({128, 784}, gen).to(device);
  const auto y = torch::randint(0, 10, {128}, gen).to(device);
  for (const auto& alg : algorithms) {
    for (bool whole : {true, false}) {
      Mlp tnet, vnet;
      tnet->to(device);
      vnet->to(device);
      auto topt = alg.torch_optim(tnet->parameters());
      auto vopt = alg.volt_optim(vnet->parameters());
      if (!whole) {  // fixed gradients for the step alone
        for (auto* n : {&tnet, &vnet}) torch::nn::functional::cross_entropy((*n)(x), y).backward();
      }
      rate(tnet, *topt, x, y, warmup, whole);
      rate(vnet, *vopt, x, y, warmup, whole);
      std::vector<double> t, v, ratios;
      for (int r = 0; r < rounds; ++r) {
        t.push_back(rate(tnet, *topt, x, y, steps, whole));
        v.push_back(rate(vnet, *vopt, x, y, steps, whole));
        ratios.push_back(v.back() / t.back());
      }
      std::cout << "{\"bench\":\"optim\"" << volt_bench::blas_field() << ",\"algorithm\":\"" << alg.name
                << "\",\"figure\":\"" << (whole ? "training_step" : "optimizer_step") << "\",\"device\":\""
                << device_name << "\",\"libtorch\":\"" << TORCH_VERSION
                << "\",\"fused\":" << (volt::optim::has_fused_kernels(device) ? "true" : "false")
                << ",\"torch_steps_per_s\":" << median(t) << ",\"volt_steps_per_s\":" << median(v)
                << ",\"ratio\":" << median(v) / median(t) << ",\"median_of_round_ratios\":" << median(ratios)
                << ",\"rounds\":" << rounds << ",\"steps\":" << steps << "}" << std::endl;
    }
  }
}
