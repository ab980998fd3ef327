#pragma once
/// \file
/// `volt::ManualParallel<Launcher, Backend>`: the module places and shards itself, as Lightning's manual
/// parallelism (ModelParallelStrategy without the wrapping). The strategy provides the processes, this
/// rank's device (`ctx.device()`), ranks, and collectives (`ctx.all_reduce`, `ctx.all_gather`,
/// `ctx.broadcast_`, `ctx.barrier`), and touches nothing else: the module is not moved or broadcast,
/// loaders are used as they are, and gradients are the module's business (average them in
/// `on_after_backward` or `on_before_optimizer_step`, by whatever count is right).
/// Checkpoints: one file from rank zero holds only that rank's parameters, so save_checkpoint refuses
/// with more than one rank.
/// See examples/manual_variable_batch.cpp and examples/manual_sharded_embedding.cpp.

#include "volt/launchers/script.hpp"
#include "volt/launchers/spawn.hpp"
#include "volt/strategies/concept.hpp"
#include "volt/strategies/process_group.hpp"

#include <torch/nn/module.h>

#include <utility>

namespace volt {

template <class L = Script, class B = AutoBackend>
class ManualParallel : public detail::ProcessGroupStrategy<L, B> {
 public:
  static constexpr const char* name = "ManualParallel";
  /// Ranks may hold different parameters: a one-file checkpoint from rank zero would lose them, so
  /// Trainer::save_checkpoint refuses to write one when more than one rank runs.
  static constexpr bool replicates_module = false;
  template <class A>
  using with_accelerator = ManualParallel<L, resolve_backend_t<B, A>>;

  ManualParallel() { this->spec_.strategy = "ManualParallel"; }

  void setup_module(torch::nn::Module& /*module: placed by itself*/) {}

  template <class Loader>
  Loader&& process_dataloader(Loader&& loader, Stage) {
    return std::forward<Loader>(loader);
  }
};

}  // namespace volt
