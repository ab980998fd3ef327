// Trainer vs a hand-written LibTorch loop: same model, in-memory batches, optimizer and precision, in one
// process, rounds interleaved (raw, trainer, raw, trainer, ...). Prints one JSON line per case with the median
// step time of each and their ratio (trainer / raw; goal: <= 1.02 on CPU, <= 1.01 on GPU). The cases: a small MLP
// and a CNN with LibTorch's SGD, and an MLP 784-256-256-10 (batch 128) with LibTorch's Adam and with volt::optim::Adam,
// whose fused step is short enough that the Trainer's own cost per step shows; the last once more with the gradients
// zeroed after training_step (Lightning's order, which the Trainer keeps where an on_before_zero_grad hook would see it).
//   trainer_vs_raw [--rounds 7] [--steps 200] [--warmup 20] [--device cpu|cuda] [--case NAME]

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "common.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

using volt_bench::median;

using Batch = torch::data::Example<>;

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(64, 128));
    b = register_module("b", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
};

struct CnnImpl : torch::nn::Module {
  torch::nn::Conv2d c1{nullptr}, c2{nullptr};
  torch::nn::Linear fc{nullptr};
  CnnImpl() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(32 * 7 * 7, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(c1(x)), 2);
    h = torch::max_pool2d(torch::relu(c2(h)), 2);
    return fc(h.flatten(1));
  }
};

