#pragma once
/// \file
/// `volt::optim::SGD`: LibTorch's `torch::optim::SGD` (momentum, dampening, Nesterov, weight decay; same options,
/// state and archives) whose step is one `at::_fused_sgd_` per parameter group, device and dtype (see
/// volt/optim/fused.hpp).

#include "volt/optim/fused.hpp"

#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <optional>
#include <vector>

namespace volt::optim {

/// Stochastic gradient descent with LibTorch's `SGDOptions`; the momentum buffer is made on a parameter's first
/// step from its gradient (weight decay included), as LibTorch and PyTorch make it.
class SGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;

  /// One step of every parameter that has a gradient. Returns the closure's loss, as LibTorch's step does.
  at::Tensor step(LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    at::Tensor loss = detail::run_closure(closure);
    if (!detail::fused_applies(*this)) {
      torch::optim::SGD::step();
      return loss;
    }
    fused_step(nullptr, {});
    return loss;
  }

  /// The step of graph mode: every rate read from a device tensor (`refresh_device_lr` copies the groups' rates
  /// there) and, with `found_inf` defined (Fp16Mixed's inf/NaN flag), the update skipped on the device when it is
  /// non-zero. Once every parameter has its momentum buffer it reads nothing on the host, so it can be captured in a
  /// CUDA graph and replayed; a step that makes buffers reads `found_inf` first (such a step is never a captured one:
  /// the warm-up steps before capture make them). Needs LibTorch's fused kernels (LibTorch >= 2.4).
  void step_on_device(const at::Tensor& found_inf = {}) {
    at::NoGradGuard no_grad;
    detail::require_fused(*this, "volt::optim::SGD");
    fused_step(&device_lr_, found_inf);
  }
  /// Copies each group's rate into the tensors `step_on_device` reads, where it changed; outside captured regions.
  void refresh_device_lr() { device_lr_.refresh(*this); }

  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::SGD::load(archive);
    device_lr_.clear();
  }

 private:
  void fused_step(detail::DeviceLr* lr, const at::Tensor& found_inf) {
    std::optional<at::Tensor> found;
    if (found_inf.defined()) found = found_inf;
    if (found && lacks_buffers() && found_inf.item<float>() != 0.0f) return;  // skipped: no buffer is made
    for (std::size_t g = 0; g < param_groups().size(); ++g) {
      auto& group = param_groups()[g];
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      const bool momentum = o.momentum() != 0;
      // Parameters stepping for the first time (no buffer yet) go to buckets of their own: the kernel takes
      // "first step" for a whole list.
      std::vector<detail::Bucket> buckets, first;
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        if (!momentum) {
          auto& b = detail::bucket_for(buckets, p);
          b.params.push_back(p);
          b.grads.push_back(p.grad());
          continue;
        }
        auto& s = detail::state_of<torch::optim::SGDParamState>(
            *this, p, [] { return std::make_unique<torch::optim::SGDParamState>(); });
        const bool is_first = !s.momentum_buffer().defined();
        if (is_first) s.momentum_buffer(at::empty_like(p, at::MemoryFormat::Preserve));
        auto& b = detail::bucket_for(is_first ? first : buckets, p);
        b.params.push_back(p);
        b.grads.push_back(p.grad());
        b.a.push_back(s.momentum_buffer());
      }
      for (auto& b : buckets) kernel(b, o, /*is_first_step=*/false, lr, g, found);
      for (auto& b : first) kernel(b, o, /*is_first_step=*/true, lr, g, found);
    }
  }

  /// Whether a parameter with a gradient has no momentum buffer yet (its step would be a first one).
  bool lacks_buffers() {
    for (auto& group : param_groups()) {
      if (static_cast<const torch::optim::SGDOptions&>(group.options()).momentum() == 0) continue;
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const auto& map = state();
        const auto it = map.find(detail::state_key(map, p.unsafeGetTensorImpl()));
        if (it == map.end() || !static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().defined()) {
          return true;
        }
      }
    }
    return false;
  }

  static void kernel(detail::Bucket& b, const torch::optim::SGDOptions& o, bool is_first_step, detail::DeviceLr* lr,
                     std::size_t group, const std::optional<at::Tensor>& found) {
    if (lr == nullptr) {
      volt::detail::fused_sgd(b.params, b.grads, b.a, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                              o.nesterov(), /*maximize=*/false, is_first_step);
      return;
    }
    volt::detail::fused_sgd(b.params, b.grads, b.a, o.weight_decay(), o.momentum(), lr->of(group, b.device, o.lr()),
                            o.dampening(), o.nesterov(), /*maximize=*/false, is_first_step, /*grad_scale=*/std::nullopt,
                            found);
  }

  detail::DeviceLr device_lr_;
};

}  // namespace volt::optim
