#pragma once
/// \file
/// `volt::optim::Adam` and `AdamW`: LibTorch's `torch::optim::Adam` and `AdamW` (same options, state and archives)
/// whose step is one fused kernel per parameter group, device and dtype (see volt/optim/fused.hpp).
/// \code
///   auto configure_optimizers() { return volt::optim::AdamW(parameters(), torch::optim::AdamWOptions(1e-3)); }
/// \endcode

#include "volt/optim/fused.hpp"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace volt::optim {
namespace detail {

/// One Adam or AdamW step over every group of `optimizer`, through `kernel` (`at::_fused_adam_` or
/// `at::_fused_adamw_`), with LibTorch's state initialisation (zeros, and `max_exp_avg_sq` only with amsgrad).
/// With `lr` (graph mode) the rate is read from its device tensors and `found_inf`, when defined, skips the update on
/// the device and takes back the step count: nothing is read on the host.
template <class Options, class State, class Kernel>
void fused_adam_step(torch::optim::Optimizer& optimizer, StepTensors& steps, Kernel&& kernel, DeviceLr* lr = nullptr,
                     const at::Tensor& found_inf = {}) {
  std::optional<at::Tensor> found;
  if (found_inf.defined()) found = found_inf;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    auto& group = optimizer.param_groups()[g];
    const auto& o = static_cast<const Options&>(group.options());
    std::vector<Bucket> buckets;
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& s = state_of<State>(optimizer, p, [&] {
        auto made = std::make_unique<State>();
        made->step(0);
        made->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        made->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) made->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        return made;
      });
      if (o.amsgrad() && !s.max_exp_avg_sq().defined()) {
        s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));  // amsgrad switched on later
      }
      auto& b = bucket_for(buckets, p);
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.a.push_back(s.exp_avg());
      b.b.push_back(s.exp_avg_sq());
      if (o.amsgrad()) b.c.push_back(s.max_exp_avg_sq());
      b.steps.push_back(steps.of(p, s.step()));
      s.step(s.step() + 1);
    }
    const auto [beta1, beta2] = o.betas();
    for (auto& b : buckets) {
      at::_foreach_add_(b.steps, 1);
      if (lr == nullptr) {
        kernel(b.params, b.grads, b.a, b.b, b.c, b.steps, o.lr(), beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(),
               /*maximize=*/false);
        continue;
      }
      kernel(b.params, b.grads, b.a, b.b, b.c, b.steps, lr->of(g, b.device, o.lr()), beta1, beta2, o.weight_decay(),
             o.eps(), o.amsgrad(), /*maximize=*/false, /*grad_scale=*/std::nullopt, found);
      if (found) {  // a skipped step does not count, as PyTorch's fused step
        at::_foreach_sub_(b.steps, std::vector<at::Tensor>(b.steps.size(), found_inf.reshape({})));
      }
    }
  }
}

/// Adam and AdamW differ only in their LibTorch base and kernel; this is the rest.
template <class Base, class Options, class State, class Kernel>
class FusedAdamFamily : public Base {
 public:
  using Base::Base;

  /// One step of every parameter that has a gradient. Returns the closure's loss, as LibTorch's step does.
  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    at::Tensor loss = run_closure(closure);
    if (!fused_applies(*this)) {
      steps_.template read_back<State>(*this);
      steps_.clear();
      Base::step();  // LibTorch's own step, counting from the states' `step`
      return loss;
    }
    fused_adam_step<Options, State>(*this, steps_, Kernel{});
    return loss;
  }

  /// The step of graph mode: every rate read from a device tensor (`refresh_device_lr` copies the groups' rates
  /// there), the step counts advanced on the device, and with `found_inf` defined (Fp16Mixed's inf/NaN flag) the
  /// update skipped on the device when it is non-zero. It reads nothing on the host, so it can be captured in a CUDA
  /// graph and replayed. Needs LibTorch's fused kernels (LibTorch >= 2.4).
  void step_on_device(const at::Tensor& found_inf = {}) {
    at::NoGradGuard no_grad;
    require_fused(*this, Kernel::name);
    fused_adam_step<Options, State>(*this, steps_, Kernel{}, &device_lr_, found_inf);
  }
  /// Copies each group's rate into the tensors `step_on_device` reads, where it changed; outside captured regions.
  void refresh_device_lr() { device_lr_.refresh(*this); }

  /// LibTorch's archive, with step counts read back from the tensors that count them.
  void save(torch::serialize::OutputArchive& archive) const override {
    steps_.template read_back<State>(*this);
    Base::save(archive);
  }

  /// LibTorch's archive (written by this class or by LibTorch's); the counters restart from its step counts.
  void load(torch::serialize::InputArchive& archive) override {
    Base::load(archive);
    steps_.clear();
    device_lr_.clear();
  }

 private:
  StepTensors steps_;
  DeviceLr device_lr_;
};

/// `at::_fused_adam_` (Decoupled false) or `at::_fused_adamw_`.
template <bool Decoupled>
struct AdamKernel {
  /// The optimizer's name in messages.
  static constexpr const char* name = Decoupled ? "volt::optim::AdamW" : "volt::optim::Adam";
  template <class... A>
  void operator()(A&&... args) const {
    volt::detail::fused_adam(Decoupled, std::forward<A>(args)...);
  }
};

}  // namespace detail

/// Adam (Kingma and Ba), as `torch::optim::Adam` with `AdamOptions` and `AdamParamState`, stepped by
/// `at::_fused_adam_`.
class Adam : public detail::FusedAdamFamily<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState,
                                            detail::AdamKernel<false>> {
 public:
  using FusedAdamFamily::FusedAdamFamily;
};

/// AdamW (Loshchilov and Hutter: weight decay decoupled from the gradient), as `torch::optim::AdamW` with
/// `AdamWOptions` (weight decay 1e-2 by default) and `AdamWParamState`, stepped by `at::_fused_adamw_`.
class AdamW : public detail::FusedAdamFamily<torch::optim::AdamW, torch::optim::AdamWOptions,
                                             torch::optim::AdamWParamState, detail::AdamKernel<true>> {
 public:
  using FusedAdamFamily::FusedAdamFamily;
};

}  // namespace volt::optim
