#pragma once
/// \file
/// Dynamic loss scaling for float16 training, the algorithm of PyTorch's `torch.amp.GradScaler`, which
/// LibTorch's C++ API lacks.
///
/// Per optimizer step: `scale(loss).backward()` for every micro-batch, then `unscale_(opt)` (grads divided by
/// the scale, inf/NaN recorded), then `step(opt)` (skipped when an inf/NaN was found), then `update()`:
/// an inf/NaN multiplies the scale by `backoff_factor`; `growth_interval` clean steps in a row multiply it by
/// `growth_factor`. CUDA tensors use ATen's fused kernels (`_amp_foreach_non_finite_check_and_unscale_`,
/// `_amp_update_scale_`); other devices (CPU, which LibTorch 1.13 has no kernels for) use a composite of
/// ordinary ops with the same arithmetic.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace volt {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {}) : options_(options) {
    auto fail = [](const std::string& what) { throw std::invalid_argument("volt: GradScaler " + what); };
    if (!(std::isfinite(options_.init_scale) && options_.init_scale > 0.0))
      fail("init_scale=" + std::to_string(options_.init_scale) + " is not allowed: give a finite value > 0.");
    if (!(options_.growth_factor > 1.0))
      fail("growth_factor=" + std::to_string(options_.growth_factor) + " is not allowed: give a value > 1.");
    if (!(options_.backoff_factor > 0.0 && options_.backoff_factor < 1.0))
      fail("backoff_factor=" + std::to_string(options_.backoff_factor) + " is not allowed: give a value in (0, 1).");
    if (options_.growth_interval < 1)
      fail("growth_interval=" + std::to_string(options_.growth_interval) + " is not allowed: give a value >= 1.");
  }

  /// `loss` times the current scale (the scale tensor is created on the loss's device on first use).
  torch::Tensor scale(const torch::Tensor& loss) {
    ensure_state(loss.device());
    return loss * scale_.to(loss.device(), /*non_blocking=*/true);
  }

  /// Divides the optimizer's gradients by the scale in place and records whether any is inf/NaN.
  /// Call at most once per optimizer between two `update()`s, before clipping or reading its gradients.
  void unscale_(torch::optim::Optimizer& optimizer) {
    PerOptimizer& st = state_of(optimizer);
    if (st.stage == Stage::unscaled) {
      throw std::logic_error("volt: GradScaler::unscale_ was called twice for one optimizer since the last update().");
    }
    if (st.stage == Stage::stepped) {
      throw std::logic_error("volt: GradScaler::unscale_ was called after step() for this optimizer; call update() "
                             "first.");
    }
    st.stage = Stage::unscaled;
    if (!scale_.defined()) return;  // nothing was ever scaled: no gradients of ours to unscale
    // Group gradients by device: each device checks its own and the results are summed.
    std::vector<std::pair<c10::Device, std::vector<torch::Tensor>>> by_device;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto it = std::find_if(by_device.begin(), by_device.end(),
                               [&](const auto& entry) { return entry.first == p.grad().device(); });
        if (it == by_device.end()) it = by_device.emplace(by_device.end(), p.grad().device(), std::vector<torch::Tensor>{});
        it->second.push_back(p.grad());
      }
    }
    const torch::Tensor inv_scale = scale_.to(torch::kFloat64).reciprocal().to(torch::kFloat32);
    st.found_inf = torch::zeros({1}, scale_.options());
    for (auto& [device, grads] : by_device) {
      torch::Tensor found = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
      const torch::Tensor inv = inv_scale.to(device);
      if (device.is_cuda()) {
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv);
      } else {
        unscale_composite(grads, found, inv);
      }
      st.found_inf = st.found_inf + found.to(scale_.device());
    }
  }

  /// Unscales if that was not done yet, then passes the inf/NaN flag of `optimizer`'s gradients (float32 [1], nonzero
  /// where one was found) to `reduce`, which makes it agree across ranks whose gradients are shards of one model
  /// (ZeRO: the max over ranks), so that every rank skips the same steps.
  template <class F>
  void agree_found_inf(torch::optim::Optimizer& optimizer, F&& reduce) {
    if (state_of(optimizer).stage == Stage::ready) unscale_(optimizer);
    PerOptimizer& st = state_of(optimizer);
    if (st.found_inf.defined()) reduce(st.found_inf);
  }

  /// Unscales if that was not done yet, then runs `optimizer.step()` unless an inf/NaN was found in its gradients.
  /// Returns whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer) {
    PerOptimizer& st = begin_step(optimizer, "step");
    const bool skip = st.found_inf.defined() && st.found_inf.item<float>() != 0.0f;
    if (!skip) optimizer.step();
    return !skip;
  }

  /// The step of graph mode: unscales if that was not done yet, then `optimizer.step_on_device(found_inf)`, whose
  /// kernels skip the update on the device when an inf/NaN was found. Reads nothing on the host, so it can be captured
  /// (volt::optim's optimizers have it).
  template <class O>
  void step_on_device(O& optimizer) {
    PerOptimizer& st = begin_step(optimizer, "step_on_device");
    optimizer.step_on_device(st.found_inf);
  }

  /// Adjusts the scale once the optimizers have stepped: back off when any optimizer unscaled since the last update
  /// found an inf/NaN, grow after `growth_interval` clean updates in a row (PyTorch's GradScaler with several
  /// optimizers: scale each backward, unscale each optimizer once, update once per iteration).
  void update() {
    if (optimizers_.empty() || !scale_.defined()) {
      optimizers_.clear();
      return;
    }
    torch::Tensor found_inf;
    for (const auto& [optimizer, st] : optimizers_) {
      if (!st.found_inf.defined()) continue;
      found_inf = found_inf.defined() ? found_inf + st.found_inf : st.found_inf;
    }
    if (!found_inf.defined()) found_inf = torch::zeros({1}, scale_.options());
    last_found_inf_ = found_inf;
    if (scale_.is_cuda()) {
      at::_amp_update_scale_(scale_, growth_tracker_, found_inf, options_.growth_factor, options_.backoff_factor,
                             options_.growth_interval);
    } else {
      update_composite(found_inf);
    }
    optimizers_.clear();
  }

  /// Forgets the optimizers unscaled or stepped since the last update (a run that failed between its unscale and its
  /// update leaves them), keeping the scale and its growth tracker.
  void discard_pending() { optimizers_.clear(); }

  /// The current scale (reads the device value; a sync on GPU).
  double get_scale() const { return scale_.defined() ? scale_.item<float>() : options_.init_scale; }
  /// Clean steps since the last change of scale.
  int64_t growth_tracker() const { return growth_tracker_.defined() ? growth_tracker_.item<int32_t>() : 0; }
  /// Whether the last update found an inf/NaN, so the steps before it were skipped (reads the device flag; a sync on
  /// GPU).
  bool last_step_skipped() const { return last_found_inf_.defined() && last_found_inf_.item<float>() != 0.0f; }
  const GradScalerOptions& options() const { return options_; }

  /// The same keys as PyTorch's GradScaler.state_dict().
  std::map<std::string, double> state_dict() const {
    return {{"scale", get_scale()},
            {"growth_factor", options_.growth_factor},
            {"backoff_factor", options_.backoff_factor},
            {"growth_interval", static_cast<double>(options_.growth_interval)},
            {"_growth_tracker", static_cast<double>(growth_tracker())}};
  }

  void load_state_dict(const std::map<std::string, double>& state) {
    for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
      if (!state.count(key)) {
        std::ostringstream s;
        s << "volt: GradScaler state has no \"" << key << "\"; it holds " << state.size()
          << " keys. Was it saved by a precision without loss scaling?";
        throw std::invalid_argument(s.str());
      }
    }
    GradScalerOptions o{state.at("scale"), state.at("growth_factor"), state.at("backoff_factor"),
                        static_cast<int64_t>(state.at("growth_interval"))};
    *this = GradScaler(o);
    init_device_ = true;
    scale_ = torch::full({1}, static_cast<float>(state.at("scale")), torch::kFloat32);
    growth_tracker_ = torch::full({1}, static_cast<int32_t>(state.at("_growth_tracker")), torch::kInt32);
  }

 private:
  enum class Stage { ready, unscaled, stepped };
  /// One optimizer's progress since the last update, and what its unscale found.
  struct PerOptimizer {
    Stage stage = Stage::ready;
    torch::Tensor found_inf;  // float32 [1], set by unscale_
  };

  PerOptimizer& state_of(const torch::optim::Optimizer& optimizer) {
    for (auto& [o, st] : optimizers_) {
      if (o == &optimizer) return st;
    }
    return optimizers_.emplace_back(&optimizer, PerOptimizer{}).second;
  }
  /// The checks and the unscale before `optimizer` steps.
  PerOptimizer& begin_step(torch::optim::Optimizer& optimizer, const char* what) {
    if (state_of(optimizer).stage == Stage::stepped) {
      throw std::logic_error(std::string("volt: GradScaler::") + what + " was called twice for one optimizer since the "
                             "last update().");
    }
    if (state_of(optimizer).stage == Stage::ready) unscale_(optimizer);
    PerOptimizer& st = state_of(optimizer);
    st.stage = Stage::stepped;
    return st;
  }

  void ensure_state(const c10::Device& device) {
    if (!scale_.defined()) {
      scale_ = torch::full({1}, static_cast<float>(options_.init_scale),
                           torch::TensorOptions().dtype(torch::kFloat32).device(device));
      growth_tracker_ = torch::zeros({1}, torch::TensorOptions().dtype(torch::kInt32).device(device));
    } else if (init_device_ && scale_.device() != device) {  // loaded on CPU, first used on `device`
      scale_ = scale_.to(device);
      growth_tracker_ = growth_tracker_.to(device);
    }
    init_device_ = false;
  }

  static void unscale_composite(std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                                const torch::Tensor& inv_scale) {
    for (auto& g : grads) {
      if (!torch::isfinite(g).all().item<bool>()) found_inf.fill_(1.0);
      g.mul_(inv_scale.to(g.dtype()));
    }
  }

  // The arithmetic of ATen's _amp_update_scale_ kernels, on host values.
  void update_composite(const torch::Tensor& found_inf) {
    const float scale = scale_.item<float>();
    const int32_t tracker = growth_tracker_.item<int32_t>();
    float new_scale = scale;
    int32_t new_tracker = 0;
    if (found_inf.item<float>() != 0.0f) {
      new_scale = static_cast<float>(scale * options_.backoff_factor);
    } else {
      const int32_t successful = tracker + 1;
      if (successful == options_.growth_interval) {
        const auto grown = static_cast<float>(scale * options_.growth_factor);
        if (std::isfinite(grown)) new_scale = grown;
      } else {
        new_tracker = successful;
      }
    }
    scale_.fill_(new_scale);
    growth_tracker_.fill_(new_tracker);
  }

  GradScalerOptions options_;
  torch::Tensor scale_;           // float32 [1]
  torch::Tensor growth_tracker_;  // int32 [1]
  /// The optimizers unscaled or stepped since the last update, in the order they came.
  std::vector<std::pair<const torch::optim::Optimizer*, PerOptimizer>> optimizers_;
  torch::Tensor last_found_inf_;  // what the last update read (kept: a replayed step rewrites it on the device)
  bool init_device_ = false;
};

}  // namespace volt
