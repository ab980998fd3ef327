#pragma once
/// \file
/// `detail::GraphedStep`: one training batch's optimization in graph mode (`Graphed<...>`,
/// volt/accelerators/graphed.hpp) — eager warm-up steps, the capture of each step variant, the copy of each batch
/// into the static inputs (checked against the captured layout), the replay, and the log calls read back from the
/// graph's outputs. One of the training step's variants (loops/step_parts.hpp has what they share and the sequences
/// they run); the fit loop owns one for the fit's batch type, so the graphs and their memory pool live exactly as long as the fit.
///
/// A step is one of four variants, by whether it starts an accumulation window (zeroes the gradients) and whether it
/// ends one (steps the optimizer): index `2 * starts + steps`. Each is captured the first time it is needed, all from
/// one memory pool. The module-dependent rules of graph mode (`graph_rule`) are here too; the others are in
/// volt/rules.hpp.

#include "volt/context.hpp"
#include "volt/errors.hpp"
#include "volt/loops/batch_layout.hpp"
#include "volt/loops/hooks.hpp"
#include "volt/loops/step_parts.hpp"
#include "volt/metric_store.hpp"
#include "volt/module.hpp"
#include "volt/optim/fused.hpp"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace volt::detail {

/// Graph mode's rules that need the module's type, in the order they are said (`none`: all hold).
enum class GraphRule { none, manual, optimizer, module_hook, callback_hook };

/// The first of graph mode's module-dependent rules that Trainer `T` (callbacks `Cs...`) breaks with module `Impl`.
template <class T, class Impl, class... Cs>
constexpr GraphRule graph_rule(std::tuple<Cs...>*) {
  namespace h = hooks;
  if (manual_optimization<Impl>) return GraphRule::manual;
  if (!optim::CapturableOptimizer<module_optimizer_t<Impl>>) return GraphRule::optimizer;
  if (h::on_before_backward::module_has<Impl, const torch::Tensor> || h::on_after_backward::module_has<Impl> ||
      h::on_before_optimizer_step::module_has<Impl, torch::optim::Optimizer>) {
    return GraphRule::module_hook;
  }
  if ((h::on_before_backward::callback_has<Cs, T, Impl, const torch::Tensor> || ... || false) ||
      (h::on_after_backward::callback_has<Cs, T, Impl> || ... || false) ||
      (h::on_before_optimizer_step::callback_has<Cs, T, Impl, torch::optim::Optimizer> || ... || false)) {
    return GraphRule::callback_hook;
  }
  return GraphRule::none;
}
template <class T, class Impl>
inline constexpr GraphRule graph_rule_v = graph_rule<T, Impl>(static_cast<typename T::callback_tuple*>(nullptr));

/// Graph mode's rules that need the module's type, as `static_assert`s (phase (a)); `fit` instantiates it.
template <class T, class Impl>
struct CheckedGraphRules {
  static constexpr GraphRule broken = graph_rule_v<T, Impl>;
  static_assert(broken != GraphRule::manual,
                "volt: use the accelerator without Graphed for a module with manual optimization "
                "(automatic_optimization = false), or let volt step its optimizer: graph mode captures one automatic "
                "step (backward, clipping, the optimizer step) per batch, and a manual training_step decides on the "
                "host which optimizers step.");
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
  static constexpr bool ok = broken == GraphRule::none;
};

/// Whether a hook may keep the loss `on_train_batch_end` gives it past the hook: the module's own, or a callback's
/// unless it declares `keeps_loss = false` (callbacks/concept.hpp). Graph mode then hands it a copy of the graph's
/// output, which the next replay rewrites.
template <class T, class Impl, class B, class... Cs>
constexpr bool loss_kept(std::tuple<Cs...>*) {
  namespace h = hooks;
  return h::on_train_batch_end::module_has<Impl, torch::Tensor, B, int64_t> ||
         ((h::on_train_batch_end::callback_has<Cs, T, Impl, torch::Tensor, B, int64_t> && keeps_loss<Cs>) || ... ||
          false);
}

/// Graph mode's step for Trainer `T` (reached through `StepParts`), module `Impl` and batch type `B`.
template <class T, class Impl, class B>
class GraphedStep {
  using G = typename T::accelerator_type::graph_type;
  using O = module_optimizer_t<Impl>;

 public:
  GraphedStep(StepParts<T> parts, Impl& /*module*/, Context& /*ctx*/) : p_(parts) {}

