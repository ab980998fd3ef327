#pragma once
/// \file
/// `volt::ManualParallel<Launcher, Backend>`: the module places and shards itself, as Lightning's manual
/// parallelism (ModelParallelStrategy without the wrapping). The strategy provides the processes, this
/// rank's device (`ctx.device()`), ranks, and collectives (`ctx.all_reduce`, `ctx.all_gather`,
/// `ctx.broadcast_`, `ctx.barrier`), and touches nothing else: the module is not moved or broadcast,
/// loaders are used as they are, and gradients are the module's business (average them in
/// `on_after_backward` or `on_before_optimizer_step`, by whatever count is right).
/// Checkpoints: one file from rank zero would hold only that rank's parameters, so `module_state` (and with it
/// save_checkpoint) refuses with more than one rank.
/// See examples/manual_variable_batch.cpp and examples/manual_sharded_embedding.cpp.

#include "volt/checkpoint.hpp"
#include "volt/errors.hpp"
#include "volt/launchers/script.hpp"
#include "volt/launchers/spawn.hpp"
#include "volt/strategies/concept.hpp"
#include "volt/strategies/process_group.hpp"

#include <torch/nn/module.h>

#include <string>
#include <utility>

namespace volt {

template <class L = Script, class B = AutoBackend>
class ManualParallel : public detail::ProcessGroupStrategy<L, B> {
 public:
  static constexpr const char* name = "ManualParallel";
  /// Gradients are the module's business: volt does not average them.
  static constexpr bool averages_gradients = false;
  template <class A>
  using with_accelerator = ManualParallel<L, resolve_backend_t<B, A>>;

  ManualParallel() : detail::ProcessGroupStrategy<L, B>(name) {}

  void setup_module(torch::nn::Module& /*module: placed by itself*/) {}

  /// Ranks may hold different parameters: a one-file checkpoint from rank zero would lose them, so with more than one
  /// rank this refuses (every rank alike, before anything is written).
  c10::Dict<std::string, at::Tensor> module_state(const torch::nn::Module& module, bool on_device) {
    if (this->world_size() > 1) {
      throw CheckpointError(std::string("volt: ") + name + " lets each rank hold different parameters, and a "
                            "checkpoint is one file written by rank zero; save each rank's weights yourself "
                            "(checkpoint::module_state) instead.");
    }
    return checkpoint::module_state(module, on_device);
  }

  template <class Loader>
  Loader&& process_dataloader(Loader&& loader, Stage) {
    return std::forward<Loader>(loader);
  }
};

}  // namespace volt
