// DDP benchmarks on CPU (JSON lines):
//   ddp two-rank [--steps 150] [--warmup 20]   one 2-rank DDP<Script> fit (start it under `mpirun -np 2`, or
//                                               plainly: it starts its second rank); rank 0 prints steps/s.
//                                               ddp_vs_torch.sh runs it interleaved with torch DDP over gloo.
//   ddp world1 [--rounds 7] [--steps 100]       in one process, rounds interleaved: SingleDevice vs DDP at world
//                                               size 1 (broadcast, bucketed all-reduce of one rank); median
//                                               step times and their ratio.
//   ddp collectives [--rounds 7] [--mb 4]       under mpirun/srun (any world size): volt::Mpi's all-reduce,
//                                               reduce-scatter and all-gather of a float32 tensor of that many MiB
//                                               against Open MPI's blocking ones of the same bytes, interleaved;
//                                               median bus bandwidths (as nccl-tests count them), their ratio, and
//                                               the share of a collective hidden behind as long a compute.
//   --nodes N (two-rank): the 2 ranks span N hosts (devices = 2 / N), as bench/ddp_cluster.sh starts them.
// Model (both): MLP 784-512-512-10, batch 64 per rank, SGD, cross entropy, one intra-op thread per process.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "common.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
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

/// One collective kind as the benchmark runs it: volt's (non-blocking, then waited) and Open MPI's blocking one on the
/// same bytes, and the bus-bandwidth factor (nccl-tests' busbw: 2 (n-1)/n of the bytes for an all-reduce, (n-1)/n for
/// reduce-scatter and all-gather, the bytes being the whole flat buffer).
struct Kind {
  const char* name;
  double bus_factor;
  std::function<volt::Mpi::Work(torch::Tensor&)> start;
  std::function<void(torch::Tensor&)> blocking;
};

std::vector<Kind> kinds(volt::Mpi& mpi, int world) {
  const double n = world;
  auto* comm = MPI_COMM_WORLD;
  return {
      {"all_reduce", 2 * (n - 1) / n, [&mpi](torch::Tensor& t) { return mpi.iall_reduce_(t, volt::Reduce::sum); },
       [comm](torch::Tensor& t) {
         MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, comm);
       }},
      {"reduce_scatter", (n - 1) / n, [&mpi](torch::Tensor& t) { return mpi.ireduce_scatter_(t, volt::Reduce::sum); },
       [comm, world](torch::Tensor& t) {
         static torch::Tensor out;
         if (!out.defined() || out.numel() != t.numel() / world) out = torch::empty({t.numel() / world});
         MPI_Reduce_scatter_block(t.data_ptr(), out.data_ptr(), static_cast<int>(t.numel() / world), MPI_FLOAT,
                                  MPI_SUM, comm);
       }},
      {"all_gather", (n - 1) / n, [&mpi](torch::Tensor& t) { return mpi.iall_gather_(t); },
       [comm, world](torch::Tensor& t) {
         MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, t.data_ptr(), static_cast<int>(t.numel() / world), MPI_FLOAT,
                       comm);
       }},
  };
}

/// Busy work for about `seconds` on this thread (matrix products), as backward's kernels keep a rank busy.
void compute_for(double seconds) {
  static const torch::Tensor a = torch::randn({128, 128});
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) (void)torch::mm(a, a);
}

/// volt::Mpi's all-reduce, reduce-scatter and all-gather against Open MPI's blocking ones of the same bytes on
/// MPI_COMM_WORLD, `rounds` interleaved rounds of `reps` each; then how much of a collective is hidden behind compute:
/// started, then as long a spell of matrix products as the blocking collective takes, then waited for (hidden = 1 -
/// that wait / the blocking time: 1 where the collective progressed during the compute, 0 where it all waited for the
/// wait). Rank 0 prints one JSON line per kind.
int collectives(int rounds, double mb) {
  auto& runtime = volt::detail::MpiRuntime::instance();
  runtime.ensure_initialized();
  auto* group = new volt::detail::MpiGroup(MPI_COMM_WORLD);  // lives to the end, as a launcher's does
  volt::Mpi mpi(group);
  const int world = group->size();
  const auto n = static_cast<int64_t>(mb * 1024 * 1024 / 4) / world * world;
  const double bytes = 4.0 * static_cast<double>(n);
  constexpr int reps = 10;
  auto time = [&](auto&& once) {
    mpi.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) once();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  for (const Kind& kind : kinds(mpi, world)) {
    torch::Tensor a = torch::ones({n}), b = torch::ones({n});
    std::vector<double> ours, raw, ratios, hidden;
    for (int r = 0; r < rounds; ++r) {
      const double v = time([&] { kind.start(a).wait(); });
      const double m = time([&] { kind.blocking(b); });
      ours.push_back(kind.bus_factor * bytes / v / 1e9);
      raw.push_back(kind.bus_factor * bytes / m / 1e9);
      ratios.push_back(m / v);
      mpi.barrier();
      auto work = kind.start(a);
      compute_for(m);
      const auto t0 = std::chrono::steady_clock::now();
      work.wait();
      hidden.push_back(1.0 - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / m);
    }
    if (group->rank() == 0) {
      std::cout << "{\"bench\":\"ddp_collective_vs_mpi\",\"kind\":\"" << kind.name << "\",\"world_size\":" << world
                << ",\"hosts\":" << group->nodes() << ",\"mib\":" << mb << ",\"rounds\":" << rounds
                << ",\"volt_bus_gb_s\":" << median(ours) << ",\"mpi_bus_gb_s\":" << median(raw)
                << ",\"ratio\":" << median(ours) / median(raw) << ",\"median_round_ratio\":" << median(ratios)
                << ",\"hidden_behind_compute\":" << median(hidden) << "}" << std::endl;
    }
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
  if (mode == "collectives") return collectives(rounds, mb);
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
