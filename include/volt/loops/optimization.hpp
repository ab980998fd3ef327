#pragma once
/// \file
/// What the training step's variants share (loops/automatic_step.hpp, loops/graphed_step.hpp,
/// loops/manual_step.hpp), written once: the accumulation window a batch falls in, each optimizer with its scheduler
/// and the steps it has taken (when a scheduler steps), gradient clipping, and the checks on what
/// `configure_optimizers` returned.

#include "volt/errors.hpp"
#include "volt/module.hpp"
#include "volt/options.hpp"

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>
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

/// Where clipping may read the gradients' norm: on the host (LibTorch's `clip_grad_norm_`, bitwise as a hand-written
/// loop) or nowhere (graph mode: the same arithmetic, with the coefficient kept on the device).
enum class ClipOn { host, device };

/// Clips the gradients of `params` to a total 2-norm of `max_norm` with LibTorch's arithmetic (`clip_grad_norm_`:
/// per-tensor norms, the norm of their stack, the coefficient `max_norm / (norm + 1e-6)` clamped to 1), without
/// reading the norm back.
inline void clip_grad_norm_on_device(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads, norms;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(g.data().norm(2.0));
  const at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2.0);
  const at::Tensor coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
  for (auto& g : grads) g.data().mul_(coef);
}

/// Clips the gradients of `params` by their total norm or by value (`gradient_clip_val`, `clip_gradients`).
inline void clip_gradients(const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm,
                           ClipOn on = ClipOn::host) {
  if (algorithm == ClipAlgorithm::value) {
    torch::nn::utils::clip_grad_value_(params, value);
  } else if (on == ClipOn::device) {
    clip_grad_norm_on_device(params, value);
  } else {
    torch::nn::utils::clip_grad_norm_(params, value);
  }
}

/// The parameters an optimizer steps, in its groups' order.
inline std::vector<at::Tensor> optimizer_params(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) out.push_back(p);
  }
  return out;
}

}  // namespace volt::detail
