#pragma once
/// \file
/// `detail::AutomaticStep`: one training batch's optimization under automatic optimization, as Lightning's
/// `_AutomaticOptimization` — zero_grad at a window's start, the step under the precision's context, backward with
/// the strategy's gradient hooks, and at a window's end unscaling, clipping, the optimizer step and the loss scale's
/// update. One of the training step's variants (loops/step_parts.hpp has what they share and the sequences they
/// run); the fit loop owns one for the length of a fit and calls `run` for every batch.

#include "volt/context.hpp"
#include "volt/errors.hpp"
#include "volt/loops/hooks.hpp"
#include "volt/loops/step_parts.hpp"
#include "volt/strategies/concept.hpp"

#include <torch/types.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

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
    torch::Tensor units = std::exchange(p_.state.loss_units, torch::Tensor());
    if (w.starts) weighted_.reset();
    if (!loss.defined()) return loss;
    p_.backward(module, ctx, loss_for_backward(loss, std::move(units), w), w.steps,
                "the backward pass of training_step's loss");
    if (w.steps) {
      p_.optimizer_step(module, ctx, optimizer);
      p_.precision.update();
      p_.count_step(slot);
    }
    return loss.detach();
  }

 private:
  /// The loss backward takes: divided by the window's size (Lightning's rule), or, where training_step said what its
  /// loss is a mean over (`Context::weigh_loss`), weighted by those units. A weighted micro-batch's backward takes
  /// loss * units / (size * the window's first non-zero units), a scale that keeps gradients near their usual
  /// size; at the window's last micro-batch, before the ranks average the gradients, the units of every rank's window
  /// are summed (one all-reduce of a number), the gradients accumulated so far rescaled and the last loss weighted
  /// so that the average over the ranks is the mean over all their units.
  torch::Tensor loss_for_backward(const torch::Tensor& loss, torch::Tensor units, const Window& w) {
    if (!weighted_) {  // the window's first micro-batch with a loss
      weighted_ = units.defined();
      first_ = seen_ = torch::Tensor();
      pending_ = false;
    }
    if (units.defined() != *weighted_) {
      throw std::logic_error("volt: weigh_loss was called in some training_steps of an accumulation window and not in "
                             "others (batch " + std::to_string(p_.state.batch_idx) + "); call it in every one or in "
                             "none.");
    }
    if (!*weighted_) return w.size > 1 ? loss / static_cast<double>(w.size) : loss;
    if constexpr (!std::remove_reference_t<decltype(p_.strategy)>::averages_gradients) {
      throw std::logic_error("volt: weigh_loss under a strategy whose ranks hold different parts of the model "
                             "(ManualParallel), whose gradients volt does not average; weigh the loss in "
                             "training_step instead.");
    }
    units = units.to(loss.device());
    // The reference count: the window's first non-zero one (micro-batches of 0 units add nothing whatever it is).
    first_ = first_.defined() ? torch::where(first_ > 0, first_, units) : units;
    seen_ = seen_.defined() ? seen_ + units : units.clone();
    const torch::Tensor reference = first_.clamp_min(1.0);
    const double size = static_cast<double>(w.size);
    if (!w.steps) {
      refuse_sharded_window();
      pending_ = true;
      return loss * (units / (reference * size)).to(loss.scalar_type());
    }
    const torch::Tensor all = p_.strategy.all_reduce(seen_, Reduce::sum).clamp_min(1.0);
    const double world = static_cast<double>(p_.state.world_size);
    if (pending_) {  // the earlier micro-batches' gradients, this rank's alone until this backward averages them
      const torch::Tensor rescale = world * size * reference / all;
      torch::NoGradGuard no_grad;
      for (const auto& param : p_.params) {
        if (param.grad().defined()) param.mutable_grad().mul_(rescale.to(param.grad().scalar_type()));
      }
    }
    return loss * (units * world / all).to(loss.scalar_type());
  }

  /// A weighted window rescales its earlier micro-batches' gradients at its last, which a sharded layout (FSDP, a
  /// ModelParallel part sharded) has reduce-scattered by then where it syncs every micro-batch.
  void refuse_sharded_window() {
    using S = std::remove_reference_t<decltype(p_.strategy)>;
    if constexpr (declares_role<S, role::scatters_micro_batches>) {
      if (p_.strategy.scatters_each_micro_batch()) {
        throw ConfigError(std::string("volt: weigh_loss with accumulate_grad_batches > 1 under ") + S::name +
                          ", which reduce-scatters each micro-batch's sharded gradients as it ends, before the "
                          "window's units are all known; call trainer.strategy()."
                          "set_sync_every_micro_batch(false) to accumulate them locally, as DDP, or weigh without "
                          "accumulation.");
      }
    }
  }

  StepParts<T> p_;
  std::optional<bool> weighted_;  // the running window weighs its losses (unset: no loss seen in it yet)
  bool pending_ = false;          // weighted gradients of earlier micro-batches of the window wait in .grad
  torch::Tensor first_, seen_;    // the window's first non-zero units (or zeros so far), and its units so far
};

}  // namespace volt::detail