  /// Runs the batch's optimization: eagerly while warming up and for a last batch of another shape or layout, else
  /// by replay (capturing the variant first when it is new). Returns the detached loss.
  template <class Batch>
  torch::Tensor run(Impl& module, Context& ctx, Batch& batch, const Window& w) {
    O& optimizer = static_cast<O&>(p_.optimizers.front().optimizer());
    if (w.starts) p_.template hook<hooks::on_before_zero_grad>(module, ctx, static_cast<torch::optim::Optimizer&>(optimizer));
    optimizer.refresh_device_lr();  // a scheduler's new rate, into the tensors the step reads

    const bool warming = warm_batches_ < T::accelerator_type::warmup_batches;
    const std::string mismatch = this->mismatch(batch);
    if (!mismatch.empty() && !w.is_last) {
      throw StepError("volt: Graphed: training batch " + std::to_string(p_.state.batch_idx) + " of epoch " +
                      std::to_string(p_.state.current_epoch) + " " + mismatch + ". Graph mode replays one batch "
                      "layout and shape (only the epoch's last batch may differ; it runs eagerly): give the loader a "
                      "fixed batch size and keep values other than tensors out of the batch, or use the accelerator "
                      "without Graphed.");
    }
    if (warming || !mismatch.empty()) {
      torch::Tensor loss;
      auto run = [&] { loss = p_.with_device_batch(batch, [&](auto& b) { return body(module, ctx, b, w, optimizer); }); };
      if (warming) {
        warm.run_eager(p_.state.device, run);
        ++warm_batches_;
      } else {
        run();
      }
      if (loss.defined() && w.steps) p_.count_step(p_.optimizers.front());
      return loss;
    }
    const int v = (w.starts ? 2 : 0) + (w.steps ? 1 : 0);
    copy_in(batch, [&](const at::Tensor& t) {
      return p_.with_device_batch(t, [](const at::Tensor& prepared) { return prepared; });
    });
    if (!captured[v]) capture(v, module, ctx, w, optimizer);
    return replay(v, w);
  }

 private:
  /// The step on a batch already on the device; every op in it is one a graph can hold (nothing read on the host).
  template <class Batch>
  torch::Tensor body(Impl& module, Context& ctx, Batch& b, const Window& w, O& optimizer) {
    torch::Tensor loss;
    {
      // Autocast's cache of cast weights off, as PyTorch requires for captured steps: no cast made outside the graph
      // is ever read inside it. The values are the same either way.
      struct CastCacheOff {
        bool was = at::autocast::is_autocast_cache_enabled();
        CastCacheOff() { at::autocast::set_autocast_cache_enabled(false); }
        ~CastCacheOff() { at::autocast::set_autocast_cache_enabled(was); }
      } cache_off;
      loss = p_.training_step(module, ctx, b);
    }
    if (std::exchange(p_.state.loss_units, torch::Tensor()).defined()) {
      throw std::logic_error("volt: weigh_loss is not available in graph mode (Graphed<GPU>), whose steps replay one "
                             "capture; train eagerly (GPU) to weigh each batch's loss by its units.");
    }
    // In place: a captured step keeps every gradient tensor (also when the step returned no loss, an eager step, as
    // Lightning zeroes them).
    if (w.starts) zero_grad(p_.params, /*keep_tensors=*/true);
    if (!loss.defined()) return loss;
    const torch::Tensor scaled = w.size > 1 ? loss / static_cast<double>(w.size) : loss;
    p_.backward(module, ctx, scaled, w.steps, "the backward pass of training_step's loss");
    if (w.steps) {
      p_.template optimizer_step</*Captured=*/true>(module, ctx, optimizer);
      p_.precision.update();
    }
    return loss.detach();
  }

  /// Log calls go to variant `v`'s recorder while its step runs on the host (at capture, or at a replay that runs it
  /// again).
  struct Redirect {
    MetricStore& store;
    LogRecorder& recorder;
    Redirect(MetricStore& s, LogRecorder& r) : store(s), recorder(r) {
      recorder.begin();
      store.redirect(&recorder);
    }
    void done() { recorder.end(); }
    ~Redirect() { store.redirect(nullptr); }
  };

  /// Captures variant `v` on the static batch; a failure says why a captured step cannot do what it did.
  void capture(int v, Impl& module, Context& ctx, const Window& w, O& optimizer) {
    std::vector<const void*> had_grads;
    for (const auto& p : p_.params) had_grads.push_back(p.grad().defined() ? p.grad().unsafeGetTensorImpl() : nullptr);
    try {
      Redirect redirect(p_.train_store, logs[v]);
      // By value what belongs to this call (a graph type that runs the step's host code again at replay, as the CPU
      // tests' does, calls this after it has returned); the module, its Context and the optimizer live for the fit.
      graphs[v].capture(p_.state.device, [this, &module, &ctx, &optimizer, v, w] {
        const torch::Tensor l = body(module, ctx, *inputs, w, optimizer);
        if (!l.defined()) {
          throw std::invalid_argument("training_step returned no loss (an undefined tensor), so there is no step to "
                                      "capture; in graph mode training_step must return a loss for every batch");
        }
        // The graph's output: a graph type that runs this again at replay (not CUDA's) writes into the same tensor.
        if (loss[v].defined()) {
          loss[v].copy_(l);
        } else {
          loss[v] = l;
        }
      }, shared());
      redirect.done();
    } catch (const std::exception& e) {
      std::throw_with_nested(StepError(
          "volt: Graphed: capturing the training step failed in epoch " + std::to_string(p_.state.current_epoch) +
          ", batch " + std::to_string(p_.state.batch_idx) + ": " + detail::step_error_message(e) +
          " A captured step runs its host code "
          "once and must not wait for the device: no .item(), printing or copying tensors to the host, and no shapes "
          "that depend on data (torch::nonzero, boolean masks) inside training_step; move such code to "
          "on_train_batch_end or validation, or use the accelerator without Graphed."));
    }
    captured[v] = true;
    for (std::size_t i = 0; i < p_.params.size(); ++i) {
      const void* now = p_.params[i].grad().defined() ? p_.params[i].grad().unsafeGetTensorImpl() : nullptr;
      if (now != had_grads[i]) {
        throw StepError("volt: Graphed: parameter " + std::to_string(i) + " (of " + std::to_string(p_.params.size()) +
                        ") got a new gradient tensor while the step was captured, not in the " +
                        std::to_string(T::accelerator_type::warmup_batches) + " eager steps before it: the step's "
                        "structure changed, so the graph would write into a gradient the optimizer does not read. "
                        "Make every parameter that trains get its gradient in every step.");
      }
    }
  }

