#pragma once
/// \file
/// `detail::AutomaticStep`: one training batch's optimization under automatic optimization, as Lightning's
/// `_AutomaticOptimization` — zero_grad at a window's start, the step under the precision's context, backward with
/// the strategy's gradient hooks, and at a window's end unscaling, clipping, the optimizer step and the loss scale's
/// update. One of the training step's variants (loops/step_parts.hpp has what they share and the sequences they
/// run); the fit loop owns one for the length of a fit and calls `run` for every batch.

#include "volt/context.hpp"
#include "volt/loops/hooks.hpp"
#include "volt/loops/step_parts.hpp"

#include <torch/types.h>

#include <tuple>

namespace volt::detail {

/// Whether the module or a callback of Trainer `T` has `on_before_zero_grad`, which runs between training_step and
/// zero_grad.
template <class T, class Impl, class... Cs>
constexpr bool zero_grad_observed(std::tuple<Cs...>*) {
  return hooks::on_before_zero_grad::module_has<Impl, torch::optim::Optimizer> ||
         (hooks::on_before_zero_grad::callback_has<Cs, T, Impl, torch::optim::Optimizer> || ... || false);
}

/// The automatic step on the host, for a Trainer `T`: it reaches the Trainer through `StepParts` only.
template <class T>
class AutomaticStep {
 public:
  template <class Impl>
  AutomaticStep(StepParts<T> parts, Impl& /*module*/, Context& /*ctx*/) : p_(parts) {}

  /// Runs the batch's optimization. Returns the detached loss (undefined: the step returned none, which skips the
  /// batch's optimization, as returning None in Lightning).
  template <class Impl, class Batch>
  torch::Tensor run(Impl& module, Context& ctx, Batch& batch, const Window& w) {
    ScheduledOptimizer& slot = p_.optimizers.front();
    torch::optim::Optimizer& optimizer = slot.optimizer();
    // Lightning zeroes the gradients after training_step, with on_before_zero_grad between them; where no hook can see
    // the difference, they are zeroed before it, as a hand-written loop does: the old gradients' memory is then free
    // for the step's activations, while zeroing after the forward makes the allocator hand memory back to the system
    // and fault it in again at every step (5% of a small MLP's step on the CPU; bench/trainer_vs_raw).
    constexpr bool zero_seen = zero_grad_observed<T, Impl>(static_cast<typename T::callback_tuple*>(nullptr));
    if (!zero_seen && w.starts) p_.strategy.zero_grad(optimizer);
    torch::Tensor loss =
        p_.with_device_batch(batch, [&](auto& b) -> torch::Tensor { return p_.training_step(module, ctx, b); });
    if (zero_seen && w.starts) {  // also when the step returned no loss, as Lightning zeroes them
      p_.template hook<hooks::on_before_zero_grad>(module, ctx, optimizer);
      p_.strategy.zero_grad(optimizer);
    }
    if (!loss.defined()) return loss;
    const torch::Tensor scaled = w.size > 1 ? loss / static_cast<double>(w.size) : loss;
    p_.backward(module, ctx, scaled, w.steps, "the backward pass of training_step's loss");
    if (w.steps) {
      p_.optimizer_step(module, ctx, optimizer);
      p_.precision.update();
      p_.count_step(slot);
    }
    return loss.detach();
  }

 private:
  StepParts<T> p_;
};

}  // namespace volt::detail
