#pragma once
/// \file
/// `detail::ManualStep`: one training batch under manual optimization, as Lightning's `_ManualOptimization` — the
/// module's `training_step` runs under the precision's context and steps its own optimizers through its Context
/// (`ctx.optimizers()`, `ctx.manual_backward(loss)`, `opt.step()`, `ctx.clip_gradients`, `ctx.toggle_optimizer`,
/// `ctx.no_sync()`); this object is what those calls reach. One of the training step's variants
/// (loops/step_parts.hpp has what they share and the sequences they run); the fit loop owns one for the length of a
/// fit.
///
/// The loss scale (Fp16Mixed) is shared by every optimizer, as PyTorch's GradScaler is: each manual_backward scales
/// its loss, each optimizer is unscaled once (by clip_gradients or its step), and the scale is updated once, after
/// training_step returns, from what every optimizer unscaled found. So under a precision that scales the loss an
/// optimizer steps at most once per training_step; without one (Fp32, Bf16Mixed, ...) it may step any number of times.

#include "volt/context.hpp"
#include "volt/loops/step_parts.hpp"

#include <torch/types.h>

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt::detail {

/// The manual step for Trainer `T` (reached through `StepParts`) and module `Impl`. While it lives, the module's Contexts reach
/// it (`LoopState::manual`); it gives every parameter back its requires_grad when it ends.
template <class T, class Impl>
class ManualStep final : public ManualOptimization {
 public:
  ManualStep(StepParts<T> parts, Impl& module, Context& ctx)
      : p_(parts), module_(module), ctx_(ctx), unscaled_(p_.optimizers.size()), stepped_(p_.optimizers.size()) {
    p_.state.manual = this;
  }
  ManualStep(const ManualStep&) = delete;
  ManualStep& operator=(const ManualStep&) = delete;
  ~ManualStep() override {
    restore_requires_grad();
    p_.state.manual = nullptr;
  }

  /// Runs the module's training_step; afterwards the loss scale's update when an optimizer was unscaled. Returns
  /// what the step returned, detached (undefined when it returns nothing), for on_train_batch_end.
  template <class B>
  torch::Tensor run(Impl& module, Context& ctx, B& batch, const Window& /*w*/) {
    torch::Tensor out;
    p_.with_device_batch(batch, [&](auto& b) {
      if constexpr (std::is_convertible_v<decltype(module.training_step(b, ctx)), torch::Tensor>) {
        out = p_.training_step(module, ctx, b);
      } else {
        p_.training_step(module, ctx, b);
      }
    });
    end_iteration();
    return out.defined() ? out.detach() : out;
  }

  // ---- what the module's Context calls ----

  std::size_t size() const override { return p_.optimizers.size(); }
  torch::optim::Optimizer& optimizer(std::size_t i) override { return p_.optimizers.at(i).optimizer(); }
  torch::optim::LRScheduler* scheduler(std::size_t i) override { return p_.optimizers.at(i).config.scheduler.get(); }

  void backward(const torch::Tensor& loss) override { p_.backward(module_, ctx_, loss, sync_, nullptr); }

  bool step(std::size_t i) override {
    constexpr bool scales_loss = T::precision_type::scales_loss;
    if (scales_loss && stepped_.at(i)) {
      throw std::logic_error("volt: optimizer " + std::to_string(i) + " stepped twice in one training_step under " +
                             T::precision_type::name + ", whose loss scale is updated once per training_step, after "
                             "it (as PyTorch's GradScaler with several optimizers); step each optimizer at most once "
                             "per batch, or use a precision without loss scaling (Bf16Mixed, Fp32).");
    }
    unscale(i);
    const bool stepped = p_.optimizer_step(module_, ctx_, p_.optimizers[i].optimizer(), /*unscale=*/false);
    stepped_[i] = true;
    if (!scales_loss) unscaled_[i] = false;  // nothing to unscale: the next step may come at any time
    p_.count_step(p_.optimizers[i]);
    return stepped;
  }

  void zero_grad(std::size_t i) override { p_.strategy.zero_grad(optimizer(i)); }

  void clip(std::size_t i, double value, ClipAlgorithm algorithm) override {
    unscale(i);
    p_.strategy.clip_gradients(optimizer_params(optimizer(i)), value, algorithm);
  }

  void toggle(std::size_t i) override {
    if (toggled_) {
      throw std::logic_error("volt: toggle_optimizer(optimizer " + std::to_string(i) + ") while optimizer " +
                             std::to_string(*toggled_) + " is toggled; call untoggle_optimizer on it first.");
    }
    for (const auto& slot : p_.optimizers) {
      for (const auto& p : optimizer_params(slot.optimizer())) {
        if (saved(p)) continue;
        requires_grad_.emplace(p.unsafeGetTensorImpl(), std::make_pair(p, p.requires_grad()));
        p.set_requires_grad(false);
      }
    }
    for (const auto& p : optimizer_params(optimizer(i))) p.set_requires_grad(*saved(p));
    toggled_ = i;
  }

  void untoggle(std::size_t i) override {
    if (toggled_ != i) {
      throw std::logic_error("volt: untoggle_optimizer(optimizer " + std::to_string(i) + ") but " +
                             (toggled_ ? "optimizer " + std::to_string(*toggled_) + " is toggled"
                                       : std::string("no optimizer is toggled")) + ".");
    }
    restore_requires_grad();
  }

  bool set_sync(bool sync) override { return std::exchange(sync_, sync); }

 private:
  /// Optimizer `i`'s gradients divided by the loss scale, once per iteration.
  void unscale(std::size_t i) {
    if (unscaled_.at(i)) return;
    p_.precision.unscale_gradients(p_.optimizers[i].optimizer());
    unscaled_[i] = true;
  }
  /// After training_step: the loss scale's update, once, when any optimizer was unscaled or stepped.
  void end_iteration() {
    bool any = false;
    for (std::size_t i = 0; i < unscaled_.size(); ++i) any = any || unscaled_[i] || stepped_[i];
    if (any) p_.precision.update();
    unscaled_.assign(unscaled_.size(), false);
    stepped_.assign(stepped_.size(), false);
  }
  /// The requires_grad `p` had before the toggle, if it was recorded.
  std::optional<bool> saved(const torch::Tensor& p) const {
    const auto it = requires_grad_.find(p.unsafeGetTensorImpl());
    if (it == requires_grad_.end()) return std::nullopt;
    return it->second.second;
  }
  void restore_requires_grad() {
    for (auto& [impl, entry] : requires_grad_) entry.first.set_requires_grad(entry.second);
    requires_grad_.clear();
    toggled_.reset();
  }

  StepParts<T> p_;
  Impl& module_;
  Context& ctx_;
  /// Per optimizer, in this iteration: its gradients were unscaled; it stepped.
  std::vector<bool> unscaled_, stepped_;
  /// Whether manual_backward synchronises gradients (a `no_sync()` guard turns it off).
  bool sync_ = true;
  /// The toggled optimizer, and every optimizer parameter's requires_grad from before the toggle.
  std::optional<std::size_t> toggled_;
  std::unordered_map<const c10::TensorImpl*, std::pair<torch::Tensor, bool>> requires_grad_;
};

}  // namespace volt::detail
