#pragma once
/// \file
/// `detail::StepParts<T>`: what a training step object (loops/automatic_step.hpp, loops/graphed_step.hpp,
/// loops/manual_step.hpp) reaches of the Trainer `T` that owns it, and the two sequences every step shares, each
/// written once, as Lightning's `Strategy.backward` and `Strategy.optimizer_step` are:
///   - the backward sequence: on_before_backward, the strategy's pre_backward(sync), the precision's backward (its
///     loss scaling), post_backward, on_after_backward;
///   - the step sequence: the gradients unscaled, on_before_optimizer_step, `gradient_clip_val`'s clipping, the
///     optimizer's step through the strategy (graph mode: on the device); then the loss scale's update and the step
///     counted (`count_step`), which each step places: after every step (automatic), once per training_step
///     (manual, the update), outside the captured graph (graph mode, the count).
///
/// What the bundle holds, and why: the policies the sequences call (strategy, precision), the callbacks with the
/// Trainer they are handed (hooks give callbacks the Trainer, as Lightning's give `trainer`), the options (clipping),
/// the loop state (the device a batch goes to, where an error happened, the step counter, the manual step's pointer),
/// the fit's optimizers and parameters, and the training epoch's metric store (graph mode records a captured step's
/// log calls and adds them back after each replay). The Trainer builds it for each fit from its own members; a step
/// sees nothing else of the Trainer, and the Trainer has no friends.

#include "volt/context.hpp"
#include "volt/loops/batches.hpp"
#include "volt/loops/hooks.hpp"
#include "volt/loops/optimization.hpp"
#include "volt/metric_store.hpp"
#include "volt/optim/gradients.hpp"
#include "volt/options.hpp"

#include <ATen/record_function.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <type_traits>
#include <utility>
#include <vector>

namespace volt::detail {

template <class T>
struct StepParts {
  using strategy_type = typename T::strategy_type;
  using precision_type = typename T::precision_type;
  using accelerator_type = typename T::accelerator_type;
  using callback_tuple = typename T::callback_tuple;

  /// The Trainer, as hooks hand it to callbacks (its public members only).
  T& trainer;
  strategy_type& strategy;
  precision_type& precision;
  callback_tuple& callbacks;
  const TrainerOptions& options;
  LoopState& state;
  /// The fit's optimizers, in configure_optimizers' order, and the module's parameters.
  std::vector<ScheduledOptimizer>& optimizers;
  const std::vector<torch::Tensor>& params;
  /// The running training epoch's logged values.
  MetricStore& train_store;

  /// Hook `H` on every callback in pack order, then on the module (loops/hooks.hpp).
  template <class H, class Impl, class... Args>
  decltype(auto) hook(Impl& module, Context& ctx, Args&&... args) {
    return call_hook<H>(callbacks, trainer, module, ctx, std::forward<Args>(args)...);
  }

  /// Calls `f` with `batch` as a step sees it (loops/batches.hpp).
  template <class B, class F>
  decltype(auto) with_device_batch(B& batch, F&& f) {
    return detail::with_device_batch<accelerator_type, precision_type>(batch, state.device, std::forward<F>(f));
  }

  /// `module.training_step(b, ctx)` under the precision's forward context, an error said with where it happened.
  template <class Impl, class B>
  decltype(auto) training_step(Impl& module, Context& ctx, B& b) {
    RECORD_USER_SCOPE("volt::training_step");  // a range in a profiler's trace (callbacks/profiler.hpp)
    [[maybe_unused]] auto autocast = precision.forward_context(accelerator_type::device_type);
    return run_module_step(state, "training_step", [&]() -> decltype(auto) {
      auto scope = strategy.forward_scope(Stage::train);  // (held to the step's end: FSDP gathers its root here)
      if constexpr (std::is_same_v<decltype(module.training_step(b, ctx)), torch::Tensor>) {
        torch::Tensor loss = module.training_step(b, ctx);
        if (!loss.defined()) scope.no_backward();  // a skipped batch
        return loss;
      } else {
        return module.training_step(b, ctx);
      }
    });
  }

  /// The backward sequence (see the file comment) for `loss`; `sync`: the strategy synchronises the gradients (the
  /// micro-batch that steps). `where` names the backward in an error from it (null: the caller's step does, as a
  /// `manual_backward` inside training_step).
  template <class Impl>
  void backward(Impl& module, Context& ctx, const torch::Tensor& loss, bool sync, const char* where) {
    RECORD_USER_SCOPE("volt::backward");
    hook<hooks::on_before_backward>(module, ctx, loss);
    strategy.pre_backward(sync);
    if (where != nullptr) {
      run_module_step(state, where, [&] { precision.backward(loss); });
    } else {
      precision.backward(loss);
    }
    strategy.post_backward();
    hook<hooks::on_after_backward>(module, ctx);
  }

  /// The step sequence (see the file comment) for `optimizer`, up to the step itself; returns whether it stepped
  /// (false: skipped for an inf/NaN; always true in graph mode, where the skip happens on the device). `unscale`:
  /// its gradients are not unscaled yet. `Captured`: graph mode's step, nothing read on the host.
  template <bool Captured = false, class Impl, class O>
  bool optimizer_step(Impl& module, Context& ctx, O& optimizer, bool unscale = true) {
    RECORD_USER_SCOPE("volt::optimizer_step");
    if (unscale) precision.unscale_gradients(optimizer);
    hook<hooks::on_before_optimizer_step>(module, ctx, static_cast<torch::optim::Optimizer&>(optimizer));
    if (const auto& clip = options.gradient_clip_val; clip && *clip > 0.0) {
      strategy.clip_gradients(params, *clip, options.gradient_clip_algorithm);
    }
    if constexpr (Captured) {
      precision.optimizer_step_on_device(optimizer);
      return true;
    } else {
      return strategy.optimizer_step(precision, optimizer);
    }
  }

  /// An optimizer step was taken: the step counter, and the optimizer's scheduler when it steps per optimizer step.
  void count_step(ScheduledOptimizer& optimizer) {
    ++state.global_step;
    optimizer.stepped();
  }
};

}  // namespace volt::detail
