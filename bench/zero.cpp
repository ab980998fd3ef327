// ZeRO against DDP on the CPU (JSON lines), under `mpirun -np W` (W = 2 or 4) or plainly with --devices W (Script
// starts the other ranks):
//   zero [--devices W] [--rounds 3] [--steps 40] [--warmup 5] [--width 1536]
// In one job, rounds interleaved: DDP, ZeRO<1> and ZeRO<2> fits of an MLP 784-W-W-10 (about 3.6 million parameters at
// the default width) with Adam, batch 32 per rank, one intra-op thread per rank. Rank 0 prints, per strategy, the
// optimizer-state and gradient bytes a rank holds between steps (the largest over the ranks), the process's peak
// resident memory during the fit (the largest over the ranks; the peak is reset before each fit) and the median step
// time; then the ratios to DDP (state and gradient bytes, peak memory, steps per second).

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "common.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace {

using volt_bench::median;

struct MlpImpl : volt_bench::WideMlp {
  using WideMlp::WideMlp;
  torch::optim::Adam configure_optimizers() { return torch::optim::Adam(parameters(), torch::optim::AdamOptions(1e-4)); }
};
TORCH_MODULE(Mlp);

/// Step times after `warmup` steps, and what the strategy and optimizer hold at the end of the fit.
struct Probe {
  int64_t warmup = 0;
  std::chrono::steady_clock::time_point start, end;
  double state_bytes = 0, grad_bytes = 0;
  template <class T, class M, class B>
  void on_train_batch_start(T&, M&, const B&, int64_t batch_idx) {
    if (batch_idx == warmup) start = std::chrono::steady_clock::now();
  }
  template <class T, class M>
  void on_train_end(T& trainer, M&) {
    end = std::chrono::steady_clock::now();
    state_bytes = static_cast<double>(volt::detail::optimizer_state_bytes(*trainer.optimizer()));
    grad_bytes = static_cast<double>(trainer.strategy().gradient_bytes());
  }
};

/// Peak resident memory (VmHWM) in bytes; `reset` restarts it from the current resident size (Linux >= 4.0).
double peak_rss(bool reset) {
  if (reset) std::ofstream("/proc/self/clear_refs") << "5";
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;
  }
  return 0.0;
}

struct Figures {
  double seconds_per_step, state_bytes, grad_bytes, peak_bytes;
};
bool rank_zero = false;

template <class S>
Figures run(int devices, int64_t width, int64_t steps, int64_t warmup) {
  const int64_t batch = 32;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const int64_t n = batch * devices * (steps + warmup);
  auto x = torch::randn({n, 784}, gen);
  auto y = torch::randint(0, 10, {n}, gen, torch::kLong);
  Mlp model(width);
  auto trainer = volt::make_trainer<S>({.devices = devices, .max_epochs = 1},
                                       Probe{warmup});
  peak_rss(/*reset=*/true);
  trainer.fit(model, volt::data::TensorLoader(x, y, {.batch_size = batch}));
  const Probe& p = trainer.template callback<Probe>();
  auto largest = [&](double v) {
    return trainer.strategy().all_reduce(torch::tensor({v}, torch::kFloat64), volt::Reduce::max).template item<double>();
  };
  const double seconds = std::chrono::duration<double>(p.end - p.start).count() / static_cast<double>(steps);
  rank_zero = trainer.is_global_zero();
  return {largest(seconds), largest(p.state_bytes), largest(p.grad_bytes), largest(peak_rss(false))};
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  int devices = 0, rounds = 3;
  int64_t steps = 40, warmup = 5, width = 1536;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--devices") devices = std::stoi(v);
    else if (a == "--rounds") rounds = std::stoi(v);
    else if (a == "--steps") steps = std::stoll(v);
    else if (a == "--warmup") warmup = std::stoll(v);
    else if (a == "--width") width = std::stoll(v);
    else {
      std::cerr << "zero: unknown argument " << a << "; allowed: --devices W --rounds N --steps N --warmup N --width N\n";
      return 2;
    }
  }
  if (devices == 0) {  // under mpirun: its size
    const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
    devices = size != nullptr ? std::stoi(size) : 2;
  }
  using Ddp = volt::DDP<volt::Script, volt::Mpi>;
  using Zero1 = volt::ZeRO<1, volt::Script, volt::Mpi>;
  using Zero2 = volt::ZeRO<2, volt::Script, volt::Mpi>;
  std::map<std::string, std::vector<Figures>> all;
  for (int r = 0; r < rounds; ++r) {
    all["DDP"].push_back(run<Ddp>(devices, width, steps, warmup));
    all["ZeRO<1>"].push_back(run<Zero1>(devices, width, steps, warmup));
    all["ZeRO<2>"].push_back(run<Zero2>(devices, width, steps, warmup));
  }
  if (!rank_zero) return 0;
  const int64_t params = 784 * width + width + width * width + width + width * 10 + 10;
  std::map<std::string, Figures> med;
  for (auto& [name, runs] : all) {
    auto pick = [&](double Figures::*f) {
      std::vector<double> v;
      for (const auto& x : runs) v.push_back(x.*f);
      return median(v);
    };
    med[name] = {pick(&Figures::seconds_per_step), pick(&Figures::state_bytes), pick(&Figures::grad_bytes),
                 pick(&Figures::peak_bytes)};
    const Figures& m = med[name];
    std::cout << "{\"bench\":\"zero\",\"strategy\":\"" << name << "\",\"world_size\":" << devices
              << ",\"parameters\":" << params << ",\"rounds\":" << rounds << ",\"steps\":" << steps
              << ",\"steps_per_s\":" << 1.0 / m.seconds_per_step << ",\"optimizer_state_bytes\":" << m.state_bytes
              << ",\"gradient_bytes\":" << m.grad_bytes << ",\"peak_rss_bytes\":" << m.peak_bytes << "}" << std::endl;
  }
  for (const char* name : {"ZeRO<1>", "ZeRO<2>"}) {
    const Figures &z = med[name], &d = med["DDP"];
    std::cout << "{\"bench\":\"zero_vs_ddp\",\"strategy\":\"" << name << "\",\"world_size\":" << devices
              << ",\"state_bytes_ratio\":" << z.state_bytes / d.state_bytes
              << ",\"gradient_bytes_ratio\":" << z.grad_bytes / d.grad_bytes
              << ",\"peak_rss_ratio\":" << z.peak_bytes / d.peak_bytes
              << ",\"steps_per_s_ratio\":" << d.seconds_per_step / z.seconds_per_step << "}" << std::endl;
  }
  return 0;
}
