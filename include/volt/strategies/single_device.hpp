#pragma once
/// \file
/// `volt::SingleDevice`: the default strategy.

#include "volt/cluster/environment.hpp"
#include "volt/options.hpp"
#include "volt/strategies/concept.hpp"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <string>
#include <utility>

namespace volt {

/// One process, one device: the module moves to the device, loaders and gradients are used as they are,
/// and collectives are identities.
class SingleDevice : public StrategyDefaults {
 public:
  static constexpr bool is_distributed = false;
  static constexpr const char* name = "SingleDevice";

  void check_devices(const TrainerOptions& options, int available, const char* accelerator) const {
    if (options.devices != 1 || options.num_nodes != 1) {
      throw ConfigError("volt: SingleDevice runs one process on one device, but devices=" +
                        std::to_string(options.devices) + " and num_nodes=" + std::to_string(options.num_nodes) +
                        " were given. Use devices=1, or a distributed strategy (DDP<Script>, DDP<Spawn>) for more.");
    }
    if (available < 1) {
      throw ConfigError(std::string("volt: SingleDevice needs one ") + accelerator + " device, but none is available.");
    }
    // mpirun -np 2 (or srun, torchrun) around a SingleDevice program: every process would train the whole model
    // alone and write into the same folders. Not in the processes volt's own launchers start.
    const cluster::Environment env = cluster::detect();
    if (env.world_size > 1 && cluster::launch_role().empty()) {
      throw ConfigError("volt: SingleDevice trains in one process, but " + std::string(cluster::to_string(env.source)) +
                        " started " + std::to_string(env.world_size) + " (this is rank " + std::to_string(env.rank) +
                        "): each would train the whole model alone and write into the same folders. Use "
                        "DDP<Script> with devices x num_nodes = " + std::to_string(env.world_size) +
                        " to train together, or start one process.");
    }
  }

  /// Runs the body right here.
  template <class F>
  decltype(auto) launch(F&& body) {
    return std::forward<F>(body)();
  }
  /// fit: right here too, so nothing needs to travel.
  template <class F, class T>
  decltype(auto) launch(F&& body, T& /*transfer*/) {
    return std::forward<F>(body)();
  }

  void setup_environment(torch::Device device) { device_ = device; }
  void setup_module(torch::nn::Module& module) { module.to(device_); }

  template <class Loader>
  Loader&& process_dataloader(Loader&& loader, Stage) {
    return std::forward<Loader>(loader);
  }

  int global_rank() const { return 0; }
  int local_rank() const { return 0; }
  int world_size() const { return 1; }
  bool is_global_zero() const { return true; }
  torch::Device root_device() const { return device_; }

  torch::Tensor all_reduce(const torch::Tensor& t, Reduce) { return t; }
  bool reduce_boolean_decision(bool decision, bool /*all*/) { return decision; }
  void barrier() {}

 private:
  torch::Device device_ = torch::kCPU;
};

}  // namespace volt
