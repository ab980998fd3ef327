#pragma once
/// \file
/// What volt asks of a user's module, and the optimizer set-up it returns.
///
/// A module is the user's own `torch::nn::Module` subclass (or its `TORCH_MODULE` holder) with:
///
/// | member | required | meaning |
/// |---|---|---|
/// | `training_step(Batch&, Context&) -> torch::Tensor` | yes | the loss of one batch (manual optimization: anything or nothing) |
/// | `configure_optimizers() -> OptimizerConfig` (or an optimizer by value, a shared/unique pointer to one, or an `OptimizerConfigOf<O>`; several in a tuple or vector under manual optimization) | yes | what steps the parameters |
/// | `static constexpr bool automatic_optimization` | no | `false`: the module steps its optimizers itself (below) |
/// | `validation_step(Batch&, Context&)` | for validation | logs metrics; its result is ignored |
/// | `test_step(Batch&, Context&)` | for test | as validation_step |
/// | `predict_step(Batch&, Context&) -> R` | for predict | `predict` returns a `std::vector<R>` |
///
/// Every hook is optional; volt calls it when the module has it. Each takes the arguments below, with a
/// trailing `Context&` allowed (needed to log from it). Hooks with other signatures are a compile error.
///
/// | hook | arguments (before the optional Context&) |
/// |---|---|
/// | `setup`, `teardown` | `Stage` |
/// | `configure_model` | `volt::ModelPlan&` | at each run's start, after the strategy placed the module and before `setup` (Lightning calls it after `setup`): which parts `ModelParallel` shards along which mesh axis, and which it replicates (volt/model_plan.hpp); the other strategies read nothing of it |
/// | `on_optimizers_configured` | | in fit, after `configure_optimizers`, before a checkpoint's state is loaded |
/// | `on_fit_start/end`, `on_train_start/end`, `on_validation_start/end`, `on_test_start/end`, `on_predict_start/end` | none |
/// | `on_train_epoch_start/end`, `on_validation_epoch_start/end`, `on_test_epoch_start/end`, `on_predict_epoch_start/end` | none |
/// | `on_train_batch_start` | `batch, batch_idx`; returning -1 (an integer) ends the epoch early |
/// | `on_train_batch_end` | `loss, batch, batch_idx` |
/// | `on_{validation,test,predict}_batch_start` | `batch, batch_idx` |
/// | `on_{validation,test,predict}_batch_end` | `output, batch, batch_idx` (output: the step's result, or an undefined tensor for void steps) |
/// | `on_before_zero_grad`, `on_before_optimizer_step` | `torch::optim::Optimizer&` |
/// | `on_before_backward` | `const torch::Tensor& loss` |
/// | `on_after_backward` | none |
///
/// **Manual optimization** (Lightning's `automatic_optimization = False`): a module that declares
/// `static constexpr bool automatic_optimization = false;` steps its own optimizers in `training_step`, which may then
/// return nothing (a tensor it returns is handed to `on_train_batch_end` as the loss and used for nothing else). Its
/// `configure_optimizers` may return several optimizers: a `std::tuple` of anything one optimizer may be (each keeps
/// its type: `std::tuple<volt::optim::Adam, volt::optim::Adam>`, `OptimizerConfigOf<O>`s with schedulers), or a
/// `std::vector<OptimizerConfig>` when the count is known only at run time. Through its Context:
///
/// | call | what it does |
/// |---|---|
/// | `ctx.optimizers()`, `ctx.optimizer(i)` | the optimizers, in configure_optimizers' order (`volt::ManualOptimizer` handles) |
/// | `ctx.lr_schedulers()` | their schedulers (null where none) |
/// | `ctx.manual_backward(loss)` | backward through the precision (Fp16Mixed scales the loss) and the strategy (DDP averages the gradients) |
/// | `opt.step()` | unscales (once), `on_before_optimizer_step`, steps unless an inf/NaN was found (Fp16Mixed), counts `global_step`, steps its scheduler when it has `Interval::step` |
/// | `opt.zero_grad()` | its parameters' gradients set to none (zeroed on LibTorch 1.13) |
/// | `ctx.clip_gradients(opt, value, ClipAlgorithm::norm)` | unscales (once), then clips its parameters' gradients |
/// | `ctx.toggle_optimizer(opt)`, `ctx.untoggle_optimizer(opt)` | only its parameters require gradients, until untoggled |
/// | `auto guard = ctx.no_sync();` | manual_backward does not synchronise across ranks while the guard lives |
///
/// `global_step` counts every optimizer's steps (two per batch for a GAN), as Lightning's does in manual mode; loggers
/// get a row every `log_every_n_steps` batches that stepped, also as Lightning. **Unlike Lightning**, whose manual mode
/// leaves schedulers to the module, volt steps them as in automatic mode: a scheduler with `Interval::step` every
/// `frequency` steps of its own optimizer, one with `Interval::epoch` after the epoch; do not call their `step()`. Under Fp16Mixed one loss scale serves every optimizer (scaled at each backward, each optimizer
/// unscaled once, the scale updated once after training_step), so each optimizer steps at most once per batch there.
/// Checkpoints hold every optimizer and scheduler, each optimizer's step count and the module's gradients. Refused:
/// several optimizers without manual optimization (compile time), manual optimization with `Graphed` (compile time),
/// and with `accumulate_grad_batches > 1` or `gradient_clip_val` (a ConfigError when fit starts: the module does both
/// itself). examples/gan.cpp is a whole example.
/// \code
///   struct Gan : torch::nn::Module {
///     static constexpr bool automatic_optimization = false;
///     std::tuple<volt::optim::Adam, volt::optim::Adam> configure_optimizers();  // generator's, discriminator's
///     void training_step(const Batch& batch, volt::Context& ctx) {
///       auto opts = ctx.optimizers();
///       ctx.toggle_optimizer(opts[1]);
///       auto d_loss = ...;
///       opts[1].zero_grad();
///       ctx.manual_backward(d_loss);
///       opts[1].step();
///       ctx.untoggle_optimizer(opts[1]);
///       // ... the generator's step with opts[0]
///     }
///   };
/// \endcode
///
/// Checkpoints (no Context): `on_save_checkpoint(volt::checkpoint::Dict& checkpoint)` adds the module's own
/// entries to a checkpoint being written (on rank zero; keep clear of volt's keys, listed in checkpoint.hpp);
/// `on_load_checkpoint(const volt::checkpoint::Dict& checkpoint)` reads them back when a fit resumes, after
/// the file has been checked and before the weights are loaded (a throw leaves everything as it was).

