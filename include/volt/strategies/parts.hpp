#pragma once
/// \file
/// What `Parallel` (strategies/parallel.hpp) composes its parts with: the runtime that hands each unit to its part's
/// scheduler (`PartRouter`), and the gradient norm summed part by part along each part's axis (`PartNorms`).

#include "volt/comm/concept.hpp"
#include "volt/errors.hpp"
#include "volt/reduce.hpp"
#include "volt/strategies/reducer.hpp"
#include "volt/units.hpp"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstddef>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt::detail {

/// Routes each unit a model runs (volt/units.hpp) to the sharded part that holds its parameters; a unit of no sharded
/// part runs as a plain call. Installed for the time the parts hold their units sharded.
class PartRouter final : public UnitRuntime {
 public:
  PartRouter() = default;
  PartRouter(const PartRouter&) = delete;
  PartRouter& operator=(const PartRouter&) = delete;
  ~PartRouter() override { uninstall(); }

  /// `runtimes[k]` runs the units of the parameters in `params[k]`.
  void install(const std::vector<std::vector<at::Tensor>>& params, const std::vector<UnitRuntime*>& runtimes) {
    part_of_.clear();
    owner_.clear();
    for (std::size_t k = 0; k < params.size(); ++k) {
      for (const at::Tensor& p : params[k]) part_of_[p.unsafeGetTensorImpl()] = runtimes[k];
    }
    open_.clear();
    unit_runtime() = this;
  }
  void uninstall() {
    if (unit_runtime() == this) unit_runtime() = nullptr;
  }
  /// A forward starts: no unit is open.
  void reset() { open_.clear(); }

  int64_t enter(const torch::nn::Module& unit) override {
    UnitRuntime* runtime = owner(unit);
    const int64_t token = runtime != nullptr ? runtime->enter(unit) : -1;
    open_.push_back(runtime);
    return token;
  }
  void leave(int64_t token, std::vector<at::Tensor>& outputs) override {
    UnitRuntime* runtime = open_.back();
    open_.pop_back();
    if (runtime != nullptr) runtime->leave(token, outputs);
  }

 private:
  UnitRuntime* owner(const torch::nn::Module& unit) {
    if (const auto it = owner_.find(&unit); it != owner_.end()) return it->second;
    UnitRuntime* found = nullptr;
    bool first = true;
    for (const at::Tensor& p : unit.parameters(/*recurse=*/true)) {
      const auto it = part_of_.find(p.unsafeGetTensorImpl());
      UnitRuntime* runtime = it == part_of_.end() ? nullptr : it->second;
      if (!first && runtime != found) {
        throw ConfigError("volt: a " + unit.name() + " ran as a unit holding parameters of two parts (or of a sharded "
                          "part and of none); under ModelParallel a unit lies inside one sharded part.");
      }
      found = runtime;
      first = false;
    }
    owner_.emplace(&unit, found);
    return found;
  }

  std::unordered_map<const void*, UnitRuntime*> part_of_;
  std::unordered_map<const torch::nn::Module*, UnitRuntime*> owner_;
  std::vector<UnitRuntime*> open_;
};

/// ModelParallel's total gradient norm (detail::clip_gradients' `Total`): the per-tensor norms come in groups, each
/// group's squares summed in `dtype` (detail::squares_dtype: float64 under Fp64True, else float32) along its part's
/// axis (null: kept as they are), then every group's added.
template <class B>
struct PartNorms {
  static constexpr bool coefficient_in_grad_dtype = true;
  std::vector<std::pair<std::size_t, B*>> groups;  // how many norms, and the backend summing them
  torch::Device device;
  at::ScalarType dtype = at::kFloat;
  at::Tensor operator()(const std::vector<at::Tensor>& norms) const {
    const auto options = torch::TensorOptions().dtype(dtype).device(device);
    at::Tensor total = torch::zeros({1}, options);
    std::size_t at = 0;
    for (const auto& [count, backend] : groups) {
      at::Tensor squares = torch::zeros({1}, options);
      for (std::size_t i = 0; i < count; ++i) squares += norms[at++].to(dtype).square().to(device);
      if (backend != nullptr) backend->all_reduce_(squares, Reduce::sum);
      total += squares;
    }
    return total.sqrt();
  }
};

}  // namespace volt::detail
