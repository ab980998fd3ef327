#pragma once
/// \file
/// What every multi-process strategy shares: the launcher, this process's place in the job, the collective
/// backend, and the strategy hooks built on them (ranks, devices, all_reduce, decisions, barrier).
/// `DataParallel` (DDP, ZeRO) and `ManualParallel` derive from it and add what they do to modules, loaders and
/// gradients, through its public members (the launch's settings and the processes stay its own).

#include "volt/checkpoint.hpp"
#include "volt/cluster/environment.hpp"
#include "volt/comm/concept.hpp"
#include "volt/comm/mpi.hpp"
#include "volt/comm/nccl.hpp"
#include "volt/launchers/concept.hpp"
#include "volt/strategies/concept.hpp"
#include "volt/options.hpp"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

namespace detail {

/// The launcher slot of DDP<...>/ManualParallel<...>: L, or a stand-in after the one sentence that says L is
/// none (a class per L, so the sentence comes once however many strategies name it).
template <class L>
struct CheckedLauncher {
  static_assert(Launcher<L>, "volt: give DDP<...>/ManualParallel<...> a launcher as its first argument, as "
                             "DDP<volt::Script> or DDP<volt::Spawn, volt::Mpi>: Script (every process runs the "
                             "program) or Spawn (fit runs in fresh workers).");
  using type = std::conditional_t<Launcher<L>, L, NotALauncher>;
};

template <class L, class B>
class ProcessGroupStrategy : public StrategyDefaults {
 public:
  using launcher_type = typename CheckedLauncher<L>::type;
  using backend_type = B;
  static constexpr bool is_distributed = true;

  /// `name`: the strategy's, for the launcher's messages.
  explicit ProcessGroupStrategy(const char* name) { spec_.strategy = name; }

  /// Phase (b): devices and num_nodes, and (Script) that they agree with an outside launch.
  void check_devices(const TrainerOptions& options, int /*available: the Trainer checks it*/, const char* /*accelerator*/) {
    if (options.devices < 1 || options.num_nodes < 1) {
      throw ConfigError("volt: devices=" + std::to_string(options.devices) + " and num_nodes=" +
                        std::to_string(options.num_nodes) + " must both be at least 1.");
    }
    spec_.devices = options.devices;
    spec_.num_nodes = options.num_nodes;
    spec_.signals = options.signals;
    spec_.timeout = options.timeout;
    if (launcher_type::joins_external_jobs && launch_role().empty()) {
      cluster::check_against(cluster::detect(), options.devices, options.num_nodes);
    }
  }

  /// validate/test/predict: every rank runs `body` (Spawn: here, as a world of one).
  template <class F>
  decltype(auto) launch(F&& body) {
    NoTransfer* none = nullptr;
    return launcher_.launch(spec_, procs_, std::forward<F>(body), none);
  }
  /// fit: `transfer` brings rank 0's result back where the launcher needs it (Spawn).
  template <class F, class T>
  decltype(auto) launch(F&& body, T& transfer) {
    return launcher_.launch(spec_, procs_, std::forward<F>(body), &transfer);
  }

  /// Builds the backend for this run's processes and device (kept across runs that share both).
  void setup_environment(torch::Device device) {
    if (!backend_ || backend_group_ != procs_.group || device != device_) {
      backend_.reset();
      backend_ = std::make_unique<B>(procs_.group, device);
      backend_group_ = procs_.group;
    }
    device_ = device;
  }

  int global_rank() const { return procs_.rank; }
  int local_rank() const { return procs_.local_rank; }
  int node_rank() const { return procs_.node_rank; }
  int world_size() const { return procs_.world_size; }
  bool is_global_zero() const { return procs_.rank == 0; }
  torch::Device root_device() const { return device_; }
  const LaunchSpec& launch_spec() const { return spec_; }

  /// A reduced copy of `t` across ranks (mean divides by the world size).
  torch::Tensor all_reduce(const torch::Tensor& t, Reduce op) {
    torch::Tensor r = on_backend_device(t).clone();
    backend().all_reduce_(r, op);
    return r.to(t.device());
  }
  /// Every rank's `t`, stacked along a new first dimension.
  torch::Tensor all_gather(const torch::Tensor& t) { return backend().all_gather(on_backend_device(t)).to(t.device()); }
  /// Rank `root`'s `t` copied into `t` on every rank.
  void broadcast_(const torch::Tensor& t, int root = 0) {
    torch::Tensor r = on_backend_device(t);
    backend().broadcast_(r, root);
    if (r.unsafeGetTensorImpl() != t.unsafeGetTensorImpl()) t.copy_(r);
  }
  /// all: true when every rank says true; otherwise true when any does.
  bool reduce_boolean_decision(bool decision, bool all) {
    torch::Tensor t = torch::full({1}, decision ? 1 : 0, torch::TensorOptions().dtype(torch::kInt32).device(device_));
    backend().all_reduce_(t, Reduce::sum);
    const int votes = t.item<int>();
    return all ? votes == world_size() : votes > 0;
  }
  void barrier() { backend().barrier(); }
  /// The largest `value` over the ranks, through the launcher's MPI processes on the host.
  int host_max(int value) {
    if (procs_.group == nullptr || procs_.world_size == 1) return value;
    return procs_.group->max_over_ranks(value);
  }
  /// Every rank's `bytes`, in rank order, through the launcher's MPI processes on the host.
  std::vector<std::string> host_all_gather(const std::string& bytes) {
    if (procs_.group == nullptr || procs_.world_size == 1) return {bytes};
    return procs_.group->all_gather_bytes(bytes);
  }

  /// The module on this rank's device with rank zero's parameters and buffers, as a data-parallel fit starts.
  void replicate_from_rank_zero(torch::nn::Module& module) {
    module.to(root_device());
    torch::NoGradGuard no_grad;
    for (auto& p : module.parameters()) backend().broadcast_(p, 0);
    for (auto& b : module.buffers()) backend().broadcast_(b, 0);
  }

  /// Every rank holds the whole module: rank zero's state is the checkpoint's; the other ranks make none.
  c10::Dict<std::string, at::Tensor> module_state(const torch::nn::Module& module, bool on_device) {
    return is_global_zero() ? checkpoint::module_state(module, on_device) : c10::Dict<std::string, at::Tensor>();
  }

  /// Rank zero's checkpoint holds the optimizer's archive; the other ranks make none.
  at::Tensor optimizer_state(torch::optim::Optimizer& optimizer) {
    return is_global_zero() ? checkpoint::optimizer_state(optimizer) : at::Tensor();
  }

  B& backend() {
    if (!backend_) throw std::logic_error("volt: collectives were used before the strategy's set-up.");
    return *backend_;
  }

 private:
  torch::Tensor on_backend_device(const torch::Tensor& t) const {
    const bool fits = t.is_cpu() ? backend_traits<B>::supports_cpu : backend_traits<B>::supports_cuda;
    return (fits ? t : t.to(device_)).detach();
  }

  launcher_type launcher_;
  LaunchSpec spec_;
  Processes procs_;
  std::unique_ptr<B> backend_;
  MpiGroup* backend_group_ = nullptr;
  torch::Device device_ = torch::kCPU;
};

}  // namespace detail
}  // namespace volt
