#pragma once
/// \file
/// Units of a fully sharded model, declared where the model runs: LibTorch's C++ modules have no forward hooks
/// (pytorch#25888), so the call that runs a block says that the block is a unit, and the strategy gathers its
/// parameters before it runs and frees them after (FSDP, `ZeRO<3>`: strategies/fully_sharded.hpp).
/// \code
///   x = volt::forward_blocks<Block>(blocks, x, volt::Units{}, volt::ActivationCheckpointing{.every = 1});
///   h = volt::sharded_call(encoder, h, mask);            // an irregular model: one block, one unit
/// \endcode
///
/// | what | how |
/// |---|---|
/// | a unit | the parameters of the module called (its submodules' included) that require gradients when the fit's first step runs; what no unit holds is the root unit, gathered when a step's forward starts and kept to the end of its backward |
/// | under another strategy | a plain call: the same model runs under DDP, ZeRO<1|2> or on one device |
/// | outputs | a tensor, a `std::tuple` of tensors or a `std::vector<at::Tensor>` (as `activation_checkpoint`'s) |
/// | order | declared in `configure_model` (`plan.units(blocks)`, `plan.unit(m)`: volt/model_plan.hpp), the parameters are laid out in the units as the fit starts and its first step runs sharded; undeclared, the first training step runs whole and records the order; every step must run them in that order (the next unit's gather starts while one runs, and every rank must issue the same gathers), else a `ConfigError` says which unit came instead of which |
/// | refused | a parameter in two units (a module called as a unit inside another unit, or a shared submodule): tie them into one unit |
///
/// `detail::UnitRuntime` is what a strategy that shards parameters installs for the time it holds them sharded; with
/// none installed, every call here is a plain call.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

/// The policy of `forward_blocks` that makes each block of the stack one unit of a fully sharded strategy.
struct Units {};

namespace detail {

/// What a strategy that shards parameters does around a unit (strategies/fully_sharded.hpp).
class UnitRuntime {
 public:
  virtual ~UnitRuntime() = default;
  /// Before `unit` runs: its parameters gathered. Returns what `leave` takes.
  virtual int64_t enter(const torch::nn::Module& unit) = 0;
  /// After it ran: `outputs` given what their backward needs (the unit gathered again first), the parameters freed
  /// where the strategy's policy says.
  virtual void leave(int64_t token, std::vector<at::Tensor>& outputs) = 0;
};

/// The installed runtime, or null (one per process: the strategy of the running fit).
inline UnitRuntime*& unit_runtime() {
  static UnitRuntime* runtime = nullptr;
  return runtime;
}

/// What a unit or a checkpointed function (volt/activation_checkpoint.hpp) returns, flattened to tensors and built
/// back: a tensor, a tuple of tensors, a vector of tensors.
template <class R>
struct TensorResult {
  static_assert(sizeof(R) == 0, "volt: a unit, or a function under activation_checkpoint, must return an at::Tensor, "
                                "a std::tuple of at::Tensor or a std::vector<at::Tensor>.");
};
template <>
struct TensorResult<at::Tensor> {
  static std::vector<at::Tensor> flatten(at::Tensor t) { return {std::move(t)}; }
  static at::Tensor build(std::vector<at::Tensor> v) { return std::move(v.front()); }
};
template <>
struct TensorResult<std::vector<at::Tensor>> {
  static std::vector<at::Tensor> flatten(std::vector<at::Tensor> v) { return v; }
  static std::vector<at::Tensor> build(std::vector<at::Tensor> v) { return v; }
};
template <class... T>
struct TensorResult<std::tuple<T...>> {
  static_assert((std::is_same_v<T, at::Tensor> && ...), "volt: a returned std::tuple must hold at::Tensor only.");
  static std::vector<at::Tensor> flatten(std::tuple<T...> t) {
    return std::apply([](auto&... x) { return std::vector<at::Tensor>{std::move(x)...}; }, t);
  }
  static std::tuple<T...> build(std::vector<at::Tensor> v) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) { return std::tuple<T...>{std::move(v[I])...}; }(
        std::index_sequence_for<T...>{});
  }
};

/// The module a unit's callable is: a module, or a module holder's module.
template <class F>
const torch::nn::Module& unit_module(const F& f) {
  if constexpr (std::is_base_of_v<torch::nn::Module, F>) {
    return f;
  } else {
    static_assert(requires { f.ptr(); }, "volt: sharded_call takes a module or a module holder (TORCH_MODULE) as the "
                                         "unit: the module's parameters are the unit's.");
    return *f.ptr();
  }
}

/// `run()` as the unit `unit`: gathered before, its outputs given their backward's gather, freed after.
template <class Run>
auto in_unit(const torch::nn::Module& unit, Run&& run) {
  using R = std::remove_cvref_t<decltype(run())>;
  UnitRuntime* runtime = unit_runtime();
  if (runtime == nullptr) return R(run());
  const int64_t token = runtime->enter(unit);
  std::vector<at::Tensor> outputs = TensorResult<R>::flatten(run());
  runtime->leave(token, outputs);
  return TensorResult<R>::build(std::move(outputs));
}

}  // namespace detail

/// Runs `block(args...)` (a module holder, or a module through its `forward`) as one unit of a fully sharded strategy;
/// a plain call under any other.
template <class F, class... Args>
auto sharded_call(F&& block, Args&&... args) {
  const torch::nn::Module& unit = detail::unit_module(block);
  return detail::in_unit(unit, [&]() -> decltype(auto) {
    if constexpr (std::is_invocable_v<F&, Args...>) {
      return std::invoke(block, std::forward<Args>(args)...);
    } else {
      return block.forward(std::forward<Args>(args)...);
    }
  });
}

}  // namespace volt
