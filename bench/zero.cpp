// ZeRO and FSDP against DDP on the CPU (JSON lines), under `mpirun -np W` (W = 2 or 4) or plainly with --devices W
// (Script starts the other ranks):
//   zero [--devices W] [--rounds 3] [--steps 40] [--warmup 5] [--width 1536] [--hidden 2] [--bucket-mb 25]
//        [--mmap-threshold-mb 0]
// In one job, rounds interleaved: DDP, ZeRO<1>, ZeRO<2> and FSDP (each layer a unit; units freed after forward, and
// kept to backward) fits of an MLP 784-width-...-10 with `hidden` layers of
// `width` (about 3.6 million parameters by default: one gradient bucket; `--width 1024 --hidden 12`, 12.4 million in
// units each a small part of the model, as a transformer's blocks, is FSDP's case) with Adam, batch 32 per rank, one
// intra-op thread per rank, gradient buckets of `bucket-mb` MiB (the first at most 1 MiB) for all three. Rank 0 prints, per strategy, the
// parameter, optimizer-state and gradient bytes a rank holds between steps (the largest over the ranks), the process's peak
// resident memory during the fit and its growth over the resident size at the fit's start (the largest over the
// ranks; before each fit the freed memory is handed back with malloc_trim and the peak reset), and the median step
// time; then the ratios to DDP (state and gradient bytes, peak memory and its growth, steps per second). The growth is
// what the strategy changes: the peak adds LibTorch's, MPI's and the data's resident memory, the same for all. The
// model state is the three byte counts together (DDP's: 16 bytes a parameter with Adam in float32). glibc maps every
// block of at least `mmap-threshold-mb` MiB and unmaps it when freed, for every strategy alike (0: its own threshold,
// which rises with the largest block freed; main() says what that does to FSDP's figure).
//
//   zero --fit-once ddp|zero2|fsdp [--width N] [--hidden N] [--steps N] [--warmup N]
// One fit of one strategy (bench/zero_capacity.sh runs it under a per-rank memory limit): each rank first joins the
// memory cgroup $VOLT_BENCH_CGROUP/rank<R> where that is set, so that what it allocates from then on counts against
// the limit; rank 0 prints one JSON line once the fit is over.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "common.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <malloc.h>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

using volt_bench::median;

struct MlpImpl : volt_bench::WideMlp {
  using WideMlp::WideMlp;
  /// Each layer one unit under FSDP (a plain call under the others).
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return torch::nn::functional::cross_entropy(volt::forward_blocks(net, b.data, volt::Units{}), b.target);
  }
  torch::optim::Adam configure_optimizers() { return torch::optim::Adam(parameters(), torch::optim::AdamOptions(1e-4)); }
};
TORCH_MODULE(Mlp);

/// Step times after `warmup` steps, and what the strategy and optimizer hold at the end of the fit.
struct Probe {
  int64_t warmup = 0;
  std::chrono::steady_clock::time_point start, end;
  double state_bytes = 0, grad_bytes = 0, param_bytes = 0;
  template <class T, class M, class B>
  void on_train_batch_start(T&, M&, const B&, int64_t batch_idx) {
    if (batch_idx == warmup) start = std::chrono::steady_clock::now();
  }
  template <class T, class M>
  void on_train_end(T& trainer, M& module) {
    end = std::chrono::steady_clock::now();
    state_bytes = static_cast<double>(volt::detail::optimizer_state_bytes(*trainer.optimizer()));
    grad_bytes = static_cast<double>(trainer.strategy().gradient_bytes());
    param_bytes = parameter_bytes(module, *trainer.optimizer());
  }
  /// The storage the module's parameters hold (FSDP's between steps: none) and the optimizer's parameters that are
  /// not the module's (ZeRO's and FSDP's pieces; ZeRO<1|2>'s share the module's storage, counted once).
  template <class M>
  static double parameter_bytes(M& module, torch::optim::Optimizer& optimizer) {
    std::set<const void*> seen;
    double bytes = 0;
    auto add = [&](const at::Tensor& p) {
      if (p.has_storage() && seen.insert(p.storage().unsafeGetStorageImpl()).second) bytes += p.storage().nbytes();
    };
    for (const auto& p : module.parameters()) add(p);
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) add(p);
    }
    return bytes;
  }
};

/// A line of /proc/self/status ("VmHWM", "VmRSS") in bytes.
double status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) * 1024.0;
  }
  return 0.0;
}
/// Hands the memory earlier fits freed back to the system and restarts the peak from the resident size (Linux >= 4.0),
/// so that a fit's growth is its own whatever ran before it in this process; returns the resident size.
double reset_peak() {
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";
  return status_bytes("VmRSS");
}

struct Figures {
  double seconds_per_step, state_bytes, grad_bytes, param_bytes, peak_bytes, growth_bytes;
};
bool rank_zero = false;

