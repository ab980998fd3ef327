#pragma once
/// \file
/// The Precision kind: the number formats of a run. A precision is a default-constructible object the
/// Trainer owns; it may hold state (Fp16Mixed's loss scale), saved with everything else.
///
/// | member | meaning |
/// |---|---|
/// | `static constexpr const char* name` | for messages |
/// | `static constexpr bool needs_fp16_autocast` | the accelerator must have `has_fp16_autocast` |
/// | `static constexpr bool needs_bf16_autocast` | the accelerator must have `has_bf16_autocast` |
/// | `static constexpr bool converts_inputs` | floating tensors of each batch are cast to `input_dtype` |
/// | `static constexpr torch::Dtype input_dtype` | (read only when `converts_inputs`) |
/// | `static constexpr std::optional<torch::Dtype> compute_dtype` (optional; none: as the parameters are) | the dtype a strategy that gathers the parameters for each forward gathers them in (FSDP: FSDP2's `MixedPrecisionPolicy.param_dtype`; Bf16Mixed: bfloat16); the optimizer still steps float32 pieces and gradients are still reduced in float32 |
/// | `forward_context(c10::DeviceType) -> guard` | an RAII object alive around each step (autocast, default dtype) |
/// | `convert_module(torch::nn::Module&)` | once, after the strategy placed the module ("true" precisions cast it) |
/// | `backward(const torch::Tensor& loss)` | runs backward (Fp16Mixed scales the loss first) |
/// | `unscale_gradients(torch::optim::Optimizer&)` | before hooks and clipping see the gradients |
/// | `agree_found_inf(torch::optim::Optimizer&, const std::function<void(torch::Tensor&)>& max_over_ranks)` | before the step where each rank holds a shard of the gradients (ZeRO): the inf/NaN flag passed to `max_over_ranks`, so every rank skips the same steps (a precision without loss scaling has none: the default does nothing) |
/// | `optimizer_step(torch::optim::Optimizer&) -> bool` | steps; false when the step was skipped (inf/NaN) |
/// | `optimizer_step_on_device(O&)` (for `Graphed`) | the same with nothing read on the host: `O::step_on_device(found_inf)` |
/// | `static constexpr bool scales_loss` | backward scales the loss, and `update()` adjusts the scale (manual optimization then steps each optimizer at most once per training_step) |
/// | `update()` | once per training iteration, after its optimizers stepped (Fp16Mixed: the loss scale's update) |
/// | `state_dict() -> std::map<std::string, double>` / `load_state_dict(map)` | checkpointed state |
///
/// Writing your own: derive from `PrecisionDefaults` for the no-op members and set the flags.

#include <c10/core/DeviceType.h>
#include <c10/core/DefaultDtype.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <concepts>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <type_traits>

namespace volt {

template <class P>
concept Precision = std::default_initializable<P> &&
    requires(P& p, const P& cp, const torch::Tensor& loss, torch::optim::Optimizer& opt, torch::nn::Module& m,
             const std::map<std::string, double>& state, const std::function<void(torch::Tensor&)>& max_over_ranks) {
      { P::name } -> std::convertible_to<const char*>;
      { P::needs_fp16_autocast } -> std::convertible_to<bool>;
      { P::needs_bf16_autocast } -> std::convertible_to<bool>;
      { P::converts_inputs } -> std::convertible_to<bool>;
      { P::input_dtype } -> std::convertible_to<torch::Dtype>;
      { P::scales_loss } -> std::convertible_to<bool>;
      p.forward_context(c10::DeviceType::CPU);
      p.convert_module(m);
      p.backward(loss);
      p.unscale_gradients(opt);
      p.agree_found_inf(opt, max_over_ranks);
      { p.optimizer_step(opt) } -> std::same_as<bool>;
      p.update();
      { cp.state_dict() } -> std::same_as<std::map<std::string, double>>;
      p.load_state_dict(state);
    };

/// The members most precisions share: no forward context, module untouched, plain backward and step, no state.
struct PrecisionDefaults {
  struct NoGuard {};
  static constexpr bool needs_fp16_autocast = false;
  static constexpr bool needs_bf16_autocast = false;
  static constexpr bool converts_inputs = false;
  static constexpr torch::Dtype input_dtype = torch::kFloat32;
  static constexpr bool scales_loss = false;
  static constexpr std::optional<torch::Dtype> compute_dtype = std::nullopt;

  NoGuard forward_context(c10::DeviceType) { return {}; }
  void convert_module(torch::nn::Module&) {}
  void backward(const torch::Tensor& loss) { loss.backward(); }
  void unscale_gradients(torch::optim::Optimizer&) {}
  /// No loss scale, so no inf/NaN flag to agree on.
  void agree_found_inf(torch::optim::Optimizer&, const std::function<void(torch::Tensor&)>& /*max_over_ranks*/) {}
  bool optimizer_step(torch::optim::Optimizer& optimizer) {
    optimizer.step();
    return true;
  }
  /// Graph mode's step (volt/accelerators/graphed.hpp): no loss scale, so no inf/NaN flag.
  template <class O>
  void optimizer_step_on_device(O& optimizer) {
    optimizer.step_on_device(torch::Tensor());
  }
  void update() {}
  std::map<std::string, double> state_dict() const { return {}; }
  void load_state_dict(const std::map<std::string, double>&) {}
};

namespace detail {

/// Precision `P`'s `compute_dtype`, none where it declares none.
template <class P>
inline constexpr std::optional<torch::Dtype> compute_dtype_of = [] {
  if constexpr (requires { P::compute_dtype; }) {
    return std::optional<torch::Dtype>(P::compute_dtype);
  } else {
    return std::optional<torch::Dtype>();
  }
}();

/// Whether precision `P` keeps PrecisionDefaults' agree_found_inf, which agrees on nothing (rules.hpp refuses that for
/// a precision that scales the loss under a strategy that shards the gradients).
template <class P>
inline constexpr bool default_inf_agreement = [] {
  if constexpr (requires { &P::agree_found_inf; }) {
    return std::is_same_v<decltype(&P::agree_found_inf),
                          void (PrecisionDefaults::*)(torch::optim::Optimizer&,
                                                      const std::function<void(torch::Tensor&)>&)>;
  } else {
    return false;
  }
}();

/// Sets torch's default floating dtype for a scope (Lightning's `_DtypeContextManager`), so tensors a module
/// creates in forward match its "true" precision.
class DefaultDtypeGuard {
 public:
  explicit DefaultDtypeGuard(caffe2::TypeMeta dtype) : previous_(c10::get_default_dtype()) {
    c10::set_default_dtype(dtype);
  }
  DefaultDtypeGuard(const DefaultDtypeGuard&) = delete;
  DefaultDtypeGuard& operator=(const DefaultDtypeGuard&) = delete;
  ~DefaultDtypeGuard() { c10::set_default_dtype(previous_); }

 private:
  caffe2::TypeMeta previous_;
};

}  // namespace detail
}  // namespace volt