  /// Replays variant `v`, adds its log calls to the epoch's store, and returns its loss (a copy where a hook that
  /// takes it may keep it: callbacks/concept.hpp).
  torch::Tensor replay(int v, const Window& w) {
    {
      Redirect redirect(p_.train_store, logs[v]);  // for a graph type that runs the step's host code again
      graphs[v].replay();
      redirect.done();
    }
    for (const auto& c : logs[v].calls()) {  // the graph's outputs are rewritten by the next replay: copies
      p_.train_store.add(c.name, c.value.clone(), c.options, c.on_step, c.on_epoch, c.batch_size);
    }
    if (w.steps) p_.count_step(p_.optimizers.front());
    if constexpr (loss_kept<T, Impl, B>(static_cast<typename T::callback_tuple*>(nullptr))) {
      return loss[v].clone();
    } else {
      return loss[v];
    }
  }

  /// Runs the warm-up steps; its stream is the one captures use.
  G warm;
  std::array<G, 4> graphs;
  std::array<bool, 4> captured{};
  /// What `ctx.log` recorded in each variant's `training_step`.
  std::array<LogRecorder, 4> logs;
  /// Each variant's loss (its output, rewritten by every replay).
  std::array<at::Tensor, 4> loss;
  /// The batch the graphs read, on the device; its tensors in the order the loader's batches visit theirs; and the
  /// layout every replayed batch must have (`batch_layout`).
  std::optional<B> inputs;
  std::vector<at::Tensor> input_tensors;
  std::string layout;
  /// Eager batches run before the first capture.
  int64_t warm_batches_ = 0;

  /// The graph a new capture shares memory with: one captured before, or the warm-up's (same stream, new pool).
  const G* shared() const {
    for (std::size_t v = 0; v < graphs.size(); ++v) {
      if (captured[v]) return &graphs[v];
    }
    return &warm;
  }

  /// Why `batch` cannot be copied into the static batch (empty when it can, and before there is one): another
  /// layout (`batch_layout`), or tensors of other shapes.
  std::string mismatch(const B& batch) const {
    if (!inputs) return {};
    const std::string given_layout = batch_layout(batch);
    if (given_layout != layout) {
      return "is laid out as " + given_layout + " but the step was captured for " + layout + " (t: a tensor; what is "
             "not a tensor is replayed as captured, and tensors are copied in by their place)";
    }
    const std::vector<at::Tensor> given = tensors_of(batch);
    for (std::size_t i = 0; i < given.size(); ++i) {
      if (given[i].sizes() != input_tensors[i].sizes()) {
        return "has tensors of shapes [" + shapes_text(given) + "] but the step was captured for [" +
               shapes_text(input_tensors) + "]";
      }
    }
    return {};
  }

  /// Copies `batch` into the static batch. The first time, makes the static batch from it, each tensor through
  /// `prepare` (to the device and dtype a step sees) and cloned, and keeps the static tensors in the order `batch`'s
  /// are visited, the order later batches' tensors are copied in (the static batch's own order may differ: a rebuilt
  /// unordered map iterates in another order).
  template <class Prepare>
  void copy_in(const B& batch, Prepare&& prepare) {
    if (!inputs) {
      layout = batch_layout(batch);
      inputs.emplace(map_tensors(batch, [&](const at::Tensor& t) {
        at::Tensor copy = prepare(t).clone();
        input_tensors.push_back(copy);
        return copy;
      }));
      return;
    }
    const std::vector<at::Tensor> given = tensors_of(batch);
    for (std::size_t i = 0; i < given.size(); ++i) input_tensors[i].copy_(given[i], /*non_blocking=*/true);
  }

  StepParts<T> p_;
};

}  // namespace volt::detail