struct Config {
  int devices = 0, rounds = 3, hidden = 2;
  int64_t steps = 40, warmup = 5, width = 1536, bucket_mb = 25, mmap_threshold_mb = 0;
};
int64_t parameters = 0;

template <class S>
Figures run(const Config& c, bool reshard = true) {
  const int64_t batch = 32;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const int64_t n = batch * c.devices * (c.steps + c.warmup);
  auto x = torch::randn({n, 784}, gen);
  auto y = torch::randint(0, 10, {n}, gen, torch::kLong);
  Mlp model(c.width, c.hidden);
  parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  auto trainer = volt::make_trainer<S>({.devices = c.devices, .max_epochs = 1}, Probe{c.warmup});
  const auto bucket = static_cast<std::size_t>(c.bucket_mb) << 20;
  if constexpr (requires { trainer.strategy().set_bucket_bytes(bucket, bucket); }) {  // FSDP's buckets are its units
    trainer.strategy().set_bucket_bytes(std::min<std::size_t>(bucket, std::size_t{1} << 20), bucket);
  }
  if constexpr (requires { trainer.strategy().set_reshard_after_forward(reshard); }) {
    trainer.strategy().set_reshard_after_forward(reshard);
  }
  const double start_rss = reset_peak();
  trainer.fit(model, volt::data::TensorLoader(x, y, {.batch_size = batch}));
  const Probe& p = trainer.template callback<Probe>();
  auto largest = [&](double v) {
    return trainer.strategy().all_reduce(torch::tensor({v}, torch::kFloat64), volt::Reduce::max).template item<double>();
  };
  const double seconds = std::chrono::duration<double>(p.end - p.start).count() / static_cast<double>(c.steps);
  rank_zero = trainer.is_global_zero();
  const double peak = status_bytes("VmHWM");
  return {largest(seconds), largest(p.state_bytes), largest(p.grad_bytes), largest(p.param_bytes), largest(peak),
          largest(peak - start_rss)};
}

/// Moves this process into the memory cgroup $VOLT_BENCH_CGROUP/rank<R> (R: its rank under mpirun), if that is set.
void join_rank_cgroup() {
  const char* parent = std::getenv("VOLT_BENCH_CGROUP");
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (parent == nullptr) return;
  const std::string procs = std::string(parent) + "/rank" + (rank ? rank : "0") + "/cgroup.procs";
  std::ofstream out(procs);
  out << getpid() << std::endl;
  if (!out) {
    std::cerr << "zero: could not join the memory cgroup " << procs << "\n";
    std::exit(2);
  }
}

