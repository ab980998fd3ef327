// Graph mode against the loops one would write by hand, on one GPU (LibTorch 2.x with CUDA), in one process with
// rounds interleaved: for each workload, six ways to train the same model on the same batches (already on the GPU),
// bf16 autocast, Adam at 1e-3:
//   hand_eager     a hand-written loop with torch::optim::Adam
//   hand_fused     a hand-written loop calling at::_fused_adam_ (step counts on the device)
//   hand_graphed   the hand-written fused step captured once in an at::cuda::CUDAGraph, then replayed
//   volt_eager     Trainer<SingleDevice, Bf16, GPU> with torch::optim::Adam
//   volt_fused     the same Trainer with volt::optim::Adam
//   volt_graphed   Trainer<SingleDevice, Bf16, Graphed<GPU>> with volt::optim::Adam
// Every volt run logs the loss with ctx.log each step (prog_bar) and has a ProgressBar attached (drawing into a
// discarded stream). Workloads: an MLP 784-256-256-10 at batch 128, and a CNN (64-128-256 convolutions, 512 fully
// connected) at batch 256 on 28x28 images. Prints a JSON line per workload and way (median steps/s over the rounds)
// and the ratios the goals name: volt_graphed / hand_graphed, volt_fused / hand_fused, volt_eager / hand_eager.
// The CNN's two levers, for every way alike: --cudnn-benchmark (cuDNN's autotuner; volt through its `benchmark`
// option) and --channels-last (the convolutions' weights and the images in channels-last layout).
//   graph [--rounds 5] [--steps 300] [--workload mlp|cnn|all] [--cudnn-benchmark] [--channels-last]
// Exits 77 where there is no CUDA device (or volt was built without CUDA).

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "common.hpp"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#if VOLT_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace {

using volt_bench::median;

using Clock = std::chrono::steady_clock;
using Batch = torch::data::Example<>;

/// The levers (command line), the same for every way.
bool cudnn_benchmark = false, channels_last = false;