struct Mlp784Impl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  Mlp784Impl() {
    a = register_module("a", torch::nn::Linear(784, 256));
    b = register_module("b", torch::nn::Linear(256, 256));
    c = register_module("c", torch::nn::Linear(256, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return c(torch::relu(b(torch::relu(a(x))))); }
};

/// The optimizers of the cases: each makes its optimizer for a set of parameters.
struct Sgd {
  static torch::optim::SGD make(const std::vector<torch::Tensor>& p) {
    return torch::optim::SGD(p, torch::optim::SGDOptions(0.01).momentum(0.9));
  }
};
struct TorchAdam {
  static torch::optim::Adam make(const std::vector<torch::Tensor>& p) {
    return torch::optim::Adam(p, torch::optim::AdamOptions(1e-3));
  }
};
struct FusedAdam {
  static volt::optim::Adam make(const std::vector<torch::Tensor>& p) {
    return volt::optim::Adam(p, torch::optim::AdamOptions(1e-3));
  }
};

/// The model as volt sees it: the same forward, a training step with the same loss, the same optimizer. With
/// `ZeroHook`, an empty on_before_zero_grad, which makes the Trainer zero the gradients after training_step, in
/// Lightning's order (without one it zeroes them first, as the hand loop does): the `_lightning_order` cases.
template <class Net, class Opt, bool ZeroHook = false>
struct Lit : Net {
  torch::Tensor training_step(const Batch& batch, volt::Context&) {
    return torch::nn::functional::cross_entropy(this->forward(batch.data), batch.target);
  }
  auto configure_optimizers() { return Opt::make(this->parameters()); }
  void on_before_zero_grad(torch::optim::Optimizer&)
    requires ZeroHook
  {}
};

/// What the user would write by hand with the same precision: the autocast region, then the usual four lines.
template <class P, class Opt, class Net>
void raw_steps(Net& net, std::vector<Batch>& batches, c10::DeviceType device) {
  auto opt = Opt::make(net.parameters());
  for (auto& batch : batches) {
    opt.zero_grad();
    torch::Tensor loss;
    if constexpr (P::needs_bf16_autocast || P::needs_fp16_autocast) {
      volt::detail::AutocastGuard autocast(device, P::needs_bf16_autocast ? at::kBFloat16 : at::kHalf);
      loss = torch::nn::functional::cross_entropy(net.forward(batch.data), batch.target);
    } else {
      loss = torch::nn::functional::cross_entropy(net.forward(batch.data), batch.target);
    }
    if constexpr (P::needs_fp16_autocast) {
      // the hand-written fp16 loop needs the same loss scaling the precision does
      static thread_local volt::GradScaler scaler;
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
    } else {
      loss.backward();
      opt.step();
    }
  }
}

struct Config {
  int rounds = 7;
  int64_t steps = 200;
  int64_t warmup = 20;
  bool cuda = false;
  /// Only this case (empty: all).
  std::string only;
};

template <class Net, class Opt, class P, class A, bool ZeroHook = false>
void run_case(const char* name, const Config& cfg, std::vector<Batch> batches) {
  if (!cfg.only.empty() && cfg.only != name) return;
  const c10::DeviceType dt = A::device_type;
  Lit<Net, Opt, ZeroHook> raw_net, volt_net;
  raw_net.to(A::device(0));
  volt_net.to(A::device(0));
  using Clock = std::chrono::steady_clock;
  auto sync = [&] { A::synchronize(A::device(0)); };
  std::vector<Batch> warm(batches.begin(), batches.begin() + std::min<int64_t>(cfg.warmup, batches.size()));

  auto time_raw = [&](std::vector<Batch>& b) {
    sync();
    const auto t0 = Clock::now();
    raw_steps<P, Opt>(raw_net, b, dt);
    sync();
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / static_cast<double>(b.size());
  };
  auto time_volt = [&](std::vector<Batch>& b) {
    volt::Trainer<volt::SingleDevice, P, A> trainer({.max_epochs = 1, .num_sanity_val_steps = 0});
    sync();
    const auto t0 = Clock::now();
    trainer.fit(volt_net, b);
    sync();
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / static_cast<double>(b.size());
  };

  time_raw(warm);
  time_volt(warm);
  std::vector<double> raw_ms, volt_ms, ratios;
  for (int r = 0; r < cfg.rounds; ++r) {
    const double a = time_raw(batches);
    const double b = time_volt(batches);
    raw_ms.push_back(a);
    volt_ms.push_back(b);
    ratios.push_back(b / a);
  }
  const double rm = median(raw_ms), vm = median(volt_ms);
  std::cout << "{\"bench\":\"trainer_vs_raw\"" << volt_bench::blas_field() << ",\"case\":\"" << name
            << "\",\"precision\":\"" << P::name << "\",\"device\":\"" << A::name
            << "\",\"threads\":" << at::get_num_threads() << ",\"rounds\":" << cfg.rounds
            << ",\"steps\":" << batches.size() << ",\"raw_ms_per_step\":" << rm << ",\"trainer_ms_per_step\":" << vm
            << ",\"ratio\":" << vm / rm << ",\"median_of_round_ratios\":" << median(ratios) << "}" << std::endl;
}

template <class A>
std::vector<Batch> make_batches(int64_t n, std::vector<int64_t> shape, const torch::Device& device) {
  std::vector<Batch> v;
  torch::manual_seed(0);
  for (int64_t i = 0; i < n; ++i) {
    auto x = torch::randn(shape).to(device);
    auto y = torch::randint(0, 10, {shape[0]}, torch::kLong).to(device);
    v.push_back({x, y});
  }
  return v;
}

template <class A, class... Ps>
void run_all(const Config& cfg) {
  const auto device = A::device(0);
  (run_case<MlpImpl, Sgd, Ps, A>("mlp", cfg, make_batches<A>(cfg.steps, {64, 64}, device)), ...);
  (run_case<CnnImpl, Sgd, Ps, A>("cnn", cfg, make_batches<A>(cfg.steps, {32, 1, 28, 28}, device)), ...);
  (run_case<Mlp784Impl, TorchAdam, Ps, A>("mlp784_adam", cfg, make_batches<A>(cfg.steps, {128, 784}, device)), ...);
  (run_case<Mlp784Impl, FusedAdam, Ps, A>("mlp784_fused_adam", cfg, make_batches<A>(cfg.steps, {128, 784}, device)),
   ...);
  (run_case<Mlp784Impl, FusedAdam, Ps, A, true>("mlp784_fused_adam_lightning_order", cfg,
                                               make_batches<A>(cfg.steps, {128, 784}, device)),
   ...);
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--rounds") cfg.rounds = std::stoi(next());
    else if (a == "--steps") cfg.steps = std::stoll(next());
    else if (a == "--warmup") cfg.warmup = std::stoll(next());
    else if (a == "--device") cfg.cuda = next() == "cuda";
    else if (a == "--case") cfg.only = next();
    else {
      std::cerr << "usage: trainer_vs_raw [--rounds N] [--steps N] [--warmup N] [--device cpu|cuda] "
                   "[--case mlp|cnn|mlp784_adam|mlp784_fused_adam|mlp784_fused_adam_lightning_order]\n";
      return 2;
    }
  }
  if (cfg.cuda) {
    if (!volt::GPU::is_available()) {
      std::cerr << "trainer_vs_raw: --device cuda but no CUDA device is visible\n";
      return 1;
    }
    run_all<volt::GPU, volt::Fp32, volt::Bf16Mixed, volt::Fp16Mixed>(cfg);
  } else {
    run_all<volt::CPU, volt::Fp32, volt::Bf16Mixed>(cfg);
  }
  return 0;
}
