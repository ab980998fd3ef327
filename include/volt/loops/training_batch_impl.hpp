#pragma once
/// \file
/// Part of volt/trainer.hpp, included at its end: one training batch under automatic optimization, as
/// Lightning's `_AutomaticOptimization` — the step under the precision's context, backward with the strategy's
/// gradient hooks, and every k-th batch (gradient accumulation) unscaling, clipping and the optimizer step.
/// Not a header of its own: include volt/trainer.hpp.

#include <torch/nn/utils/clip_grad.h>

namespace volt {

/// One training batch: step, maybe optimizer step, hooks, metrics, maybe validation.
/// Returns false when the epoch should end here.
template <class S, class P, class A, class... Cs>
template <class Impl, class B, class VL>
bool Trainer<S, P, A, Cs...>::train_batch(Impl& module, Context& ctx, B& batch, int64_t batch_idx, bool is_last, VL* val) {
  struct InBatch {  // what a checkpoint taken during this batch records
    detail::FitProgress& p;
    InBatch(detail::FitProgress& progress, int64_t idx, bool last) : p(progress) {
      p.in_train_batch = true;
      p.train_batch_idx = idx;
      p.train_is_last = last;
      p.val_started = false;
    }
    ~InBatch() { p.in_train_batch = false; }
  } in_batch(progress_, batch_idx, is_last);
  enter_batch(batch, batch_idx);
  using detail::hooks::on_train_batch_start;
  if constexpr (!std::is_void_v<decltype(hook<on_train_batch_start>(module, ctx, batch, batch_idx))>) {
    const auto response = hook<on_train_batch_start>(module, ctx, batch, batch_idx);
    if (static_cast<int64_t>(response) == -1) {  // the module ends the epoch here
      leave_batch();
      return false;
    }
  } else {
    hook<on_train_batch_start>(module, ctx, batch, batch_idx);
  }

  const int64_t k = options_.accumulate_grad_batches;
  const bool window_start = batch_idx % k == 0;
  const bool steps = (batch_idx + 1) % k == 0 || is_last;
  progress_.mid_window = !steps;
  torch::Tensor detached;
  if constexpr (detail::captures_step<accelerator_type>) {
    if constexpr (broken_graph_rule<Impl>() == GraphRule::none) {  // else fit's static_assert has said why
      detached = graphed_step(module, ctx, batch, window_start, steps, is_last);
    }
  } else {
    detached = eager_step(module, ctx, batch, window_start, steps);
  }
  hook<detail::hooks::on_train_batch_end>(module, ctx, detached, batch, batch_idx);
  leave_batch();

  logger_.publish_step(train_store_, collectives_, has_loggers());
  if constexpr (has_loggers()) {
    if (steps && (state_.global_step % options_.log_every_n_steps == 0 || progress_.should_stop)) {
      send_to_loggers(logger_.pending());
    } else {
      logger_.pending().clear();
    }
  }

  if (should_check_val(batch_idx, is_last)) {
    progress_.val_started = true;
    run_validation(module, val);
  }
  stop_on_signal();  // still inside the batch: a checkpoint here resumes after it
  ++progress_.total_batch_idx;
  if (max_steps_reached()) return false;
  return !(progress_.should_stop && can_stop_early());
}

/// The optimization of one batch without graphs: the step under the precision's context, zero_grad at a window's
/// start, backward with the strategy's hooks, and at a window's end unscaling, clipping and the optimizer step.
/// Returns the detached loss (undefined: the step returned none, which skips the batch's optimization, as returning
/// None in Lightning).
template <class S, class P, class A, class... Cs>
template <class Impl, class B>
torch::Tensor Trainer<S, P, A, Cs...>::eager_step(Impl& module, Context& ctx, B& batch, bool window_start, bool steps) {
  const int64_t k = options_.accumulate_grad_batches;
  torch::optim::Optimizer& optimizer = *optim_.optimizer;
  torch::Tensor loss = with_device_batch(batch, [&](auto& b) -> torch::Tensor {
    [[maybe_unused]] auto guard = precision_.forward_context(accelerator_type::device_type);
    return detail::run_module_step(state_, "training_step", [&] { return module.training_step(b, ctx); });
  });
  if (!loss.defined()) return loss;
  if (window_start) {
    hook<detail::hooks::on_before_zero_grad>(module, ctx, optimizer);
    detail::zero_grad(optimizer);
  }
  const torch::Tensor scaled = k > 1 ? loss / static_cast<double>(k) : loss;
  hook<detail::hooks::on_before_backward>(module, ctx, scaled);
  strategy_.pre_backward(steps);
  detail::run_module_step(state_, "the backward pass of training_step's loss", [&] { precision_.backward(scaled); });
  strategy_.post_backward();
  hook<detail::hooks::on_after_backward>(module, ctx);
  if (steps) {
    precision_.unscale_gradients(optimizer);
    hook<detail::hooks::on_before_optimizer_step>(module, ctx, optimizer);
    clip_gradients();
    precision_.optimizer_step(optimizer);
    count_optimizer_step();
  }
  return loss.detach();
}

/// An optimizer step was taken: the step counter, and the scheduler when it steps per optimizer step.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::count_optimizer_step() {
  ++state_.global_step;
  if (optim_.scheduler && optim_.interval == Interval::step && state_.global_step % optim_.frequency == 0) {
    optim_.scheduler->step();
  }
}

/// gradient_clip_val by norm or by value, after unscaling and on_before_optimizer_step.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::clip_gradients() {
  if (!options_.gradient_clip_val || *options_.gradient_clip_val <= 0.0) return;
  if (options_.gradient_clip_algorithm == ClipAlgorithm::norm) {
    torch::nn::utils::clip_grad_norm_(params_, *options_.gradient_clip_val);
  } else {
    torch::nn::utils::clip_grad_value_(params_, *options_.gradient_clip_val);
  }
}

}  // namespace volt