#include "volt/context.hpp"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <concepts>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

/// When an LR scheduler is stepped.
enum class Interval { epoch, step };

/// Schedulers are LibTorch's `torch::optim::LRScheduler`s, stepped exactly where Lightning steps them (after the
/// epoch, or after each optimizer step). Note LibTorch's own convention: its first `step()` only counts (PyTorch's
/// constructor takes that step), so `StepLR(opt, 1, 0.5)` halves the rate from the second call on, as it would in a
/// hand-written LibTorch loop.
///
/// What `configure_optimizers` returns: an optimizer and, optionally, an LR scheduler built on it.
/// \code
///   volt::OptimizerConfig configure_optimizers() {
///     auto opt = std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1));
///     return {.optimizer = opt, .scheduler = std::make_shared<torch::optim::StepLR>(*opt, 1, 0.5)};
///   }
/// \endcode
struct OptimizerConfig {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  /// Holds a reference to `*optimizer`, which is why both are shared pointers.
  std::shared_ptr<torch::optim::LRScheduler> scheduler;
  Interval interval = Interval::epoch;
  /// Step the scheduler every `frequency` epochs or optimizer steps.
  int64_t frequency = 1;
};

/// `OptimizerConfig` that keeps the optimizer's type, for code that needs it at compile time: graph mode
/// (`Graphed<GPU>`) captures the optimizer's step and must know that the step can be captured.
/// \code
///   volt::OptimizerConfigOf<volt::optim::AdamW> configure_optimizers() {
///     auto opt = std::make_shared<volt::optim::AdamW>(parameters(), torch::optim::AdamWOptions(1e-3));
///     return {.optimizer = opt, .scheduler = std::make_shared<torch::optim::StepLR>(*opt, 1, 0.5)};
///   }
/// \endcode
template <class O>
struct OptimizerConfigOf {
  static_assert(std::is_base_of_v<torch::optim::Optimizer, O>, "volt: OptimizerConfigOf<O> takes an optimizer type.");
  std::shared_ptr<O> optimizer;
  std::shared_ptr<torch::optim::LRScheduler> scheduler;
  Interval interval = Interval::epoch;
  int64_t frequency = 1;

  operator OptimizerConfig() const { return {optimizer, scheduler, interval, frequency}; }
};