/// The two workloads as one module type: `cnn` picks the layers.
struct NetImpl : torch::nn::Module {
  bool cnn = false;
  torch::nn::Sequential body{nullptr};
  explicit NetImpl(bool is_cnn) : cnn(is_cnn) {
    torch::manual_seed(0);
    namespace nn = torch::nn;
    if (cnn) {
      body = register_module(
          "body", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 64, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                                 nn::Conv2d(nn::Conv2dOptions(64, 128, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                                 nn::Conv2d(nn::Conv2dOptions(128, 256, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                                 nn::Flatten(), nn::Linear(256 * 3 * 3, 512), nn::ReLU(), nn::Linear(512, 10)));
      if (channels_last) {  // moving to the GPU keeps the layout
        torch::NoGradGuard no_grad;
        for (auto& p : parameters()) {
          if (p.dim() == 4) p.set_data(p.contiguous(torch::MemoryFormat::ChannelsLast));
        }
      }
    } else {
      body = register_module("body", nn::Sequential(nn::Linear(784, 256), nn::ReLU(), nn::Linear(256, 256), nn::ReLU(),
                                                    nn::Linear(256, 10)));
    }
  }
  torch::Tensor loss(const Batch& b) { return torch::nn::functional::cross_entropy(body->forward(b.data), b.target); }
  torch::Tensor training_step(const Batch& b, volt::Context& ctx) {
    auto l = loss(b);
    ctx.log("loss", l, {.prog_bar = true});
    return l;
  }
};
TORCH_MODULE(Net);

/// The module volt trains, with its optimizer type in configure_optimizers' result.
template <class O>
struct VoltNetImpl : NetImpl {
  using NetImpl::NetImpl;
  O configure_optimizers() { return O(parameters(), torch::optim::AdamOptions(1e-3)); }
};
template <class O>
using VoltNet = torch::nn::ModuleHolder<VoltNetImpl<O>>;

std::vector<Batch> make_batches(bool cnn) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const int64_t n = cnn ? 256 : 128;
  std::vector<Batch> out;
  for (int i = 0; i < 8; ++i) {
    auto x = cnn ? torch::randn({n, 1, 28, 28}, gen) : torch::randn({n, 784}, gen);
    if (cnn && channels_last) x = x.contiguous(torch::MemoryFormat::ChannelsLast);
    out.push_back({x.cuda(), torch::randint(0, 10, {n}, gen).cuda()});
  }
  return out;
}

/// A hand-written fused Adam: the state, the device step counts and the rate tensor, and one at::_fused_adam_.
struct HandFusedAdam {
  std::vector<torch::Tensor> params, exp_avg, exp_avg_sq, steps;
  torch::Tensor lr;
  explicit HandFusedAdam(std::vector<torch::Tensor> p) : params(std::move(p)) {
    for (auto& t : params) {
      exp_avg.push_back(torch::zeros_like(t));
      exp_avg_sq.push_back(torch::zeros_like(t));
      steps.push_back(torch::zeros({}, t.options().dtype(torch::kFloat)));
    }
    lr = torch::full({}, 1e-3, params[0].options().dtype(torch::kFloat));
  }
  void step() {
    std::vector<torch::Tensor> grads;
    for (auto& p : params) grads.push_back(p.grad());
    at::_foreach_add_(steps, 1);
    at::_fused_adam_(params, grads, exp_avg, exp_avg_sq, {}, steps, lr, 0.9, 0.999, 0.0, 1e-8, false, false);
  }
};

/// Steps/s of `steps` calls of `one(i)`, with a device sync on both ends.
template <class F>
double timed(int steps, F&& one) {
  torch::cuda::synchronize();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) one(i);
  torch::cuda::synchronize();
  return steps / std::chrono::duration<double>(Clock::now() - t0).count();
}

/// A hand-written eager loop: gradients set to none, the loss under bf16 autocast, backward, `opt.step()`.
template <class Optimizer>
double hand_loop(bool cnn, const std::vector<Batch>& batches, int steps) {
  Net net(cnn);
  net->to(torch::kCUDA);
  Optimizer opt(net->parameters());
  auto one = [&](int i) {
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    torch::Tensor loss;
    {
      volt::detail::AutocastGuard autocast(c10::DeviceType::CUDA, at::kBFloat16);
      loss = net->loss(batches[i % batches.size()]);
    }
    loss.backward();
    opt.step();
  };
  timed(10, one);
  return timed(steps, one);
}

/// torch::optim::Adam at 1e-3.
struct TorchAdam : torch::optim::Adam {
  explicit TorchAdam(std::vector<torch::Tensor> p) : torch::optim::Adam(std::move(p), torch::optim::AdamOptions(1e-3)) {}
};

double hand_graphed(bool cnn, const std::vector<Batch>& batches, int steps) {
  Net net(cnn);
  net->to(torch::kCUDA);
  HandFusedAdam opt(net->parameters());
  Batch input{batches[0].data.clone(), batches[0].target.clone()};
  auto step = [&] {
    for (auto& p : opt.params) p.mutable_grad() = torch::Tensor();
    torch::Tensor loss;
    {
      volt::detail::AutocastGuard autocast(c10::DeviceType::CUDA, at::kBFloat16);
      at::autocast::set_autocast_cache_enabled(false);
      loss = net->loss(input);
      at::autocast::set_autocast_cache_enabled(true);
    }
    loss.backward();
    opt.step();
  };
  auto side = c10::cuda::getStreamFromPool();
  side.synchronize();
  {
    c10::cuda::CUDAStreamGuard guard(side);
    for (int i = 0; i < 3; ++i) step();
  }
  torch::cuda::synchronize();
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    for (auto& p : opt.params) p.mutable_grad() = torch::Tensor();
    graph.capture_begin();
    step();
    graph.capture_end();
  }
  auto one = [&](int i) {
    const Batch& b = batches[i % batches.size()];
    input.data.copy_(b.data, /*non_blocking=*/true);
    input.target.copy_(b.target, /*non_blocking=*/true);
    graph.replay();
  };
  timed(10, one);
  return timed(steps, one);
}

/// Times a fit from its 20th optimizer step to its last, with a sync at both ends.
struct StepTimer {
  static constexpr bool keeps_loss = false;  // graph mode need not copy the loss for it
  int64_t from = 20;
  Clock::time_point t0;
  double rate = 0;
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (trainer.global_step() == from) {
      torch::cuda::synchronize();
      t0 = Clock::now();
    } else if (trainer.global_step() == trainer.max_steps()) {
      torch::cuda::synchronize();
      rate = static_cast<double>(trainer.max_steps() - from) / std::chrono::duration<double>(Clock::now() - t0).count();
    }
  }
};

