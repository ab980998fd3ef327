#pragma once
/// \file
/// `detail::ManualStep`: one training batch under manual optimization, as Lightning's `_ManualOptimization` — the
/// module's `training_step` runs under the precision's context and steps its own optimizers through its Context
/// (`ctx.optimizers()`, `ctx.manual_backward(loss)`, `opt.step()`, `ctx.clip_gradients`, `ctx.toggle_optimizer`,
/// `ctx.no_sync()`); this object is what those calls reach. One of the training step's variants
/// (loops/optimization.hpp has what they share); the fit loop owns one for the length of a fit.
///
/// The loss scale (Fp16Mixed) is shared by every optimizer, as PyTorch's GradScaler is: each manual_backward scales
/// its loss, each optimizer is unscaled once (by clip_gradients or its step), and the scale is updated once, after
/// training_step returns, from what every optimizer unscaled found. So under a precision that scales the loss an
/// optimizer steps at most once per training_step; without one (Fp32, Bf16Mixed, ...) it may step any number of times.

#include "volt/context.hpp"
#include "volt/detail/torch_compat.hpp"
#include "volt/loops/hooks.hpp"
#include "volt/loops/optimization.hpp"

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

/// The manual step for Trainer `T` (a friend of it) and module `Impl`. While it lives, the module's Contexts reach
/// it (`LoopState::manual`); it gives every parameter back its requires_grad when it ends.
template <class T, class Impl>
class ManualStep final : public ManualOptimization {
 public:
  ManualStep(T& trainer, Impl& module, Context& ctx)
      : t_(trainer), module_(module), ctx_(ctx), unscaled_(t_.optim_.size()), stepped_(t_.optim_.size()) {
    t_.state_.manual = this;
  }
  ManualStep(const ManualStep&) = delete;
  ManualStep& operator=(const ManualStep&) = delete;
  ~ManualStep() override {
    restore_requires_grad();
    t_.state_.manual = nullptr;
  }

  /// Runs the module's training_step; afterwards the loss scale's update when an optimizer was unscaled. Returns
  /// what the step returned, detached (undefined when it returns nothing), for on_train_batch_end.
  template <class B>
  torch::Tensor run(Impl& module, Context& ctx, B& batch, const Window& /*w*/) {
    torch::Tensor out;
    t_.with_device_batch(batch, [&](auto& b) {
      [[maybe_unused]] auto guard = t_.precision_.forward_context(T::accelerator_type::device_type);
      run_module_step(t_.state_, "training_step", [&] {
        if constexpr (std::is_convertible_v<decltype(module.training_step(b, ctx)), torch::Tensor>) {
          out = module.training_step(b, ctx);
        } else {
          module.training_step(b, ctx);
        }
      });
    });
    end_iteration();
    return out.defined() ? out.detach() : out;
  }

  // ---- what the module's Context calls ----

  std::size_t size() const override { return t_.optim_.size(); }
  torch::optim::Optimizer& optimizer(std::size_t i) override { return t_.optim_.at(i).optimizer(); }
  torch::optim::LRScheduler* scheduler(std::size_t i) override { return t_.optim_.at(i).config.scheduler.get(); }

  void backward(const torch::Tensor& loss) override {
    t_.template hook<hooks::on_before_backward>(module_, ctx_, loss);
    t_.strategy_.pre_backward(sync_);
    t_.precision_.backward(loss);
    t_.strategy_.post_backward();
    t_.template hook<hooks::on_after_backward>(module_, ctx_);
  }

  bool step(std::size_t i) override {
    constexpr bool scales_loss = T::precision_type::scales_loss;
    if (scales_loss && stepped_.at(i)) {
      throw std::logic_error("volt: optimizer " + std::to_string(i) + " stepped twice in one training_step under " +
                             T::precision_type::name + ", whose loss scale is updated once per training_step, after "
                             "it (as PyTorch's GradScaler with several optimizers); step each optimizer at most once "
                             "per batch, or use a precision without loss scaling (Bf16Mixed, Fp32).");
    }
    unscale(i);
    torch::optim::Optimizer& opt = t_.optim_[i].optimizer();
    t_.template hook<hooks::on_before_optimizer_step>(module_, ctx_, opt);
    const bool stepped = t_.precision_.optimizer_step(opt);
    stepped_[i] = true;
    if (!scales_loss) unscaled_[i] = false;  // nothing to unscale: the next step may come at any time
    t_.count_optimizer_step(t_.optim_[i]);
    return stepped;
  }

  void zero_grad(std::size_t i) override { ::volt::detail::zero_grad(optimizer(i)); }

  void clip(std::size_t i, double value, ClipAlgorithm algorithm) override {
    unscale(i);
    clip_gradients(optimizer_params(t_.optim_.at(i).optimizer()), value, algorithm);
  }

  void toggle(std::size_t i) override {
    if (toggled_) {
      throw std::logic_error("volt: toggle_optimizer(optimizer " + std::to_string(i) + ") while optimizer " +
                             std::to_string(*toggled_) + " is toggled; call untoggle_optimizer on it first.");
    }
    for (const auto& slot : t_.optim_) {
      for (const auto& p : optimizer_params(slot.optimizer())) {
        if (saved(p)) continue;
        requires_grad_.emplace(p.unsafeGetTensorImpl(), std::make_pair(p, p.requires_grad()));
        p.set_requires_grad(false);
      }
    }
    for (const auto& p : optimizer_params(t_.optim_.at(i).optimizer())) p.set_requires_grad(*saved(p));
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
    t_.precision_.unscale_gradients(t_.optim_[i].optimizer());
    unscaled_[i] = true;
  }
  /// After training_step: the loss scale's update, once, when any optimizer was unscaled or stepped.
  void end_iteration() {
    bool any = false;
    for (std::size_t i = 0; i < unscaled_.size(); ++i) any = any || unscaled_[i] || stepped_[i];
    if (any) t_.precision_.update();
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

  T& t_;
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