namespace detail {

/// The optimizer type a `configure_optimizers` result `R` holds (`torch::optim::Optimizer` when it does not say).
template <class R>
struct optimizer_type {
  using type = torch::optim::Optimizer;
};
template <class R>
  requires std::is_base_of_v<torch::optim::Optimizer, R>
struct optimizer_type<R> {
  using type = R;
};
template <class O>
struct optimizer_type<OptimizerConfigOf<O>> {
  using type = O;
};
template <class O>
struct optimizer_type<std::shared_ptr<O>> {
  using type = O;
};
template <class O, class D>
struct optimizer_type<std::unique_ptr<O, D>> {
  using type = O;
};

template <class M>
concept ModuleHolder = requires(M& m) {
  typename M::ContainedType;
  { m.ptr() };
};

template <class M>
struct ModuleImpl {
  using type = M;
};
template <ModuleHolder M>
struct ModuleImpl<M> {
  using type = typename M::ContainedType;
};

/// The `torch::nn::Module` object behind a module or its TORCH_MODULE holder.
template <class M>
auto& unwrap(M& m) {
  if constexpr (ModuleHolder<M>) {
    return *m;
  } else {
    return m;
  }
}

template <class T>
OptimizerConfig to_optimizer_config(T&& r) {
  using R = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<R, OptimizerConfig>) {
    return std::forward<T>(r);
  } else if constexpr (std::is_convertible_v<R, OptimizerConfig>) {  // OptimizerConfigOf<O>
    return static_cast<OptimizerConfig>(r);
  } else if constexpr (std::is_base_of_v<torch::optim::Optimizer, R>) {
    return {.optimizer = std::make_shared<R>(std::move(r))};
  } else {
    // std::shared_ptr<O> or std::unique_ptr<O>
    return {.optimizer = std::shared_ptr<torch::optim::Optimizer>(std::move(r))};
  }
}

/// One optimizer, in any of the forms `configure_optimizers` may return for it.
template <class R>
concept SingleOptimizerResult =
    std::is_same_v<R, OptimizerConfig> || std::is_convertible_v<R, OptimizerConfig> ||
    (std::is_base_of_v<torch::optim::Optimizer, R> && std::is_move_constructible_v<R>) ||
    requires(R r) { std::shared_ptr<torch::optim::Optimizer>(std::move(r)); };

template <class R>
struct several_optimizers_result : std::false_type {};
template <class... Rs>
  requires(sizeof...(Rs) > 0 && (SingleOptimizerResult<Rs> && ...))
struct several_optimizers_result<std::tuple<Rs...>> : std::true_type {};
template <class A>
struct several_optimizers_result<std::vector<OptimizerConfig, A>> : std::true_type {};

/// Several optimizers (manual optimization only): a `std::tuple` of single results, each keeping its type, or a
/// `std::vector<OptimizerConfig>` when the count is known only at run time.
template <class R>
concept SeveralOptimizersResult = several_optimizers_result<R>::value;

template <class R>
concept OptimizerResult = SingleOptimizerResult<R> || SeveralOptimizersResult<R>;

/// What `configure_optimizers` returned, as one OptimizerConfig per optimizer, in order.
template <class T>
std::vector<OptimizerConfig> to_optimizer_configs(T&& r) {
  using R = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<R, std::vector<OptimizerConfig>>) {
    return std::forward<T>(r);
  } else if constexpr (SeveralOptimizersResult<R>) {  // a tuple
    std::vector<OptimizerConfig> out;
    std::apply([&](auto&... each) { (out.push_back(to_optimizer_config(std::move(each))), ...); }, r);
    return out;
  } else {
    return {to_optimizer_config(std::forward<T>(r))};
  }
}

}  // namespace detail

/// The module type behind `M` (itself, or the Impl of a TORCH_MODULE holder).
template <class M>
using module_impl_t = typename detail::ModuleImpl<std::remove_cvref_t<M>>::type;

/// A module volt can fit: a torch::nn::Module whose configure_optimizers returns something volt can use.
/// training_step is checked where the batch type is known (in `fit`).
template <class M>
concept Module = std::derived_from<module_impl_t<M>, torch::nn::Module> && requires(module_impl_t<M>& m) {
  { m.configure_optimizers() } -> detail::OptimizerResult;
};

/// The optimizer type `M`'s configure_optimizers returns (`torch::optim::Optimizer` when its result does not say).
template <class M>
using module_optimizer_t = typename detail::optimizer_type<
    std::remove_cvref_t<decltype(std::declval<module_impl_t<M>&>().configure_optimizers())>>::type;

/// Whether the module steps its own optimizers (Lightning's manual optimization): it declares
/// `static constexpr bool automatic_optimization = false;`. See "Manual optimization" above.
template <class M>
inline constexpr bool manual_optimization = [] {
  if constexpr (requires { module_impl_t<M>::automatic_optimization; }) {
    return !static_cast<bool>(module_impl_t<M>::automatic_optimization);
  } else {
    return false;
  }
}();

/// Whether `M`'s configure_optimizers returns several optimizers (a tuple or a vector).
template <class M>
inline constexpr bool returns_several_optimizers = detail::SeveralOptimizersResult<
    std::remove_cvref_t<decltype(std::declval<module_impl_t<M>&>().configure_optimizers())>>;

/// The module has a training_step for batches of type `Batch`: returning the loss, or (manual optimization, where
/// the step runs its own backward) anything, or nothing.
template <class M, class Batch>
concept TrainableOn = requires(module_impl_t<M>& m, Batch& b, Context& ctx) {
  m.training_step(b, ctx);
} && (manual_optimization<M> || requires(module_impl_t<M>& m, Batch& b, Context& ctx) {
  { m.training_step(b, ctx) } -> std::convertible_to<torch::Tensor>;
});

}  // namespace volt