template <class A, class O>
double volt_fit(bool cnn, const std::vector<Batch>& batches, int steps) {
  VoltNet<O> net(cnn);
  std::vector<Batch> loader;
  for (int i = 0; i < steps + 20; ++i) loader.push_back(batches[i % batches.size()]);
  static std::ostringstream discard;
  discard.str("");
  auto t = volt::make_trainer<volt::SingleDevice, volt::Bf16, A>(
      {.max_steps = steps + 20, .num_sanity_val_steps = 0, .benchmark = cudnn_benchmark, .signals = {.enabled = false}},
      StepTimer{},
      volt::ProgressBar({.out = &discard, .plain = false}));
  t.fit(net, loader);
  return t.template callback<StepTimer>().rate;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 5, steps = 300;
  std::string workload = "all";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--rounds") {
      rounds = std::stoi(next());
    } else if (a == "--steps") {
      steps = std::stoi(next());
    } else if (a == "--workload") {
      workload = next();
    } else if (a == "--cudnn-benchmark") {
      cudnn_benchmark = true;
    } else if (a == "--channels-last") {
      channels_last = true;
    } else {
      std::cerr << "graph: unknown argument " << a << "; allowed: --rounds N --steps N --workload mlp|cnn|all "
                << "--cudnn-benchmark --channels-last\n";
      return 2;
    }
  }
  if (!torch::cuda::is_available()) {
    std::cerr << "graph: no CUDA device here; graph mode runs on a GPU only\n";
    return 77;
  }
  at::globalContext().setBenchmarkCuDNN(cudnn_benchmark);  // the hand-written loops' setting (volt sets its own)
  std::ostringstream levers;
  levers << ",\"cudnn_benchmark\":" << std::boolalpha << cudnn_benchmark << ",\"channels_last\":" << channels_last;
  for (bool cnn : {false, true}) {
    const std::string name = cnn ? "cnn" : "mlp";
    if (workload != "all" && workload != name) continue;
    const auto batches = make_batches(cnn);
    using Run = double (*)(bool, const std::vector<Batch>&, int);
    const std::vector<std::pair<std::string, Run>> ways = {
        {"hand_eager", hand_loop<TorchAdam>},
        {"hand_fused", hand_loop<HandFusedAdam>},
        {"hand_graphed", hand_graphed},
        {"volt_eager", volt_fit<volt::GPU, torch::optim::Adam>},
        {"volt_fused", volt_fit<volt::GPU, volt::optim::Adam>},
        {"volt_graphed", volt_fit<volt::Graphed<volt::GPU>, volt::optim::Adam>},
    };
    std::map<std::string, std::vector<double>> rates;
    for (int r = 0; r < rounds; ++r) {
      for (const auto& [way, run] : ways) rates[way].push_back(run(cnn, batches, steps));
    }
    std::map<std::string, double> m;
    for (const auto& [way, v] : rates) {
      m[way] = median(v);
      std::cout << "{\"bench\":\"graph\"" << volt_bench::blas_field() << ",\"workload\":\"" << name << "\",\"way\":\""
                << way << "\",\"steps_per_s\":" << m[way] << ",\"rounds\":" << rounds << ",\"steps\":" << steps
                << levers.str() << "}" << std::endl;
    }
    std::cout << "{\"bench\":\"graph\"" << volt_bench::blas_field() << ",\"workload\":\"" << name << "\""
              << levers.str() << ",\"ratio_volt_graphed_to_hand_graphed\":" << m["volt_graphed"] / m["hand_graphed"]
              << ",\"ratio_volt_fused_to_hand_fused\":" << m["volt_fused"] / m["hand_fused"]
              << ",\"ratio_volt_eager_to_hand_eager\":" << m["volt_eager"] / m["hand_eager"]
              << ",\"ratio_volt_graphed_to_hand_eager\":" << m["volt_graphed"] / m["hand_eager"] << "}" << std::endl;
  }
}

#else
int main() {
  std::cerr << "graph: volt was built without CUDA (VOLT_WITH_CUDA is 0); graph mode runs on a GPU only\n";
  return 77;
}
#endif
