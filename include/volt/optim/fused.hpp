#pragma once
/// \file
/// What volt's optimizers share: when LibTorch's fused kernels can run, the step counters kept in tensors beside the
/// parameters, and the grouping of a parameter group by device and dtype that the kernels need.
///
/// volt's `Adam`, `AdamW` and `SGD` are LibTorch's classes with another `step()`: their options, state and archives
/// are LibTorch's own, so a state saved by one loads into the other, LibTorch's LR schedulers drive them, and
/// `configure_optimizers` may return either. The step runs one fused kernel (`at::_fused_adam_`, `_fused_adamw_`,
/// `_fused_sgd_`) per parameter group and device/dtype, where LibTorch has it: from LibTorch 2.4 on, on the CPU and
/// on CUDA. Elsewhere (LibTorch 1.13, sparse gradients, other devices or dtypes) the step is LibTorch's own.

#include "volt/checkpoint/optimizer_state.hpp"
#include "volt/detail/torch_compat.hpp"

#include <torch/optim/optimizer.h>

#include <concepts>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt::optim {

/// Whether this LibTorch has fused optimizer kernels for tensors on `device` (CPU and CUDA from LibTorch 2.4).
inline bool has_fused_kernels(const c10::Device& device) {
  return volt::detail::has_fused_optimizer_kernels && (device.is_cpu() || device.is_cuda());
}

/// An optimizer whose step can be captured in a CUDA graph (graph mode, `Graphed<GPU>`): its step reads nothing on
/// the host (`step_on_device`), and its learning rates live in device tensors (`refresh_device_lr`). volt's `Adam`,
/// `AdamW` and `SGD` are; LibTorch's own optimizers read their step counts on the host and are not.
template <class O>
concept CapturableOptimizer = std::derived_from<O, torch::optim::Optimizer> && requires(O& o, const at::Tensor& inf) {
  o.step_on_device(inf);
  o.refresh_device_lr();
};

namespace detail {

using volt::detail::state_key;

/// The state of `p` as `State`, created by `make` when the parameter has none yet.
template <class State, class Make>
State& state_of(torch::optim::Optimizer& optimizer, const at::Tensor& p, Make&& make) {
  auto& map = optimizer.state();
  const auto key = state_key(map, p.unsafeGetTensorImpl());
  auto it = map.find(key);
  if (it == map.end()) it = map.emplace(key, std::forward<Make>(make)()).first;
  return static_cast<State&>(*it->second);
}

/// Whether a fused kernel can step every parameter of `optimizer` that has a gradient.
inline bool fused_applies(const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (!has_fused_kernels(p.device()) || p.grad().is_sparse() || !p.is_floating_point() ||
          p.grad().device() != p.device() || p.grad().scalar_type() != p.scalar_type()) {
        return false;
      }
    }
  }
  return true;
}

/// The per-parameter step counts as float32 tensors on the parameters' devices, as the Adam kernels read them (and
/// as PyTorch keeps them for fused and capturable steps). LibTorch's `AdamParamState::step` stays the count saved
/// in archives: it is kept in step while stepping eagerly and read back from the tensors before a save, so a step
/// replayed without the host still saves the right count. float32 counts exactly to 2^24 steps, as PyTorch's.
class StepTensors {
 public:
  /// The tensor counting `p`'s steps, made from `host_count` the first time.
  at::Tensor& of(const at::Tensor& p, int64_t host_count) {
    auto it = steps_.find(p.unsafeGetTensorImpl());
    if (it == steps_.end()) {
      it = steps_
               .emplace(p.unsafeGetTensorImpl(), at::full({}, static_cast<double>(host_count),
                                                          at::TensorOptions().dtype(at::kFloat).device(p.device())))
               .first;
    }
    return it->second;
  }

  /// Writes the counts into the `State::step` of `optimizer`'s states, which is what archives hold.
  template <class State>
  void read_back(const torch::optim::Optimizer& optimizer) const {
    const auto& map = optimizer.state();
    for (const auto& [impl, t] : steps_) {
      const auto it = map.find(state_key(map, impl));
      if (it != map.end()) static_cast<State&>(*it->second).step(static_cast<int64_t>(t.item().toFloat()));
    }
  }

  /// Forgets every counter (after a load, or a step taken by LibTorch's own code).
  void clear() { steps_.clear(); }

 private:
  std::unordered_map<const void*, at::Tensor> steps_;
};

/// The learning rate of each parameter group as a float32 tensor on each device its parameters live on, which a
/// step that runs without the host (graph mode) reads. `refresh` copies each group's rate into its tensors where the
/// rate changed (an LR scheduler's step): call it outside any captured region, before the step runs.
class DeviceLr {
 public:
  /// The tensor holding group `group`'s rate on `device`, made from `lr` the first time.
  const at::Tensor& of(std::size_t group, const c10::Device& device, double lr) {
    for (auto& e : entries_) {
      if (e.group == group && e.device == device) return e.tensor;
    }
    entries_.push_back(Entry{group, device, lr, at::full({}, lr, at::TensorOptions().dtype(at::kFloat).device(device))});
    return entries_.back().tensor;
  }

  /// Copies every group's current rate into its tensors where it differs from the last one copied.
  void refresh(const torch::optim::Optimizer& optimizer) {
    for (auto& e : entries_) {
      const double lr = optimizer.param_groups().at(e.group).options().get_lr();
      if (lr != e.value) {
        e.tensor.fill_(lr);
        e.value = lr;
      }
    }
  }

  /// Forgets every tensor (after a load).
  void clear() { entries_.clear(); }

 private:
  struct Entry {
    std::size_t group;
    c10::Device device;
    double value;
    at::Tensor tensor;
  };
  std::vector<Entry> entries_;
};

/// Throws unless a fused kernel can step every parameter with a gradient (graph mode has no other step).
inline void require_fused(const torch::optim::Optimizer& optimizer, const char* name) {
  if (!fused_applies(optimizer)) {
    throw std::logic_error(std::string("volt: ") + name + "::step_on_device needs LibTorch's fused kernels (LibTorch " +
                           ">= 2.4, dense float gradients on the CPU or CUDA, on the parameters' device); this " +
                           "optimizer has a parameter they cannot step. Use step() instead.");
  }
}

/// The parameters of one group that share a device and a dtype, with what the kernel reads beside them.
struct Bucket {
  c10::Device device;
  at::ScalarType dtype;
  std::vector<at::Tensor> params, grads, a, b, c, steps;  // a, b, c: the per-algorithm state lists
};

/// The bucket for `p` in `buckets`, added if none matches.
inline Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p) {
  for (auto& b : buckets) {
    if (b.device == p.device() && b.dtype == p.scalar_type()) return b;
  }
  buckets.push_back(Bucket{p.device(), p.scalar_type(), {}, {}, {}, {}, {}, {}});
  return buckets.back();
}

/// Runs `closure` with gradients on, as LibTorch's optimizers do, and returns its loss (undefined without one).
inline at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace detail
}  // namespace volt::optim
