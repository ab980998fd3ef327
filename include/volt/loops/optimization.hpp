#pragma once
/// \file
/// The fit's optimizers as the loops hold them: the accumulation window a batch falls in, each optimizer with its
/// scheduler and the steps it has taken (when a scheduler steps), and the checks on what `configure_optimizers`
/// returned. The step variants' sequences are in loops/step_parts.hpp; clipping and zeroing in optim/gradients.hpp.

#include "volt/errors.hpp"
#include "volt/module.hpp"
#include "volt/options.hpp"

#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace volt::detail {

/// Where a training batch falls in automatic optimization's accumulation window of `accumulate_grad_batches`
/// batches: whether it starts one (gradients are zeroed before its backward) and whether it ends one (the optimizer
/// steps after it; the epoch's last batch always does).
struct Window {
  bool starts = true;
  bool steps = true;
  /// The batch is the epoch's last (graph mode runs it eagerly when its shape differs).
  bool is_last = false;
  /// The window's size: each micro-batch's loss is divided by it.
  int64_t size = 1;

  static Window of(int64_t batch_idx, bool is_last, int64_t accumulate) {
    return {batch_idx % accumulate == 0, (batch_idx + 1) % accumulate == 0 || is_last, is_last, accumulate};
  }
};

/// One optimizer as `configure_optimizers` gave it, with its scheduler, and the steps it has taken in this fit.
struct ScheduledOptimizer {
  OptimizerConfig config;
  /// This optimizer's steps so far (a step-interval scheduler steps every `frequency` of them); kept in checkpoints.
  int64_t steps = 0;

  torch::optim::Optimizer& optimizer() const { return *config.optimizer; }
  /// After each of this optimizer's steps: the scheduler, when it steps per optimizer step and its turn has come.
  void stepped() {
    ++steps;
    if (config.scheduler && config.interval == Interval::step && steps % config.frequency == 0) config.scheduler->step();
  }
  /// After training epoch `epoch` (0-based) has ended: the scheduler, when it steps per epoch and its turn has come.
  void epoch_ended(int64_t epoch) {
    if (config.scheduler && config.interval == Interval::epoch && (epoch + 1) % config.frequency == 0) {
      config.scheduler->step();
    }
  }
};

/// `configure_optimizers`' result as the fit's optimizers, each checked: an optimizer is there, a frequency >= 1.
template <class R>
std::vector<ScheduledOptimizer> scheduled_optimizers(R&& result) {
  std::vector<ScheduledOptimizer> out;
  for (OptimizerConfig& c : to_optimizer_configs(std::forward<R>(result))) out.push_back({std::move(c), 0});
  if (out.empty()) throw ConfigError("volt: configure_optimizers returned no optimizer (an empty list).");
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::string which = out.size() == 1 ? "" : " (optimizer " + std::to_string(i) + ")";
    if (!out[i].config.optimizer) {
      throw ConfigError("volt: configure_optimizers returned no optimizer" + which + " (a null pointer).");
    }
    if (out[i].config.frequency < 1) {
      throw ConfigError("volt: OptimizerConfig frequency=" + std::to_string(out[i].config.frequency) + which +
                        " is not allowed: give a number >= 1.");
    }
  }
  return out;
}

}  // namespace volt::detail
