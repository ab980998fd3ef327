#pragma once
/// \file
/// Part of volt/trainer.hpp, included at its end: one training batch's optimization in graph mode
/// (`Graphed<...>`, volt/accelerators/graphed.hpp) — eager warm-up steps, the capture of each step variant, the copy
/// of each batch into the static inputs, the replay, and the log calls read back from the graph's outputs.
/// Not a header of its own: include volt/trainer.hpp.

#include <ATen/autocast_mode.h>

#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

namespace volt {

/// Graph mode's rules that need the module's type, each said alone (the first broken one).
template <class S, class P, class A, class... Cs>
template <class Impl>
constexpr typename Trainer<S, P, A, Cs...>::GraphRule Trainer<S, P, A, Cs...>::broken_graph_rule() {
  namespace h = detail::hooks;
  using O = module_optimizer_t<Impl>;
  if (!optim::CapturableOptimizer<O>) return GraphRule::optimizer;
  if (h::on_before_backward::module_has<Impl, const torch::Tensor> || h::on_after_backward::module_has<Impl> ||
      h::on_before_optimizer_step::module_has<Impl, torch::optim::Optimizer>) {
    return GraphRule::module_hook;
  }
  if ((h::on_before_backward::callback_has<Cs, Trainer, Impl, const torch::Tensor> || ... || false) ||
      (h::on_after_backward::callback_has<Cs, Trainer, Impl> || ... || false) ||
      (h::on_before_optimizer_step::callback_has<Cs, Trainer, Impl, torch::optim::Optimizer> || ... || false)) {
    return GraphRule::callback_hook;
  }
  return GraphRule::none;
}

/// Graph mode's rules that need the module's type, as `static_assert`s (phase (a); the others are in rules.hpp).
template <class S, class P, class A, class... Cs>
template <class Impl>
constexpr void Trainer<S, P, A, Cs...>::check_graph_rules() {
  constexpr GraphRule broken = broken_graph_rule<Impl>();
  static_assert(broken != GraphRule::optimizer,
                "volt: return a volt::optim optimizer (Adam, AdamW, SGD) from configure_optimizers, by value, in a "
                "shared_ptr or unique_ptr, or in a volt::OptimizerConfigOf<O>: graph mode (Graphed) captures the "
                "optimizer's step, and this optimizer's step cannot be captured (LibTorch's optimizers read their step "
                "counts on the host, and a volt::OptimizerConfig does not say which optimizer it holds).");
  static_assert(broken != GraphRule::module_hook,
                "volt: move the module's on_before_backward, on_after_backward or on_before_optimizer_step into "
                "training_step or on_train_batch_end, or use the accelerator without Graphed: graph mode captures the "
                "step these hooks run in, so they would run once, at capture, and never again.");
  static_assert(broken != GraphRule::callback_hook,
                "volt: leave out callbacks that have on_before_backward, on_after_backward or on_before_optimizer_step, "
                "or use the accelerator without Graphed: graph mode captures the step these hooks run in, so they "
                "would run once, at capture, and never again.");
}

/// Graph mode's optimization of one batch (what `train_batch` does between the batch hooks). Returns the detached
/// loss, or an undefined tensor when the step returned none (allowed in eager steps only).
template <class S, class P, class A, class... Cs>
template <class Impl, class B>
torch::Tensor Trainer<S, P, A, Cs...>::graphed_step(Impl& module, Context& ctx, B& batch, bool window_start,
                                                    bool steps, bool is_last) {
  using G = typename accelerator_type::graph_type;
  using O = module_optimizer_t<Impl>;
  using State = detail::GraphedSteps<G, B>;
  if (!graphs_) graphs_ = std::make_unique<State>();
  State& gs = static_cast<State&>(*graphs_);
  O& optimizer = static_cast<O&>(*optim_.optimizer);
  const c10::Device device = state_.device;
  const int64_t k = options_.accumulate_grad_batches;

  if (window_start) hook<detail::hooks::on_before_zero_grad>(module, ctx, static_cast<torch::optim::Optimizer&>(optimizer));
  optimizer.refresh_device_lr();  // a scheduler's new rate, into the tensors the step reads

  // The step on a batch already on the device; every op in it is one a graph can hold (nothing read on the host).
  auto body = [&](auto& b) -> torch::Tensor {
    torch::Tensor loss;
    {
      // Autocast's cache of cast weights off, as PyTorch requires for captured steps: no cast made outside the graph
      // is ever read inside it. The values are the same either way.
      struct CastCacheOff {
        bool was = at::autocast::is_autocast_cache_enabled();
        CastCacheOff() { at::autocast::set_autocast_cache_enabled(false); }
        ~CastCacheOff() { at::autocast::set_autocast_cache_enabled(was); }
      } cache_off;
      [[maybe_unused]] auto guard = precision_.forward_context(accelerator_type::device_type);
      loss = detail::run_module_step(state_, "training_step", [&] { return module.training_step(b, ctx); });
    }
    if (!loss.defined()) return loss;
    if (window_start) {
      std::vector<torch::Tensor> grads;
      for (const auto& p : params_) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
      if (!grads.empty()) at::_foreach_zero_(grads);
    }
    const torch::Tensor scaled = k > 1 ? loss / static_cast<double>(k) : loss;
    detail::run_module_step(state_, "the backward pass of training_step's loss", [&] { precision_.backward(scaled); });
    if (steps) {
      precision_.unscale_gradients(optimizer);
      if (options_.gradient_clip_val && *options_.gradient_clip_val > 0.0) {
        if (options_.gradient_clip_algorithm == ClipAlgorithm::norm) {
          detail::clip_grad_norm_on_device(params_, *options_.gradient_clip_val);
        } else {
          torch::nn::utils::clip_grad_value_(params_, *options_.gradient_clip_val);
        }
      }
      precision_.optimizer_step_on_device(optimizer);
    }
    return loss.detach();
  };

  // Eager: the warm-up batches (on the captures' stream), and a last batch of another shape or layout.
  const bool warming = gs.warm_batches < accelerator_type::warmup_batches;
  const std::string mismatch = gs.mismatch(batch);
  const bool fits = mismatch.empty();
  if (!fits && !is_last) {
    throw StepError("volt: Graphed: training batch " + std::to_string(state_.batch_idx) + " of epoch " +
                    std::to_string(state_.current_epoch) + " " + mismatch + ". Graph mode replays one batch layout "
                    "and shape (only the epoch's last batch may differ; it runs eagerly): give the loader a fixed batch "
                    "size and keep values other than tensors out of the batch, or use the accelerator without Graphed.");
  }
  if (warming || !fits) {
    torch::Tensor loss;
    auto run = [&] { loss = with_device_batch(batch, [&](auto& b) { return body(b); }); };
    if (warming) {
      gs.warm.run_eager(device, run);
      ++gs.warm_batches;
    } else {
      run();
    }
    if (loss.defined() && steps) count_optimizer_step();
    return loss;
  }

  const int v = State::variant(window_start, steps);
  gs.copy_in(batch, [&](const at::Tensor& t) {
    return with_device_batch(t, [](const at::Tensor& prepared) { return prepared; });
  });
  struct Redirect {  // log calls go to the variant's recorder while its step runs on the host
    detail::MetricStore& store;
    detail::LogRecorder& recorder;
    Redirect(detail::MetricStore& s, detail::LogRecorder& r) : store(s), recorder(r) {
      recorder.begin();
      store.redirect(&recorder);
    }
    void done() { recorder.end(); }
    ~Redirect() { store.redirect(nullptr); }
  };
  if (!gs.captured[v]) {
    std::vector<const void*> had_grads;
    for (const auto& p : params_) had_grads.push_back(p.grad().defined() ? p.grad().unsafeGetTensorImpl() : nullptr);
    try {
      Redirect redirect(train_store_, gs.logs[v]);
      gs.graphs[v].capture(device, [&] {
        const torch::Tensor loss = body(*gs.inputs);
        if (!loss.defined()) {
          throw std::invalid_argument("training_step returned no loss (an undefined tensor), so there is no step to "
                                      "capture; in graph mode training_step must return a loss for every batch");
        }
        // The graph's output: a graph type that runs this again at replay (not CUDA's) writes into the same tensor.
        if (gs.loss[v].defined()) {
          gs.loss[v].copy_(loss);
        } else {
          gs.loss[v] = loss;
        }
      }, gs.shared());
      redirect.done();
    } catch (const std::exception& e) {
      std::throw_with_nested(StepError(
          "volt: Graphed: capturing the training step failed in epoch " + std::to_string(state_.current_epoch) +
          ", batch " + std::to_string(state_.batch_idx) + ": " + e.what() + " A captured step runs its host code once "
          "and must not wait for the device: no .item(), printing or copying tensors to the host, and no shapes that "
          "depend on data (torch::nonzero, boolean masks) inside training_step; move such code to on_train_batch_end "
          "or validation, or use the accelerator without Graphed."));
    }
    gs.captured[v] = true;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const void* now = params_[i].grad().defined() ? params_[i].grad().unsafeGetTensorImpl() : nullptr;
      if (now != had_grads[i]) {
        throw StepError("volt: Graphed: parameter " + std::to_string(i) + " (of " + std::to_string(params_.size()) +
                        ") got a new gradient tensor while the step was captured, not in the " +
                        std::to_string(accelerator_type::warmup_batches) + " eager steps before it: the step's "
                        "structure changed, so the graph would write into a gradient the optimizer does not read. "
                        "Make every parameter that trains get its gradient in every step.");
      }
    }
  }
  {
    Redirect redirect(train_store_, gs.logs[v]);  // for a graph type that runs the step's host code again
    gs.graphs[v].replay();
    redirect.done();
  }
  for (const auto& c : gs.logs[v].calls()) {  // the graph's outputs are rewritten by the next replay: copies
    train_store_.add(c.name, c.value.clone(), c.options, c.on_step, c.on_epoch, c.batch_size);
  }
  if (steps) count_optimizer_step();
  // The loss is the graph's output, rewritten by the next replay: on_train_batch_end gets a copy where a hook that
  // takes it may keep it (callbacks/concept.hpp).
  namespace h = detail::hooks;
  constexpr bool loss_kept =
      h::on_train_batch_end::module_has<Impl, torch::Tensor, B, int64_t> ||
      ((h::on_train_batch_end::callback_has<Cs, Trainer, Impl, torch::Tensor, B, int64_t> && keeps_loss<Cs>) ||
       ... || false);
  if constexpr (loss_kept) {
    return gs.loss[v].clone();
  } else {
    return gs.loss[v];
  }
}

}  // namespace volt
