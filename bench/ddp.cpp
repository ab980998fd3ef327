// DDP benchmarks on CPU (JSON lines):
//   ddp two-rank [--steps 150] [--warmup 20]   one 2-rank DDP<Script> fit (start it under `mpirun -np 2`, or
//                                               plainly: it starts its second rank); rank 0 prints steps/s.
//                                               ddp_vs_torch.sh runs it interleaved with torch DDP over gloo.
//   ddp world1 [--rounds 7] [--steps 100]       in one process, rounds interleaved: SingleDevice vs DDP at world
//                                               size 1 (broadcast, bucketed all-reduce of one rank); median
//                                               step times and their ratio.
//   ddp allreduce [--rounds 7] [--mb 4]         under mpirun/srun (any world size): volt::Mpi's all-reduce of a
//                                               float32 tensor of that many MiB against MPI_Allreduce of the same
//                                               bytes, interleaved; median bus bandwidths (2 (n-1)/n bytes / time,
//                                               as nccl-tests count it) and their ratio.
//   --nodes N (two-rank): the 2 ranks span N hosts (devices = 2 / N), as bench/ddp_cluster.sh starts them.
// Model (both): MLP 784-512-512-10, batch 64 per rank, SGD, cross entropy, one intra-op thread per process.

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

struct MlpImpl : torch::nn::Module {
  torch::nn::Sequential net{nullptr};
  MlpImpl() {
    torch::manual_seed(0);
    net = register_module("net", torch::nn::Sequential(torch::nn::Linear(784, 512), torch::nn::ReLU(),
                                                       torch::nn::Linear(512, 512), torch::nn::ReLU(),
                                                       torch::nn::Linear(512, 10)));
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.01)); }
};
TORCH_MODULE(Mlp);

/// Times the steps after `warmup` (on_train_batch_start of step `warmup` to the end of the fit).
struct StepTimer {
  int64_t warmup;
  std::chrono::steady_clock::time_point start, end;
  template <class T, class M, class B>
  void on_train_batch_start(T&, M&, const B&, int64_t batch_idx) {
    if (batch_idx == warmup) start = std::chrono::steady_clock::now();
  }
  template <class T, class M>
  void on_train_end(T&, M&) { end = std::chrono::steady_clock::now(); }
  double seconds() const { return std::chrono::duration<double>(end - start).count(); }
};

std::pair<torch::Tensor, torch::Tensor> data(int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  return {torch::randn({n, 784}, gen), torch::randint(0, 10, {n}, gen, torch::kLong)};
}

template <class S>
double seconds_per_step(int devices, int64_t steps, int64_t warmup, bool* is_zero = nullptr, int nodes = 1) {
  auto [x, y] = data(64 * devices * (steps + warmup));
  Mlp model;
  auto trainer = volt::make_trainer<S>({.devices = devices / nodes, .num_nodes = nodes, .max_epochs = 1},
                                       StepTimer{warmup});
  trainer.fit(model, volt::data::TensorLoader(x, y, {.batch_size = 64}));
  if (is_zero) *is_zero = trainer.is_global_zero();
  return trainer.template callback<StepTimer>().seconds() / static_cast<double>(steps);
}

/// volt::Mpi's all-reduce against MPI_Allreduce of the same bytes on MPI_COMM_WORLD, `rounds` interleaved rounds of
/// `reps` each; rank 0 prints the JSON line.
int allreduce(int rounds, double mb) {
  auto& runtime = volt::detail::MpiRuntime::instance();
  runtime.ensure_initialized();
  auto* group = new volt::detail::MpiGroup(MPI_COMM_WORLD);  // lives to the end, as a launcher's does
  volt::Mpi mpi(group);
  const int world = group->size();
  const auto n = static_cast<int64_t>(mb * 1024 * 1024 / 4);
  torch::Tensor a = torch::ones({n}), b = torch::ones({n});
  const double bytes = 4.0 * static_cast<double>(n), bus = 2.0 * (world - 1) / world * bytes;
  constexpr int reps = 10;
  auto time = [&](auto&& once) {
    mpi.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) once();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  std::vector<double> ours, raw, ratios;
  for (int r = 0; r < rounds; ++r) {
    const double v = time([&] { mpi.all_reduce_(a, volt::Reduce::sum); });
    const double m = time([&] {
      MPI_Allreduce(MPI_IN_PLACE, b.data_ptr(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    });
    ours.push_back(bus / v / 1e9);
    raw.push_back(bus / m / 1e9);
    ratios.push_back(m / v);
  }
  if (group->rank() == 0) {
    std::cout << "{\"bench\":\"ddp_allreduce_vs_mpi\",\"world_size\":" << world << ",\"hosts\":" << group->nodes()
              << ",\"mib\":" << mb << ",\"rounds\":" << rounds << ",\"volt_bus_gb_s\":" << median(ours)
              << ",\"mpi_bus_gb_s\":" << median(raw) << ",\"ratio\":" << median(ours) / median(raw)
              << ",\"median_round_ratio\":" << median(ratios) << "}" << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  std::string mode = argc > 1 ? argv[1] : "world1";
  int rounds = 7, nodes = 1;
  int64_t steps = mode == "two-rank" ? 150 : 100, warmup = 20;
  double mb = 4;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--steps")) steps = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--warmup")) warmup = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--nodes")) nodes = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--mb")) mb = std::stod(argv[i + 1]);
  }
  if (mode == "allreduce") return allreduce(rounds, mb);
  if (mode == "two-rank") {
    bool zero = false;
    const double s = seconds_per_step<volt::DDP<volt::Script>>(2, steps, warmup, &zero, nodes);
    if (zero) {
      std::cout << "{\"bench\":\"ddp_two_rank\"" << volt_bench::blas_field()
                << ",\"impl\":\"volt\",\"world_size\":2,\"hosts\":" << nodes << ",\"batch_per_rank\":64,\"steps\":"
                << steps << ",\"steps_per_s\":" << 1.0 / s << "}" << std::endl;
    }
    return 0;
  }
  std::vector<double> single, ddp, ratios;
  for (int r = 0; r < rounds; ++r) {
    const double a = seconds_per_step<volt::SingleDevice>(1, steps, warmup);
    const double b = seconds_per_step<volt::DDP<volt::Script>>(1, steps, warmup);
    single.push_back(a);
    ddp.push_back(b);
    ratios.push_back(b / a);
  }
  std::cout << "{\"bench\":\"ddp_world1_vs_single\"" << volt_bench::blas_field() << ",\"rounds\":" << rounds
            << ",\"steps\":" << steps << ",\"single_ms\":" << 1e3 * median(single)
            << ",\"ddp_ms\":" << 1e3 * median(ddp) << ",\"ratio\":" << median(ddp) / median(single)
            << ",\"median_round_ratio\":" << median(ratios) << "}" << std::endl;
  return 0;
}
