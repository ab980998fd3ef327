#pragma once

#include "volt/detail/torch_compat.hpp"
#include "volt/precision/concept.hpp"
#include "volt/precision/grad_scaler.hpp"

#include <functional>

namespace volt {

/// Mixed float16: float32 parameters and optimizer, each step's forward under autocast to float16, and
/// dynamic loss scaling so small gradients survive float16's range: the loss is scaled before backward,
/// gradients are unscaled before clipping and hooks see them, a step whose gradients hold inf/NaN is skipped
/// and the scale backs off. One scaler serves every optimizer of a fit (manual optimization with several): each
/// backward is scaled, each optimizer unscaled once, and the scale updated once per iteration, as PyTorch's
/// GradScaler. Needs an accelerator with float16 autocast (GPU).
class Fp16Mixed : public PrecisionDefaults {
 public:
  static constexpr const char* name = "Fp16Mixed";
  static constexpr bool needs_fp16_autocast = true;
  static constexpr bool scales_loss = true;

  Fp16Mixed() = default;
  explicit Fp16Mixed(GradScalerOptions options) : scaler_(options) {}

  detail::AutocastGuard forward_context(c10::DeviceType device) { return detail::AutocastGuard(device, at::kHalf); }
  /// A run starts: no optimizer is between its unscale and the scale's update (an earlier run may have failed there).
  void convert_module(torch::nn::Module&) { scaler_.discard_pending(); }
  void backward(const torch::Tensor& loss) { scaler_.scale(loss).backward(); }
  void unscale_gradients(torch::optim::Optimizer& optimizer) { scaler_.unscale_(optimizer); }
  /// The loss scale's inf/NaN flag made to agree across ranks that hold shards of the gradients (ZeRO).
  void agree_found_inf(torch::optim::Optimizer& optimizer, const std::function<void(torch::Tensor&)>& max_over_ranks) {
    scaler_.agree_found_inf(optimizer, max_over_ranks);
  }
  bool optimizer_step(torch::optim::Optimizer& optimizer) { return scaler_.step(optimizer); }
  /// Graph mode's step: the fused step skips on the device when an inf/NaN was found.
  template <class O>
  void optimizer_step_on_device(O& optimizer) {
    scaler_.step_on_device(optimizer);
  }
  /// Once the iteration's optimizers have stepped: the loss scale's update (on the device under graph mode).
  void update() { scaler_.update(); }
  std::map<std::string, double> state_dict() const { return scaler_.state_dict(); }
  void load_state_dict(const std::map<std::string, double>& state) { scaler_.load_state_dict(state); }

  GradScaler& scaler() { return scaler_; }
  const GradScaler& scaler() const { return scaler_; }

 private:
  GradScaler scaler_;
};

/// The name used in `Trainer<..., Fp16, GPU>`.
using Fp16 = Fp16Mixed;

}  // namespace volt