/// --fit-once: one fit of `strategy`; rank 0 prints the parameters and the model state a rank held.
int fit_once(const Config& c, const std::string& strategy) {
  Figures f{};
  if (strategy == "ddp") f = run<volt::DDP<volt::Script, volt::Mpi>>(c);
  else if (strategy == "zero2") f = run<volt::ZeRO<2, volt::Script, volt::Mpi>>(c);
  else if (strategy == "fsdp") f = run<volt::FSDP<volt::Script, volt::Mpi>>(c);
  else {
    std::cerr << "zero: --fit-once takes ddp, zero2 or fsdp, got " << strategy << "\n";
    return 2;
  }
  if (rank_zero) {
    std::cout << "{\"bench\":\"zero_fit_once\",\"strategy\":\"" << strategy << "\",\"world_size\":" << c.devices
              << ",\"parameters\":" << parameters << ",\"hidden\":" << c.hidden << ",\"width\":" << c.width
              << ",\"model_state_bytes\":" << f.param_bytes + f.grad_bytes + f.state_bytes
              << ",\"peak_rss_bytes\":" << f.peak_bytes << "}" << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  join_rank_cgroup();
  at::set_num_threads(1);
  Config c;
  std::string once;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--fit-once") once = v;
    else if (a == "--devices") c.devices = std::stoi(v);
    else if (a == "--rounds") c.rounds = std::stoi(v);
    else if (a == "--steps") c.steps = std::stoll(v);
    else if (a == "--warmup") c.warmup = std::stoll(v);
    else if (a == "--width") c.width = std::stoll(v);
    else if (a == "--hidden") c.hidden = std::stoi(v);
    else if (a == "--bucket-mb") c.bucket_mb = std::stoll(v);
    else if (a == "--mmap-threshold-mb") c.mmap_threshold_mb = std::stoll(v);
    else {
      std::cerr << "zero: unknown argument " << a << "; allowed: --devices W --rounds N --steps N --warmup N "
                << "--width N --hidden N --bucket-mb N --mmap-threshold-mb N --fit-once ddp|zero2|fsdp\n";
      return 2;
    }
  }
  if (c.hidden < 1 || c.bucket_mb < 1) {
    std::cerr << "zero: --hidden and --bucket-mb take a positive number, got " << c.hidden << " and " << c.bucket_mb << "\n";
    return 2;
  }
  if (c.mmap_threshold_mb < 0 || c.mmap_threshold_mb > 32) {
    std::cerr << "zero: --mmap-threshold-mb takes 0 (glibc's own, moving threshold) to 32, got " << c.mmap_threshold_mb
              << "\n";
    return 2;
  }
  // A fixed threshold: blocks of at least that size are mapped and handed back when freed, for every strategy alike.
  // glibc's default moves its threshold up to the largest block freed so far, after which blocks of a unit's size come
  // from the heap and stay resident when freed: fully sharded training, which frees and gathers each unit every step,
  // then shows the heap's high-water mark, not what it holds (a GPU's caching allocator reuses such blocks instead).
  if (c.mmap_threshold_mb > 0) mallopt(M_MMAP_THRESHOLD, static_cast<int>(c.mmap_threshold_mb << 20));
  if (c.devices == 0) {  // under mpirun: its size
    const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
    c.devices = size != nullptr ? std::stoi(size) : 2;
  }
  if (!once.empty()) return fit_once(c, once);
  const int devices = c.devices, rounds = c.rounds;
  using Ddp = volt::DDP<volt::Script, volt::Mpi>;
  using Zero1 = volt::ZeRO<1, volt::Script, volt::Mpi>;
  using Zero2 = volt::ZeRO<2, volt::Script, volt::Mpi>;
  using Fsdp = volt::FSDP<volt::Script, volt::Mpi>;
  std::map<std::string, std::vector<Figures>> all;
  for (int r = 0; r < rounds; ++r) {
    all["DDP"].push_back(run<Ddp>(c));
    all["ZeRO<1>"].push_back(run<Zero1>(c));
    all["ZeRO<2>"].push_back(run<Zero2>(c));
    all["FSDP"].push_back(run<Fsdp>(c));
    all["FSDP-keep"].push_back(run<Fsdp>(c, /*reshard=*/false));
  }
  if (!rank_zero) return 0;
  std::map<std::string, Figures> med;
  for (auto& [name, runs] : all) {
    auto pick = [&](double Figures::*f) {
      std::vector<double> v;
      for (const auto& x : runs) v.push_back(x.*f);
      return median(v);
    };
    med[name] = {pick(&Figures::seconds_per_step), pick(&Figures::state_bytes), pick(&Figures::grad_bytes),
                 pick(&Figures::param_bytes), pick(&Figures::peak_bytes), pick(&Figures::growth_bytes)};
    const Figures& m = med[name];
    std::cout << "{\"bench\":\"zero\"" << volt_bench::blas_field() << ",\"strategy\":\"" << name
              << "\",\"world_size\":" << devices << ",\"parameters\":" << parameters << ",\"bucket_mb\":" << c.bucket_mb
              << ",\"rounds\":" << rounds << ",\"steps\":" << c.steps << ",\"steps_per_s\":" << 1.0 / m.seconds_per_step
              << ",\"parameter_bytes\":" << m.param_bytes << ",\"optimizer_state_bytes\":" << m.state_bytes
              << ",\"gradient_bytes\":" << m.grad_bytes
              << ",\"peak_rss_bytes\":" << m.peak_bytes << ",\"peak_growth_bytes\":" << m.growth_bytes << "}"
              << std::endl;
  }
  for (const char* name : {"ZeRO<1>", "ZeRO<2>", "FSDP", "FSDP-keep"}) {
    const Figures &z = med[name], &d = med["DDP"], &z2 = med["ZeRO<2>"];
    auto model_state = [](const Figures& f) { return f.param_bytes + f.grad_bytes + f.state_bytes; };
    std::cout << "{\"bench\":\"zero_vs_ddp\"" << volt_bench::blas_field() << ",\"strategy\":\"" << name
              << "\",\"world_size\":" << devices << ",\"parameters\":" << parameters << ",\"bucket_mb\":" << c.bucket_mb
              << ",\"model_state_bytes_ratio\":" << model_state(z) / model_state(d)
              << ",\"parameter_bytes_ratio\":" << z.param_bytes / d.param_bytes
              << ",\"steps_per_s_vs_zero2\":" << z2.seconds_per_step / z.seconds_per_step
              << ",\"state_bytes_ratio\":" << z.state_bytes / d.state_bytes
              << ",\"gradient_bytes_ratio\":" << z.grad_bytes / d.grad_bytes
              << ",\"peak_rss_ratio\":" << z.peak_bytes / d.peak_bytes
              << ",\"peak_growth_ratio\":" << z.growth_bytes / d.growth_bytes
              << ",\"steps_per_s_ratio\":" << d.seconds_per_step / z.seconds_per_step << "}" << std::endl;
  }
  return 0;
}
