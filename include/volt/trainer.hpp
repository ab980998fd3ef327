#pragma once
/// \file
/// `volt::Trainer<Strategy, Precision, Accelerator, Callbacks...>`: runs a module's training, validation,
/// test and prediction loops the way Lightning's Trainer does. It only orchestrates: it calls the same hooks
/// on whatever policies it holds and never asks which ones they are.

#include "volt/accelerators/cpu.hpp"
#include "volt/batch.hpp"
#include "volt/callbacks/concept.hpp"
#include "volt/checkpoint.hpp"
#include "volt/context.hpp"
#include "volt/data/stateful.hpp"
#include "volt/detail/hooks.hpp"
#include "volt/detail/torch_compat.hpp"
#include "volt/module.hpp"
#include "volt/options.hpp"
#include "volt/precision/fp32.hpp"
#include "volt/rules.hpp"
#include "volt/strategies/single_device.hpp"
#include "volt/detail/fit_transfer.hpp"

#include <ATen/Context.h>
#include <c10/util/Type.h>
#include <c10/core/InferenceMode.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <string_view>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace volt {

/// Passed where no loader is given (fit without validation).
struct NoLoader {};

namespace detail {

template <class L>
concept SizedLoader = requires(L& l) {
  { l.size() } -> std::convertible_to<int64_t>;
};

/// A loader given as a pointer (the `std::unique_ptr` that torch::data::make_data_loader returns) is
/// iterated through the pointer.
template <class L>
decltype(auto) deref_loader(L& loader) {
  if constexpr (requires { loader.begin(); }) {
    return (loader);
  } else {
    static_assert(requires { (*loader).begin(); },
                  "volt: a loader must have begin() and end() yielding batches (a torch::data loader, a std::vector "
                  "of batches, volt::data::TensorLoader, ...) or point to one.");
    return (*loader);
  }
}

template <class L>
using batch_t = std::remove_cvref_t<decltype(*deref_loader(std::declval<L&>()).begin())>;

template <class L>
int64_t loader_size(L& loader) {
  if constexpr (SizedLoader<L>) {
    return static_cast<int64_t>(loader.size());
  } else {
    return -1;
  }
}

/// A loader that keeps its position (data/stateful.hpp): its next pass starts where a loaded state says.
template <class L>
concept PositionedLoader = requires(L& l, const L& cl, const data::LoaderState& s) {
  { cl.state_dict() } -> std::same_as<data::LoaderState>;
  cl.check_state(s);
  l.load_state_dict(s);
  { cl.batches_done() } -> std::convertible_to<int64_t>;
};

/// Calls `f(batch, batch_idx, is_last)` for batch indices `start` .. `limit` - 1 (-1: all); `f` returns
/// false to stop. A loader that resumes at batch `start` by itself (a positioned loader that loaded a
/// state) is read from its beginning; any other has its first `start` batches skipped (`skip`). A sized
/// loader knows its last batch; an unsized one is read one batch ahead.
template <class L, class F>
void for_each_batch(L& loader, int64_t limit, F&& f, int64_t start = 0, bool skip = false) {
  if (limit == 0 || (limit > 0 && start >= limit)) return;
  auto it = loader.begin();
  auto end = loader.end();
  if (skip) {
    for (int64_t i = 0; i < start && it != end; ++i) ++it;
  }
  if constexpr (SizedLoader<L>) {
    for (int64_t idx = start; it != end && (limit < 0 || idx < limit); ++it, ++idx) {
      auto&& batch = *it;
      if (!f(batch, idx, idx + 1 == limit)) return;
    }
  } else {
    if (it == end) return;
    using B = std::remove_cvref_t<decltype(*it)>;
    std::optional<B> current(std::in_place, *it);
    ++it;
    for (int64_t idx = start;; ++idx) {
      const bool last = it == end || (limit >= 0 && idx + 1 >= limit);
      if (!f(*current, idx, last) || last) return;
      current.emplace(*it);
      ++it;
    }
  }
}

/// The size of a batch of type `B` for weighted epoch means, or -1 when volt cannot look inside `B`
/// (Context::log then asks for `.batch_size`).
template <class B>
int64_t batch_size_of(const void* batch) {
  if constexpr (MappableBatch<B>) {
    return infer_batch_size(*static_cast<const B*>(batch));
  } else {
    return -1;
  }
}

/// A callback that receives metrics for writing (on_log_metrics).
template <class C, class T>
concept LoggerCallback = requires(C& cb, T& trainer, const std::map<std::string, double>& metrics) {
  cb.on_log_metrics(trainer, metrics, int64_t{});
};

/// LibTorch's schedulers keep their step count protected and have no save/load; a checkpoint needs it.
struct SchedulerAccess : torch::optim::LRScheduler {
  static unsigned& step_count(torch::optim::LRScheduler& s) { return s.*(&SchedulerAccess::step_count_); }
};

/// InferenceMode or NoGradGuard, chosen at run time.
class EvalGradGuard {
 public:
  explicit EvalGradGuard(bool inference_mode) {
    if (inference_mode) {
      inference_.emplace();
    } else {
      no_grad_.emplace();
    }
  }

 private:
  std::optional<c10::InferenceMode> inference_;
  std::optional<torch::NoGradGuard> no_grad_;
};

}  // namespace detail

template <class S = SingleDevice, class P = Fp32, class A = CPU, class... Callbacks>
class Trainer {
  // Phase (a): each slot holds its kind, then the rules between slots (volt/rules.hpp).
  static_assert(Strategy<S>,
                "volt: the first Trainer argument must be a strategy (SingleDevice, DDP<Script>, DDP<Spawn>, "
                "ManualParallel<...>): the order is Trainer<Strategy, Precision, Accelerator, Callbacks...>.");
  static_assert(Precision<P>,
                "volt: the second Trainer argument must be a precision (Fp32, Fp64True, Bf16Mixed, Fp16Mixed, "
                "Bf16True): the order is Trainer<Strategy, Precision, Accelerator, Callbacks...>.");
  static_assert(Accelerator<A>,
                "volt: the third Trainer argument must be an accelerator (CPU, GPU): the order is "
                "Trainer<Strategy, Precision, Accelerator, Callbacks...>.");
  static_assert((Callback<Callbacks> && ...), "volt: every callback must be a movable object type.");
  static_assert(!detail::slots_ok<S, P, A> || Fp16AutocastAvailable<P, A>,
                "volt: this precision autocasts to float16, which the accelerator does not offer (CPU has no "
                "float16 autocast). On CPU use Bf16Mixed or Fp32; for Fp16Mixed use the GPU accelerator.");
  static_assert(!detail::slots_ok<S, P, A> || BackendRunsOn<detail::bind_strategy_t<S, A>, A>,
                "volt: the strategy's collective backend (Nccl) reduces CUDA tensors only, and the accelerator is "
                "CPU. Use volt::Mpi (DDP<Launcher, volt::Mpi>), or leave the backend out: DDP<Script> picks Mpi on "
                "CPU and Nccl on GPU.");
  static_assert(!detail::slots_ok<S, P, A> || BackendCompiledIn<detail::bind_strategy_t<S, A>>,
                "volt: this run reduces with NCCL, which is not compiled in (VOLT_WITH_NCCL is 0). Link the "
                "volt::nccl CMake target (it finds nccl.h and libnccl and defines VOLT_WITH_NCCL=1), or choose "
                "DDP<Launcher, volt::Mpi> to reduce through host memory.");
  static_assert(!detail::slots_ok<S, P, A> || Bf16AutocastAvailable<P, A>,
                "volt: this precision autocasts to bfloat16, which the accelerator does not offer. Use Fp32 or an "
                "accelerator with has_bf16_autocast.");

 public:
  /// The strategy as it runs on this accelerator (DDP<Spawn> with its backend resolved).
  using strategy_type = detail::bind_strategy_t<S, A>;
  using precision_type = P;
  using accelerator_type = A;

  /// Checks every run-time setting against what is allowed and what this machine has (phase (b)); sets up
  /// nothing else until a run starts (phase (c)).
  explicit Trainer(TrainerOptions options = {}, Callbacks... callbacks)
      : options_(std::move(options)), callbacks_(std::move(callbacks)...) {
    validate_options(options_);
    if (!A::is_available()) {
      throw ConfigError(std::string("volt: ") + A::name + " requested (devices=" + std::to_string(options_.devices) +
                        ") but it is not available here: " + A::name + "::device_count() is " +
                        std::to_string(A::device_count()) +
                        ". Check the driver and visible devices (CUDA_VISIBLE_DEVICES), or use the CPU accelerator.");
    }
    if (options_.devices > A::device_count()) {
      throw ConfigError(std::string("volt: devices=") + std::to_string(options_.devices) + " but " + A::name +
                        "::device_count() is " + std::to_string(A::device_count()) + " here. Ask for at most " +
                        std::to_string(A::device_count()) + ".");
    }
    strategy_.check_devices(options_, A::device_count(), A::name);
    apply_fast_dev_run();
  }

  // ---- runs -------------------------------------------------------------------------------------------

  /// Trains `module` on `train_loader`, validating on `val_loader` as the options say. With `ckpt_path`,
  /// resumes from a checkpoint: a file, `"last"` (the newest a ModelCheckpoint wrote; a fresh start when
  /// there is none yet) or `"best"` (its best). Everything the checkpoint holds is restored — weights,
  /// optimizer, scheduler, precision, counters, the training loader's position, metric sums, generators,
  /// callbacks — so the fit goes on as if it had never stopped. Without a validation loader pass
  /// `volt::NoLoader{}` before the path.
  template <class M, class TrainLoader, class ValLoader = NoLoader>
  FitResult fit(M& module, TrainLoader&& train_loader, ValLoader&& val_loader = {}, std::string ckpt_path = {}) {
    static_assert(Module<M>,
                  "volt: fit needs a torch::nn::Module (or its TORCH_MODULE holder) with configure_optimizers() "
                  "returning an optimizer, a shared_ptr/unique_ptr to one, or a volt::OptimizerConfig.");
    using Batch = detail::batch_t<TrainLoader>;
    static_assert(TrainableOn<M, Batch>,
                  "volt: the module has no training_step for this loader's batches. Add "
                  "`torch::Tensor training_step(const Batch& batch, volt::Context& ctx)` returning the loss.");
    constexpr bool has_val = !std::is_same_v<std::remove_cvref_t<ValLoader>, NoLoader>;
    if constexpr (has_val) {
      static_assert(requires(module_impl_t<M>& m, detail::batch_t<ValLoader>& b, Context& c) {
        m.validation_step(b, c);
      }, "volt: fit was given a validation loader but the module has no validation_step for its batches. Add "
         "`void validation_step(const Batch& batch, volt::Context& ctx)`, or call fit without the loader.");
    }
    auto body = [&]() -> FitResult {
      auto& impl = detail::unwrap(module);
      auto& train = detail::deref_loader(train_loader);
      if constexpr (has_val) {
        auto& val = detail::deref_loader(val_loader);
        run_fit(impl, train, &val, ckpt_path);
      } else {
        run_fit(impl, train, static_cast<NoLoader*>(nullptr), ckpt_path);
      }
      return FitResult{callback_metric_values(), best_model_path()};
    };
    if constexpr (requires(detail::FitTransfer<module_impl_t<M>>& t) { strategy_.launch(body, t); }) {
      detail::FitTransfer<module_impl_t<M>> transfer{&detail::unwrap(module)};
      return strategy_.launch(body, transfer);
    } else {
      return strategy_.launch(body);
    }
  }

  /// One validation run; returns its epoch metrics.
  template <class M, class Loader>
  std::map<std::string, double> validate(M& module, Loader&& loader) {
    static_assert(requires(module_impl_t<M>& m, detail::batch_t<Loader>& b, Context& c) { m.validation_step(b, c); },
                  "volt: validate needs the module's validation_step(const Batch&, volt::Context&) for this "
                  "loader's batches.");
    return strategy_.launch([&] { return run_standalone_eval(detail::unwrap(module), detail::deref_loader(loader), Stage::validate); });
  }

  /// One test run; returns its epoch metrics.
  template <class M, class Loader>
  std::map<std::string, double> test(M& module, Loader&& loader) {
    static_assert(requires(module_impl_t<M>& m, detail::batch_t<Loader>& b, Context& c) { m.test_step(b, c); },
                  "volt: test needs the module's test_step(const Batch&, volt::Context&) for this loader's batches.");
    return strategy_.launch([&] { return run_standalone_eval(detail::unwrap(module), detail::deref_loader(loader), Stage::test); });
  }

  /// Runs predict_step on every batch (up to limit_predict_batches) and returns the results in order.
  template <class M, class Loader>
  auto predict(M& module, Loader&& loader) {
    using Batch = detail::batch_t<Loader>;
    static_assert(requires(module_impl_t<M>& m, Batch& b, Context& c) { m.predict_step(b, c); },
                  "volt: predict needs the module's predict_step(const Batch&, volt::Context&) returning a result "
                  "for this loader's batches.");
    using R = std::remove_cvref_t<decltype(std::declval<module_impl_t<M>&>().predict_step(
        std::declval<Batch&>(), std::declval<Context&>()))>;
    return strategy_.launch([&] { return run_predict<R>(detail::unwrap(module), detail::deref_loader(loader)); });
  }

  // ---- what callbacks and callers read --------------------------------------------------------------

  /// The options in effect (fast_dev_run applied).
  const TrainerOptions& options() const { return options_; }
  /// Completed training epochs (the index of the running one while training).
  int64_t current_epoch() const { return state_.current_epoch; }
  /// Optimizer steps taken.
  int64_t global_step() const { return state_.global_step; }
  /// The batch index within the running loop.
  int64_t batch_idx() const { return state_.batch_idx; }
  Stage stage() const { return state_.stage; }
  bool sanity_checking() const { return state_.stage == Stage::sanity_check; }
  bool is_global_zero() const { return strategy_.is_global_zero(); }
  int64_t max_epochs() const { return max_epochs_; }
  int64_t max_steps() const { return options_.max_steps; }
  /// Training batches per epoch (-1: until the loader ends).
  int64_t num_training_batches() const { return num_training_batches_; }
  /// Batches of the running (or last) evaluation run (-1: until the loader ends).
  int64_t num_eval_batches() const { return num_eval_batches_; }
  bool fast_dev_run() const { return options_.fast_dev_run > 0; }

  /// Whether a fit is running (callbacks that act only while fitting ask).
  bool fitting() const { return fitting_; }

  /// Writes a checkpoint of the running (or last) fit to `path` (see volt/checkpoint.hpp for what it
  /// holds); `weights_only` keeps the module's parameters and buffers only. Every rank must call it: each
  /// contributes its generator states, rank zero writes the file atomically, and all wait for the write.
  void save_checkpoint(const std::string& path, bool weights_only = false) {
    if (module_ == nullptr) {
      throw std::logic_error("volt: save_checkpoint(\"" + path + "\") was called, but no fit has run in this process, so "
                             "there is nothing to save yet. (With DDP<Spawn>, fit runs in worker processes: save from "
                             "inside fit, with ModelCheckpoint or a callback.)");
    }
    if (path.empty()) throw std::invalid_argument("volt: save_checkpoint needs a file path; got an empty string.");
    if constexpr (requires { strategy_type::replicates_module; }) {
      if (!strategy_type::replicates_module && strategy_.world_size() > 1) {
        throw CheckpointError(std::string("volt: ") + strategy_type::name +
                              " lets each rank hold different parameters, and a checkpoint is one file written by "
                              "rank zero; save each rank's weights yourself (checkpoint::module_state) instead of " +
                              path + ".");
      }
    }
    std::vector<at::Tensor> rng;
    c10::impl::GenericList grads(c10::AnyType::get());
    if (!weights_only) {
      for (const at::Tensor& t : checkpoint::rng_states()) rng.push_back(gather_ranks(t));
      if (in_train_batch_ && mid_window_) {  // gradients accumulated so far in this window, every rank's
        for (const auto& p : params_) {
          const at::Tensor defined = gather_ranks(torch::tensor({p.grad().defined() ? 1 : 0}, torch::kUInt8)).flatten();
          if (!defined.any().item<bool>()) {  // no rank has one
            grads.push_back(c10::IValue());
            continue;
          }
          checkpoint::Dict g = checkpoint::make_dict();
          g.insert("defined", defined);
          g.insert("grad", gather_ranks(p.grad().defined() ? p.grad().detach() : torch::zeros_like(p)));
          grads.push_back(g);
        }
      }
    }
    if (strategy_.is_global_zero()) {
      checkpoint::Dict d = checkpoint::make_dict();
      d.insert("state_dict", checkpoint::module_state(*module_));
      if (!weights_only) {
        add_training_state(d, rng);
        d.insert("accumulated_grads", grads);
      }
      checkpoint::save(path, std::move(d));
    }
    strategy_.barrier();
  }

  /// Asks the training loop to stop (honoured once min_epochs and min_steps are met).
  void request_stop() { should_stop_ = true; }
  bool should_stop() const { return should_stop_; }

  /// The latest value of every logged name (step values and epoch values), as Lightning's `callback_metrics`.
  const std::map<std::string, torch::Tensor>& callback_metrics() const { return callback_metrics_; }
  const std::map<std::string, torch::Tensor>& progress_bar_metrics() const { return progress_bar_metrics_; }
  const std::map<std::string, torch::Tensor>& logged_metrics() const { return logged_metrics_; }
  /// `callback_metrics` as numbers (reads device values).
  std::map<std::string, double> callback_metric_values() const { return to_doubles(callback_metrics_); }

  /// The optimizer and scheduler of the running (or last) fit; null before.
  torch::optim::Optimizer* optimizer() { return optim_.optimizer.get(); }
  torch::optim::LRScheduler* lr_scheduler() { return optim_.scheduler.get(); }

  strategy_type& strategy() { return strategy_; }
  const strategy_type& strategy() const { return strategy_; }
  P& precision() { return precision_; }
  const P& precision() const { return precision_; }
  template <class C>
  C& callback() { return std::get<C>(callbacks_); }
  std::tuple<Callbacks...>& callbacks() { return callbacks_; }

  /// The best checkpoint a callback recorded ("" when none does).
  std::string best_model_path() const {
    std::string path;
    std::apply([&](const auto&... cb) { (take_best_model_path(path, cb), ...); }, callbacks_);
    return path;
  }

  /// Whether the running (or last) fit validates at all.
  bool has_validation() const { return num_val_batches_ != 0; }

  /// Records a value from outside a module step (a callback's own measurement, such as a learning rate):
  /// it joins callback_metrics (and the progress bar), and loggers receive it now.
  void record_metric(const std::string& name, double value, bool prog_bar = false, bool logger = true) {
    const torch::Tensor v = torch::scalar_tensor(value, torch::kFloat64);
    callback_metrics_[name] = v;
    if (prog_bar) progress_bar_metrics_[name] = v;
    if (logger) {
      logged_metrics_[name] = v;
      std::map<std::string, torch::Tensor> now{{name, v}};
      send_to_loggers(now);
    }
  }

 private:
  template <class C>
  static void take_best_model_path(std::string& path, const C& cb) {
    if constexpr (requires { cb.best_model_path(); }) {
      if (path.empty()) path = std::string(cb.best_model_path());
    }
  }

  static std::map<std::string, double> to_doubles(const std::map<std::string, torch::Tensor>& m) {
    std::map<std::string, double> out;
    for (const auto& [k, v] : m) out.emplace(k, v.template item<double>());
    return out;
  }

  // fast_dev_run overrides, as Lightning's.
  void apply_fast_dev_run() {
    if (options_.fast_dev_run > 0) {
      const int64_t n = options_.fast_dev_run;
      options_.limit_train_batches = Limit(n);
      options_.limit_val_batches = Limit(n);
      options_.limit_test_batches = Limit(n);
      options_.limit_predict_batches = Limit(n);
      options_.max_steps = n;
      options_.max_epochs = 1;
      options_.num_sanity_val_steps = 0;
      options_.val_check_interval = Limit::all();
      options_.check_val_every_n_epoch = 1;
    }
    max_epochs_ = options_.max_epochs.value_or(options_.max_steps == -1 ? 1000 : -1);
  }

  // ---- set-up shared by every run -----------------------------------------------------------------

  void setup_run(torch::nn::Module& module) {
    if (options_.seed) torch::manual_seed(*options_.seed);
    if (options_.deterministic) {
      at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
      at::globalContext().setDeterministicCuDNN(true);
      at::globalContext().setBenchmarkCuDNN(false);
      ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    }
    strategy_.setup_environment(A::device(strategy_.local_rank()));
    state_.device = strategy_.root_device();
    state_.global_rank = strategy_.global_rank();
    state_.world_size = strategy_.world_size();
    collectives_ = detail::StrategyCollectives<strategy_type>(&strategy_);
    state_.collectives = &collectives_;
    strategy_.setup_module(module);
    precision_.convert_module(module);
  }

  template <class B>
  void enter_batch(const B& batch, int64_t batch_idx) {
    state_.batch_idx = batch_idx;
    state_.in_batch = true;
    state_.batch = &batch;
    state_.batch_size_of = &detail::batch_size_of<B>;
    state_.batch_type = &typeid(B);
  }
  void leave_batch() {
    state_.in_batch = false;
    state_.batch = nullptr;
  }

  /// The batch the step sees: moved to the device and cast for "true" precisions, or the loader's own
  /// object when neither applies (CPU, no cast: no copy at all).
  template <class B, class F>
  decltype(auto) with_prepared(B& batch, F&& f) {
    constexpr bool moves = A::device_type != c10::DeviceType::CPU;
    if constexpr (moves || P::converts_inputs) {
      auto prepared = [&] {
        if constexpr (moves && P::converts_inputs) {
          return batch_to_floating_dtype(batch_to_device(batch, state_.device), P::input_dtype);
        } else if constexpr (moves) {
          return batch_to_device(batch, state_.device);
        } else {
          return batch_to_floating_dtype(batch, P::input_dtype);
        }
      }();
      return f(prepared);
    } else {
      return f(batch);
    }
  }

  template <class F>
  void each_callback(F&& f) {
    std::apply([&](auto&... cb) { (f(cb), ...); }, callbacks_);
  }
  template <bool Monitors, class F>
  void each_callback_monitoring(F&& f) {
    std::apply([&](auto&... cb) {
      auto one = [&](auto& c) {
        if constexpr (monitors_metrics<std::remove_cvref_t<decltype(c)>> == Monitors) f(c);
      };
      (one(cb), ...);
      (void)one;  // unused when the pack is empty
    }, callbacks_);
  }

  // A function, not a constant: its body is a complete-class context, so callbacks may use the Trainer's members.
  static consteval bool has_loggers() {
    return (detail::LoggerCallback<Callbacks, Trainer> || ... || false);
  }

  // ---- metrics ------------------------------------------------------------------------------------

  /// After a batch: fresh step values become visible to callbacks, the progress bar and loggers.
  void publish_step(detail::MetricStore& store) {
    for (auto& e : store.entries()) {
      if (!e.step_fresh) continue;
      e.step_fresh = false;
      const std::string key = e.step_key();
      const torch::Tensor v = e.sync_dist ? strategy_.all_reduce(e.step_value, e.reduce) : e.step_value;
      callback_metrics_[key] = v;
      if (e.prog_bar) progress_bar_metrics_[key] = v;
      if (e.logger) {
        logged_metrics_[key] = v;
        if constexpr (has_loggers()) pending_log_[key] = v;
      }
    }
  }

  /// At an epoch's end: every on_epoch value reduced over the epoch (and across ranks when asked).
  /// Safe to call more than once: later calls add what epoch-end hooks logged since.
  void publish_epoch(detail::MetricStore& store, std::map<std::string, torch::Tensor>* to_log) {
    for (auto& e : store.entries()) {
      if (!e.on_epoch || e.weight == 0.0) continue;
      torch::Tensor acc = e.accumulated;
      torch::Tensor weight = torch::scalar_tensor(e.weight, acc.options());
      if (e.sync_dist) {  // a weighted mean: sum the weighted values and the weights across ranks
        acc = strategy_.all_reduce(acc, e.reduce == Reduce::mean ? Reduce::sum : e.reduce);
        if (e.reduce == Reduce::mean) weight = strategy_.all_reduce(weight, Reduce::sum);
      }
      torch::Tensor v = e.reduce == Reduce::mean ? acc / weight : acc;
      const std::string key = e.epoch_key();
      callback_metrics_[key] = v;
      if (e.prog_bar) progress_bar_metrics_[key] = v;
      if (e.logger) {
        logged_metrics_[key] = v;
        if (to_log != nullptr) (*to_log)[key] = v;
      }
    }
  }

  /// Hands metrics to every logger callback (with the epoch, as Lightning adds it) and clears them.
  void send_to_loggers(std::map<std::string, torch::Tensor>& metrics) {
    if constexpr (has_loggers()) {
      if (metrics.empty()) return;
      auto values = to_doubles(metrics);
      values["epoch"] = static_cast<double>(state_.current_epoch);
      const int64_t step = std::max<int64_t>(state_.global_step - 1, 0);
      each_callback([&](auto& cb) {
        if constexpr (requires { cb.on_log_metrics(*this, values, step); }) cb.on_log_metrics(*this, values, step);
      });
    }
    metrics.clear();
  }

  // ---- checkpoints -------------------------------------------------------------------------------

  /// Every rank's copy of `t` stacked in rank order ([world_size, ...]).
  at::Tensor gather_ranks(const at::Tensor& t) {
    if constexpr (requires { strategy_.all_gather(t); }) {
      if (strategy_.world_size() > 1) return strategy_.all_gather(t).cpu();
    }
    return t.unsqueeze(0).cpu();
  }

  /// Where the loops stand, in the terms a resumed fit needs (see restore()).
  checkpoint::Dict loop_counters() const {
    int64_t batch_in_epoch = 0, total = total_batch_idx_;
    bool finished = false, val_pending = false;
    if (in_epoch_end_) {
      finished = true;
      batch_in_epoch = batches_this_epoch_;
    } else if (in_train_batch_) {  // saved during a batch (its end hooks, or its validation): resume after it
      batch_in_epoch = train_batch_idx_ + 1;
      total = total_batch_idx_ + 1;
      val_pending = should_check_val(train_batch_idx_, train_is_last_) && !val_started_;
    }
    checkpoint::Dict d = checkpoint::make_dict();
    d.insert("epoch", state_.current_epoch);
    d.insert("global_step", state_.global_step);
    d.insert("batch_in_epoch", batch_in_epoch);
    d.insert("total_batch_idx", total);
    d.insert("epoch_finished", finished);
    d.insert("val_pending", val_pending);
    d.insert("should_stop", should_stop_);
    d.insert("world_size", static_cast<int64_t>(strategy_.world_size()));
    return d;
  }

  static c10::impl::GenericList metric_store_state(detail::MetricStore& store) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& e : store.entries()) {
      checkpoint::Dict d = checkpoint::make_dict();
      d.insert("name", e.name);
      d.insert("on_step", e.on_step);
      d.insert("on_epoch", e.on_epoch);
      d.insert("prog_bar", e.prog_bar);
      d.insert("logger", e.logger);
      d.insert("sync_dist", e.sync_dist);
      d.insert("reduce", static_cast<int64_t>(e.reduce));
      d.insert("accumulated", e.accumulated.defined() ? c10::IValue(e.accumulated.cpu()) : c10::IValue());
      d.insert("weight", e.weight);
      out.push_back(d);
    }
    return out;
  }
  static std::vector<detail::MetricEntry> metric_entries(const c10::IValue& v, const std::string& path) {
    std::vector<detail::MetricEntry> out;
    for (const auto& item : v.toListRef()) {
      const auto d = item.toGenericDict();
      auto b = [&](const char* k) { return checkpoint::entry(d, k, path).toBool(); };
      detail::MetricEntry e;
      e.name = checkpoint::entry(d, "name", path).toStringRef();
      e.on_step = b("on_step");
      e.on_epoch = b("on_epoch");
      e.prog_bar = b("prog_bar");
      e.logger = b("logger");
      e.sync_dist = b("sync_dist");
      e.reduce = static_cast<Reduce>(checkpoint::entry(d, "reduce", path).toInt());
      const c10::IValue acc = checkpoint::entry(d, "accumulated", path);
      if (acc.isTensor()) e.accumulated = acc.toTensor();
      e.weight = checkpoint::entry(d, "weight", path).toDouble();
      out.push_back(std::move(e));
    }
    return out;
  }

  /// The key of a callback's state: its `state_key()`, else its type's name.
  template <class C>
  static std::string callback_key(const C& cb) {
    if constexpr (requires { { cb.state_key() } -> std::convertible_to<std::string>; }) {
      return cb.state_key();
    } else {
      return c10::demangle(typeid(C).name());
    }
  }
  template <class C>
  static constexpr bool stateful_callback = requires(const C& c) { c.state_dict(); };

  template <class C>
  static c10::IValue callback_state(const C& cb) {
    auto st = cb.state_dict();
    if constexpr (std::is_same_v<decltype(st), std::map<std::string, double>>) {
      return checkpoint::from_map(st);
    } else {
      return c10::IValue(st);
    }
  }
  template <class C>
  static void load_callback_state(C& cb, const c10::IValue& v, const std::string& path) {
    if constexpr (requires(const std::map<std::string, double>& m) { cb.load_state_dict(m); }) {
      cb.load_state_dict(checkpoint::to_map(v.toGenericDict(), path));
    } else {
      cb.load_state_dict(v.toGenericDict());
    }
  }

  void add_training_state(checkpoint::Dict& d, const std::vector<at::Tensor>& rng) {
    c10::List<at::Tensor> optimizers;
    if (optim_.optimizer) optimizers.push_back(checkpoint::optimizer_state(*optim_.optimizer));
    d.insert("optimizer_states", optimizers);
    c10::impl::GenericList schedulers(c10::AnyType::get());
    if (optim_.scheduler) {
      checkpoint::Dict sd = checkpoint::make_dict();
      sd.insert("step_count", static_cast<int64_t>(detail::SchedulerAccess::step_count(*optim_.scheduler)));
      schedulers.push_back(sd);
    }
    d.insert("lr_schedulers", schedulers);
    d.insert("precision", checkpoint::from_map(precision_.state_dict()));
    d.insert("loops", loop_counters());
    if (train_loader_state_ || (!fitting_ && final_loader_state_)) {
      checkpoint::Dict loaders = checkpoint::make_dict();
      loaders.insert("train", checkpoint::from_loader_state(train_loader_state_ ? train_loader_state_() : *final_loader_state_));
      d.insert("loaders", loaders);
    }
    d.insert("metrics", metric_store_state(train_store_));
    checkpoint::Dict r = checkpoint::make_dict();
    r.insert("cpu", rng.at(0));
    c10::List<at::Tensor> cuda;
    for (std::size_t i = 1; i < rng.size(); ++i) cuda.push_back(rng[i]);
    r.insert("cuda", cuda);
    d.insert("rng", r);
    checkpoint::Dict cbs = checkpoint::make_dict();
    each_callback([&](auto& cb) {
      using C = std::remove_cvref_t<decltype(cb)>;
      if constexpr (stateful_callback<C>) {
        std::string key = callback_key(cb);
        for (int n = 2; cbs.contains(key); ++n) key = callback_key(cb) + "#" + std::to_string(n);
        cbs.insert(key, callback_state(cb));
      }
    });
    d.insert("callbacks", cbs);
    if (module_save_hook_) module_save_hook_(d);
  }

  /// `"last"` and `"best"` through the ModelCheckpoint callbacks; any other path as it is. "" for a
  /// "last" that finds nothing yet (a fresh start, as Lightning).
  std::string resolve_ckpt_path(const std::string& path) const {
    if (path != "last" && path != "best") return path;
    bool any = false;
    std::string found;
    std::apply([&](const auto&... cb) {
      auto one = [&](const auto& c) {
        if constexpr (requires { c.find_last_checkpoint(*this); c.find_best_checkpoint(*this); }) {
          any = true;
          if (found.empty()) found = path == "last" ? c.find_last_checkpoint(*this) : c.find_best_checkpoint(*this);
        }
      };
      (one(cb), ...);
      (void)one;
    }, callbacks_);
    if (!any) {
      throw ConfigError("volt: fit(..., ckpt_path=\"" + path + "\") looks for checkpoints through a ModelCheckpoint "
                        "callback, and this Trainer has none. Add one, or give the checkpoint's file path.");
    }
    if (found.empty() && path == "best") {
      throw CheckpointError("volt: fit(..., ckpt_path=\"best\"): no best checkpoint is known yet (no ModelCheckpoint "
                            "has saved one with a monitor, and its folder holds no checkpoint naming one).");
    }
    if (found.empty() && strategy_.is_global_zero()) {
      std::cerr << "volt: fit(..., ckpt_path=\"last\"): no checkpoint was found yet; training starts from the beginning.\n";
    }
    return found;
  }

  /// Loads everything a full checkpoint holds, after checking all of it: on any error nothing is changed.
  template <class Impl, class TL>
  void restore(Impl& module, TL& train_loader, const std::string& path) {
    const checkpoint::Dict d = checkpoint::read(path);
    const checkpoint::Dict weights = checkpoint::entry(d, "state_dict", path).toGenericDict();
    checkpoint::check_module_state(module, weights, path);
    if (!d.contains("loops")) {
      throw CheckpointError("volt: " + path + " holds weights only (saved with weights_only), which cannot resume a "
                            "fit. Load them with volt::load_weights(module, path), or resume from a full checkpoint.");
    }
    const checkpoint::Dict loops = d.at("loops").toGenericDict();
    auto loop_int = [&](const char* k) { return checkpoint::entry(loops, k, path).toInt(); };
    auto loop_bool = [&](const char* k) { return checkpoint::entry(loops, k, path).toBool(); };
    Resume r;
    const int64_t epoch = loop_int("epoch"), step = loop_int("global_step"), total = loop_int("total_batch_idx");
    r.batch_in_epoch = loop_int("batch_in_epoch");
    r.epoch_finished = loop_bool("epoch_finished");
    r.val_pending = loop_bool("val_pending");
    r.world_size = static_cast<int>(loop_int("world_size"));
    const bool should_stop = loop_bool("should_stop");

    std::optional<data::LoaderState> loader_state;
    if constexpr (detail::PositionedLoader<TL>) {
      if (d.contains("loaders") && d.at("loaders").toGenericDict().contains("train")) {
        loader_state = checkpoint::to_loader_state(d.at("loaders").toGenericDict().at("train").toGenericDict(), path);
        try {
          train_loader.check_state(*loader_state);
        } catch (const std::invalid_argument& e) {
          throw CheckpointError("volt: the training loader cannot resume from " + path + ": " + std::string(e.what()).substr(6));
        }
      }
    }
    const auto optimizers = checkpoint::entry(d, "optimizer_states", path).toListRef();
    if (optimizers.size() != 1) {
      throw CheckpointError("volt: " + path + " holds " + std::to_string(optimizers.size()) +
                            " optimizer states; this fit has 1 optimizer.");
    }
    const auto schedulers = checkpoint::entry(d, "lr_schedulers", path).toListRef();
    if (schedulers.size() != (optim_.scheduler ? 1u : 0u)) {
      throw CheckpointError("volt: " + path + " holds " + std::to_string(schedulers.size()) +
                            " learning-rate scheduler states; this fit has " + (optim_.scheduler ? "1" : "none") +
                            ". Resume with the configure_optimizers that wrote it.");
    }
    auto metrics = metric_entries(checkpoint::entry(d, "metrics", path), path);
    const checkpoint::Dict rng = checkpoint::entry(d, "rng", path).toGenericDict();
    const auto precision_state = checkpoint::to_map(checkpoint::entry(d, "precision", path).toGenericDict(), path);
    const checkpoint::Dict callback_states = checkpoint::entry(d, "callbacks", path).toGenericDict();
    const auto grads = checkpoint::entry(d, "accumulated_grads", path).toListRef();
    if (!grads.empty() && grads.size() != params_.size()) {
      throw CheckpointError("volt: " + path + " holds accumulated gradients of " + std::to_string(grads.size()) +
                            " parameters; the module has " + std::to_string(params_.size()) + ".");
    }

    // What can still refuse the state (the optimizer, the precision, callbacks) goes first, with backups.
    const at::Tensor optimizer_backup = checkpoint::optimizer_state(*optim_.optimizer);
    const auto precision_backup = precision_.state_dict();
    std::vector<std::function<void()>> undo;
    checkpoint::load_optimizer_state(*optim_.optimizer, optimizers[0].toTensor(), path);
    try {
      if (!precision_state.empty()) precision_.load_state_dict(precision_state);
      std::map<std::string, int> seen;
      each_callback([&](auto& cb) {
        using C = std::remove_cvref_t<decltype(cb)>;
        if constexpr (stateful_callback<C>) {
          std::string key = callback_key(cb);
          if (const int n = ++seen[key]; n > 1) key += "#" + std::to_string(n);
          if (!callback_states.contains(key)) return;
          auto backup = callback_state(cb);
          load_callback_state(cb, callback_states.at(key), path);
          undo.push_back([&cb, backup, path] { load_callback_state(cb, backup, path); });
        }
      });
      if constexpr (requires(const checkpoint::Dict& c) { module.on_load_checkpoint(c); }) module.on_load_checkpoint(d);
    } catch (const std::exception& e) {
      for (auto& u : undo) u();
      precision_.load_state_dict(precision_backup);
      checkpoint::load_optimizer_state(*optim_.optimizer, optimizer_backup, path);
      throw CheckpointError("volt: " + path + " could not be loaded (" + std::string(e.what()) + "); nothing was changed.");
    }

    // The rest cannot fail any more.
    if (optim_.scheduler) {
      detail::SchedulerAccess::step_count(*optim_.scheduler) =
          static_cast<unsigned>(schedulers[0].toGenericDict().at("step_count").toInt());
    }
    checkpoint::load_module_state(module, weights);
    const int rank = strategy_.global_rank();
    auto row = [&](const at::Tensor& all) { return all.select(0, rank < all.size(0) ? rank : 0).clone(); };
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < grads.size(); ++i) {
        if (!grads[i].isGenericDict()) continue;
        const auto g = grads[i].toGenericDict();
        if (row(g.at("defined").toTensor()).template item<uint8_t>() != 0) {
          params_[i].mutable_grad() = row(g.at("grad").toTensor()).to(params_[i].device());
        }
      }
    }
    if constexpr (detail::PositionedLoader<TL>) {
      if (loader_state) train_loader.load_state_dict(*loader_state);
    }
    r.loader_positioned = loader_state.has_value();
    state_.current_epoch = epoch;
    state_.global_step = step;
    total_batch_idx_ = total;
    should_stop_ = should_stop;
    train_store_.clear();
    for (auto& e : metrics) {
      if (e.accumulated.defined()) e.accumulated = e.accumulated.to(state_.device);
      train_store_.entries().push_back(std::move(e));
    }
    r.rng.push_back(row(checkpoint::entry(rng, "cpu", path).toTensor()));
    for (const auto& t : checkpoint::entry(rng, "cuda", path).toListRef()) r.rng.push_back(row(t.toTensor()));
    if (!r.loader_positioned && r.world_size != strategy_.world_size() && r.batch_in_epoch > 0 && !r.epoch_finished &&
        strategy_.is_global_zero()) {
      std::cerr << "volt: " << path << " was saved mid-epoch on " << r.world_size << " ranks and resumes on "
                << strategy_.world_size() << "; the training loader keeps no position (use a volt::data loader), so "
                << r.batch_in_epoch << " batches of each rank's shard are skipped, which is not the same samples.\n";
    }
    resume_ = std::move(r);
  }

  // ---- fit ----------------------------------------------------------------------------------------

  bool can_stop_early() const {
    return state_.current_epoch >= options_.min_epochs && state_.global_step >= options_.min_steps;
  }
  bool max_steps_reached() const { return options_.max_steps >= 0 && state_.global_step >= options_.max_steps; }
  bool fit_done() const {
    if (num_training_batches_ == 0 || max_steps_reached()) return true;
    if (max_epochs_ >= 0 && state_.current_epoch >= max_epochs_) return true;
    return should_stop_ && can_stop_early();
  }

  template <class VL>
  void resolve_fit_sizes(const int64_t train_size, VL* val) {
    num_training_batches_ = options_.limit_train_batches.resolve(train_size, "limit_train_batches");
    val_check_batch_ = -1;
    const Limit& vci = options_.val_check_interval;
    if (!vci.is_fraction()) {
      val_check_batch_ = vci.count();
      if (options_.check_val_every_n_epoch && num_training_batches_ >= 0 && val_check_batch_ > num_training_batches_) {
        throw ConfigError("volt: val_check_interval=" + std::to_string(val_check_batch_) +
                          " must be no more than the number of training batches per epoch (" +
                          std::to_string(num_training_batches_) +
                          "). Give a smaller value, a fraction, or leave check_val_every_n_epoch unset to count "
                          "batches across epochs.");
      }
    } else if (num_training_batches_ >= 0) {
      val_check_batch_ = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(num_training_batches_) * vci.fraction()));
    } else if (vci.fraction() != 1.0) {
      throw ConfigError("volt: val_check_interval=" + std::to_string(vci.fraction()) +
                        " is a fraction of the training loader, which has no size(). Give an integer number of "
                        "batches.");
    }
    num_val_batches_ = 0;
    if (val != nullptr) {
      num_val_batches_ = options_.limit_val_batches.resolve(detail::loader_size(*val), "limit_val_batches");
    }
  }

  bool should_check_val(int64_t batch_idx, bool is_last) const {
    if (num_val_batches_ == 0) return false;
    if (options_.check_val_every_n_epoch && (state_.current_epoch + 1) % *options_.check_val_every_n_epoch != 0) {
      return false;
    }
    const bool infinite = val_check_batch_ < 0;
    if (is_last && infinite) return true;
    if (should_stop_ && can_stop_early()) return true;
    if (infinite) return false;
    const int64_t iteration = options_.check_val_every_n_epoch ? batch_idx : total_batch_idx_;
    return (iteration + 1) % val_check_batch_ == 0;
  }

  template <class Impl, class TL, class VL>
  void run_fit(Impl& module, TL& train, VL* val, const std::string& ckpt_path) {
    state_ = detail::LoopState{};
    should_stop_ = false;
    total_batch_idx_ = 0;
    resume_.reset();
    train_store_.clear();
    callback_metrics_.clear();
    progress_bar_metrics_.clear();
    logged_metrics_.clear();
    setup_run(module);
    Context ctx(state_, train_store_);
    module_ = &module;

    decltype(auto) train_loader = strategy_.process_dataloader(train, Stage::train);
    using PTL = std::remove_reference_t<decltype(train_loader)>;
    if constexpr (requires(Impl& m, checkpoint::Dict& d) { m.on_save_checkpoint(d); }) {
      module_save_hook_ = [&module](checkpoint::Dict& d) { module.on_save_checkpoint(d); };
    } else {
      module_save_hook_ = nullptr;
    }
    if constexpr (detail::PositionedLoader<PTL>) {
      train_loader_state_ = [&train_loader] { return train_loader.state_dict(); };
    } else {
      train_loader_state_ = nullptr;
    }
    fitting_ = true;
    final_loader_state_.reset();
    struct FitScope {
      Trainer* t;
      ~FitScope() {
        t->fitting_ = false;
        if (t->train_loader_state_) t->final_loader_state_ = t->train_loader_state_();
        t->train_loader_state_ = nullptr;
        t->in_train_batch_ = t->in_epoch_end_ = false;
      }
    } scope{this};

    try {
      const std::string resume_from = ckpt_path.empty() ? std::string() : resolve_ckpt_path(ckpt_path);
      each_callback([&](auto& cb) { detail::callback_hook::setup(cb, *this, module, Stage::train); });
      detail::module_hook::setup(module, ctx, Stage::train);
      optim_ = detail::to_optimizer_config(module.configure_optimizers());
      if (!optim_.optimizer) {
        throw std::invalid_argument("volt: configure_optimizers returned no optimizer (a null pointer).");
      }
      if (optim_.frequency < 1) {
        throw ConfigError("volt: OptimizerConfig frequency=" + std::to_string(optim_.frequency) +
                          " is not allowed: give a number >= 1.");
      }
      params_ = module.parameters();

      if constexpr (!std::is_same_v<VL, NoLoader>) {
        decltype(auto) val_loader = strategy_.process_dataloader(*val, Stage::validate);
        using V = std::remove_reference_t<decltype(val_loader)>;
        resolve_fit_sizes(detail::loader_size(train_loader), &val_loader);
        if (!resume_from.empty()) restore(module, train_loader, resume_from);
        fit_loops(module, ctx, train_loader, static_cast<V*>(&val_loader));
      } else {
        resolve_fit_sizes(detail::loader_size(train_loader), static_cast<NoLoader*>(nullptr));
        if (!resume_from.empty()) restore(module, train_loader, resume_from);
        fit_loops(module, ctx, train_loader, static_cast<NoLoader*>(nullptr));
      }

      each_callback([&](auto& cb) { detail::callback_hook::teardown(cb, *this, module, Stage::train); });
      detail::module_hook::teardown(module, ctx, Stage::train);
      strategy_teardown();
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      each_callback([&](auto& cb) { detail::callback_hook::on_exception(cb, *this, module, error); });
      leave_batch();
      strategy_teardown();
      throw;
    }
  }

  template <class Impl, class TL, class VL>
  void fit_loops(Impl& module, Context& ctx, TL& train, VL* val) {
    each_callback([&](auto& cb) { detail::callback_hook::on_fit_start(cb, *this, module); });
    detail::module_hook::on_fit_start(module, ctx);

    if constexpr (!std::is_same_v<VL, NoLoader>) {
      if (num_val_batches_ != 0 && options_.num_sanity_val_steps != 0) {
        const int64_t n = options_.num_sanity_val_steps < 0
                              ? num_val_batches_
                              : (num_val_batches_ < 0 ? options_.num_sanity_val_steps
                                                      : std::min(options_.num_sanity_val_steps, num_val_batches_));
        state_.stage = Stage::sanity_check;
        each_callback([&](auto& cb) { detail::callback_hook::on_sanity_check_start(cb, *this, module); });
        run_eval_loop(module, *val, Stage::sanity_check, n);
        each_callback([&](auto& cb) { detail::callback_hook::on_sanity_check_end(cb, *this, module); });
        state_.stage = Stage::train;
      }
    }

    module.train();
    each_callback([&](auto& cb) { detail::callback_hook::on_train_start(cb, *this, module); });
    detail::module_hook::on_train_start(module, ctx);

    if (resume_) {  // the generators as they were at the save; an epoch saved from its end hooks is closed
      checkpoint::set_rng_states(resume_->rng);
      if (resume_->epoch_finished) {
        resume_.reset();
        close_epoch();
      }
    }

    while (!fit_done()) {
      if constexpr (requires { train.set_epoch(int64_t{}); }) train.set_epoch(state_.current_epoch);
      const bool resuming = resume_.has_value();
      if (!resuming) train_store_.clear();  // a resumed epoch keeps the metric sums of its first part
      state_.stage = Stage::train;
      each_callback([&](auto& cb) { detail::callback_hook::on_train_epoch_start(cb, *this, module); });
      detail::module_hook::on_train_epoch_start(module, ctx);

      int64_t start = 0;
      bool skip = false;
      if (resuming) {
        start = resume_->batch_in_epoch;
        skip = !resume_->loader_positioned;  // a loader without a saved position skips what was trained on
        if constexpr (detail::PositionedLoader<TL>) {
          if (resume_->loader_positioned) start = train.batches_done();
        }
        if (resume_->val_pending) run_validation(module, val);  // the check of the batch the save followed
        resume_.reset();
      }
      batches_this_epoch_ = start;
      detail::for_each_batch(
          train, num_training_batches_,
          [&](auto&& batch, int64_t batch_idx, bool is_last) {
            batches_this_epoch_ = batch_idx + 1;
            return train_batch(module, ctx, batch, batch_idx, is_last, val);
          },
          start, skip);

      // Epoch end: callbacks, the module, then callbacks that monitor metrics (they see its logs).
      in_epoch_end_ = true;
      publish_epoch(train_store_, nullptr);
      each_callback_monitoring<false>([&](auto& cb) { detail::callback_hook::on_train_epoch_end(cb, *this, module); });
      detail::module_hook::on_train_epoch_end(module, ctx);
      std::map<std::string, torch::Tensor> epoch_log;
      publish_epoch(train_store_, &epoch_log);
      each_callback_monitoring<true>([&](auto& cb) { detail::callback_hook::on_train_epoch_end(cb, *this, module); });
      send_to_loggers(epoch_log);
      in_epoch_end_ = false;
      close_epoch();
    }

    each_callback([&](auto& cb) { detail::callback_hook::on_train_end(cb, *this, module); });
    detail::module_hook::on_train_end(module, ctx);
    each_callback([&](auto& cb) { detail::callback_hook::on_fit_end(cb, *this, module); });
    detail::module_hook::on_fit_end(module, ctx);
  }

  /// After an epoch's end hooks: the epoch-interval scheduler step, the next epoch, the stop decision.
  void close_epoch() {
    if (optim_.scheduler && optim_.interval == Interval::epoch && (state_.current_epoch + 1) % optim_.frequency == 0) {
      optim_.scheduler->step();
    }
    ++state_.current_epoch;
    should_stop_ = strategy_.reduce_boolean_decision(should_stop_, /*all=*/false);
  }

  template <class Impl, class VL>
  void run_validation(Impl& module, VL* val) {
    if constexpr (!std::is_same_v<VL, NoLoader>) {
      run_eval_loop(module, *val, Stage::validate, num_val_batches_);
      module.train();
      state_.stage = Stage::train;
    }
  }

  /// One training batch: step, maybe optimizer step, hooks, metrics, maybe validation.
  /// Returns false when the epoch should end here.
  template <class Impl, class B, class VL>
  bool train_batch(Impl& module, Context& ctx, B& batch, int64_t batch_idx, bool is_last, VL* val) {
    struct InBatch {  // what a checkpoint taken during this batch records
      Trainer* t;
      InBatch(Trainer* trainer, int64_t idx, bool last) : t(trainer) {
        t->in_train_batch_ = true;
        t->train_batch_idx_ = idx;
        t->train_is_last_ = last;
        t->val_started_ = false;
      }
      ~InBatch() { t->in_train_batch_ = false; }
    } in_batch(this, batch_idx, is_last);
    enter_batch(batch, batch_idx);
    each_callback([&](auto& cb) { detail::callback_hook::on_train_batch_start(cb, *this, module, batch, batch_idx); });
    if constexpr (!std::is_void_v<decltype(detail::module_hook::on_train_batch_start(module, ctx, batch, batch_idx))>) {
      const auto response = detail::module_hook::on_train_batch_start(module, ctx, batch, batch_idx);
      if (static_cast<int64_t>(response) == -1) {
        leave_batch();
        return false;
      }
    } else {
      detail::module_hook::on_train_batch_start(module, ctx, batch, batch_idx);
    }

    const int64_t k = options_.accumulate_grad_batches;
    const bool window_start = batch_idx % k == 0;
    const bool steps = (batch_idx + 1) % k == 0 || is_last;
    mid_window_ = !steps;
    torch::optim::Optimizer& optimizer = *optim_.optimizer;

    torch::Tensor loss = with_prepared(batch, [&](auto& b) -> torch::Tensor {
      [[maybe_unused]] auto guard = precision_.forward_context(A::device_type);
      return module.training_step(b, ctx);
    });

    if (loss.defined()) {  // an undefined loss skips this batch's optimization, as returning None in Lightning
      if (window_start) {
        each_callback([&](auto& cb) { detail::callback_hook::on_before_zero_grad(cb, *this, module, optimizer); });
        detail::module_hook::on_before_zero_grad(module, ctx, optimizer);
        detail::zero_grad(optimizer);
      }
      const torch::Tensor scaled = k > 1 ? loss / static_cast<double>(k) : loss;
      each_callback([&](auto& cb) { detail::callback_hook::on_before_backward(cb, *this, module, scaled); });
      detail::module_hook::on_before_backward(module, ctx, scaled);
      if constexpr (requires { strategy_.pre_backward(true); }) strategy_.pre_backward(steps);
      precision_.backward(scaled);
      if constexpr (requires { strategy_.post_backward(); }) strategy_.post_backward();
      each_callback([&](auto& cb) { detail::callback_hook::on_after_backward(cb, *this, module); });
      detail::module_hook::on_after_backward(module, ctx);

      if (steps) {
        precision_.unscale_gradients(optimizer);
        each_callback([&](auto& cb) { detail::callback_hook::on_before_optimizer_step(cb, *this, module, optimizer); });
        detail::module_hook::on_before_optimizer_step(module, ctx, optimizer);
        clip_gradients();
        precision_.optimizer_step(optimizer);
        ++state_.global_step;
        if (optim_.scheduler && optim_.interval == Interval::step && state_.global_step % optim_.frequency == 0) {
          optim_.scheduler->step();
        }
      }
    }

    const torch::Tensor detached = loss.defined() ? loss.detach() : loss;
    each_callback([&](auto& cb) { detail::callback_hook::on_train_batch_end(cb, *this, module, detached, batch, batch_idx); });
    detail::module_hook::on_train_batch_end(module, ctx, detached, batch, batch_idx);
    leave_batch();

    publish_step(train_store_);
    if constexpr (has_loggers()) {
      if (steps && (state_.global_step % options_.log_every_n_steps == 0 || should_stop_)) {
        send_to_loggers(pending_log_);
      } else {
        pending_log_.clear();
      }
    }

    if (should_check_val(batch_idx, is_last)) {
      val_started_ = true;
      run_validation(module, val);
    }
    ++total_batch_idx_;
    if (max_steps_reached()) return false;
    return !(should_stop_ && can_stop_early());
  }

  void strategy_teardown() {
    if constexpr (requires { strategy_.teardown(); }) strategy_.teardown();
  }

  void clip_gradients() {
    if (!options_.gradient_clip_val || *options_.gradient_clip_val <= 0.0) return;
    if (options_.gradient_clip_algorithm == ClipAlgorithm::norm) {
      torch::nn::utils::clip_grad_norm_(params_, *options_.gradient_clip_val);
    } else {
      torch::nn::utils::clip_grad_value_(params_, *options_.gradient_clip_val);
    }
  }

  // ---- evaluation -------------------------------------------------------------------------------------

  /// Runs validation (or the sanity check, or test) over `limit` batches of `loader`, hooks included.
  template <class Impl, class L>
  void run_eval_loop(Impl& module, L& loader, Stage stage, int64_t limit) {
    const Stage previous = state_.stage;
    state_.stage = stage;
    eval_store_.clear();
    num_eval_batches_ = limit;
    Context ctx(state_, eval_store_);
    const bool was_training = module.is_training();
    module.eval();
    {
      detail::EvalGradGuard no_grad(options_.inference_mode);
      if (stage == Stage::test) {
        eval_hooks_test(module, ctx, loader, limit);
      } else {
        eval_hooks_validate(module, ctx, loader, limit, stage);
      }
    }
    if (was_training) module.train();
    state_.stage = previous;
  }

  template <class Impl, class L>
  void eval_hooks_validate(Impl& module, Context& ctx, L& loader, int64_t limit, Stage stage) {
    each_callback([&](auto& cb) { detail::callback_hook::on_validation_start(cb, *this, module); });
    detail::module_hook::on_validation_start(module, ctx);
    each_callback([&](auto& cb) { detail::callback_hook::on_validation_epoch_start(cb, *this, module); });
    detail::module_hook::on_validation_epoch_start(module, ctx);
    detail::for_each_batch(loader, limit, [&](auto&& batch, int64_t idx, bool) {
      enter_batch(batch, idx);
      each_callback([&](auto& cb) { detail::callback_hook::on_validation_batch_start(cb, *this, module, batch, idx); });
      detail::module_hook::on_validation_batch_start(module, ctx, batch, idx);
      auto out = run_step(batch, [&](auto& b) { return module.validation_step(b, ctx); });
      each_callback([&](auto& cb) { detail::callback_hook::on_validation_batch_end(cb, *this, module, out, batch, idx); });
      detail::module_hook::on_validation_batch_end(module, ctx, out, batch, idx);
      leave_batch();
      return true;
    });
    each_callback([&](auto& cb) { detail::callback_hook::on_validation_epoch_end(cb, *this, module); });
    detail::module_hook::on_validation_epoch_end(module, ctx);
    if (stage != Stage::sanity_check) {  // the sanity check's values are thrown away, as in Lightning
      std::map<std::string, torch::Tensor> to_log;
      publish_epoch(eval_store_, &to_log);
      send_to_loggers(to_log);
    }
    each_callback([&](auto& cb) { detail::callback_hook::on_validation_end(cb, *this, module); });
    detail::module_hook::on_validation_end(module, ctx);
  }

  template <class Impl, class L>
  void eval_hooks_test(Impl& module, Context& ctx, L& loader, int64_t limit) {
    if constexpr (requires(detail::batch_t<L>& b) { module.test_step(b, ctx); }) {
      each_callback([&](auto& cb) { detail::callback_hook::on_test_start(cb, *this, module); });
      detail::module_hook::on_test_start(module, ctx);
      each_callback([&](auto& cb) { detail::callback_hook::on_test_epoch_start(cb, *this, module); });
      detail::module_hook::on_test_epoch_start(module, ctx);
      detail::for_each_batch(loader, limit, [&](auto&& batch, int64_t idx, bool) {
        enter_batch(batch, idx);
        each_callback([&](auto& cb) { detail::callback_hook::on_test_batch_start(cb, *this, module, batch, idx); });
        detail::module_hook::on_test_batch_start(module, ctx, batch, idx);
        auto out = run_step(batch, [&](auto& b) { return module.test_step(b, ctx); });
        each_callback([&](auto& cb) { detail::callback_hook::on_test_batch_end(cb, *this, module, out, batch, idx); });
        detail::module_hook::on_test_batch_end(module, ctx, out, batch, idx);
        leave_batch();
        return true;
      });
      each_callback([&](auto& cb) { detail::callback_hook::on_test_epoch_end(cb, *this, module); });
      detail::module_hook::on_test_epoch_end(module, ctx);
      std::map<std::string, torch::Tensor> to_log;
      publish_epoch(eval_store_, &to_log);
      send_to_loggers(to_log);
      each_callback([&](auto& cb) { detail::callback_hook::on_test_end(cb, *this, module); });
      detail::module_hook::on_test_end(module, ctx);
    }
  }

  /// Runs an evaluation step under the precision's forward context; a void step yields an undefined tensor.
  template <class B, class F>
  auto run_step(B& batch, F&& step) {
    return with_prepared(batch, [&](auto& b) {
      [[maybe_unused]] auto guard = precision_.forward_context(A::device_type);
      if constexpr (std::is_void_v<decltype(step(b))>) {
        step(b);
        return torch::Tensor();
      } else {
        return step(b);
      }
    });
  }

  /// A fresh loop state that keeps the epoch and step counters of earlier runs (as Lightning's Trainer).
  void reset_state_keeping_progress() {
    const int64_t epoch = state_.current_epoch, step = state_.global_step;
    state_ = detail::LoopState{};
    state_.current_epoch = epoch;
    state_.global_step = step;
  }

  template <class Impl, class L>
  std::map<std::string, double> run_standalone_eval(Impl& module, L& loader, Stage stage) {
    reset_state_keeping_progress();
    callback_metrics_.clear();
    progress_bar_metrics_.clear();
    logged_metrics_.clear();
    setup_run(module);
    decltype(auto) processed = strategy_.process_dataloader(loader, stage);
    const Limit& limit = stage == Stage::test ? options_.limit_test_batches : options_.limit_val_batches;
    const int64_t n = limit.resolve(detail::loader_size(processed), stage == Stage::test ? "limit_test_batches"
                                                                                          : "limit_val_batches");
    Context ctx(state_, eval_store_);
    try {
      each_callback([&](auto& cb) { detail::callback_hook::setup(cb, *this, module, stage); });
      detail::module_hook::setup(module, ctx, stage);
      run_eval_loop(module, processed, stage, n);
      each_callback([&](auto& cb) { detail::callback_hook::teardown(cb, *this, module, stage); });
      detail::module_hook::teardown(module, ctx, stage);
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      each_callback([&](auto& cb) { detail::callback_hook::on_exception(cb, *this, module, error); });
      leave_batch();
      throw;
    }
    return callback_metric_values();
  }

  template <class R, class Impl, class L>
  std::vector<R> run_predict(Impl& module, L& loader) {
    reset_state_keeping_progress();
    setup_run(module);
    state_.stage = Stage::predict;
    decltype(auto) processed = strategy_.process_dataloader(loader, Stage::predict);
    const int64_t n = options_.limit_predict_batches.resolve(detail::loader_size(processed), "limit_predict_batches");
    num_eval_batches_ = n;
    Context ctx(state_, eval_store_);
    std::vector<R> results;
    if (n > 0) results.reserve(static_cast<std::size_t>(n));
    const bool was_training = module.is_training();
    module.eval();
    {
      detail::EvalGradGuard no_grad(options_.inference_mode);
      each_callback([&](auto& cb) { detail::callback_hook::setup(cb, *this, module, Stage::predict); });
      detail::module_hook::setup(module, ctx, Stage::predict);
      each_callback([&](auto& cb) { detail::callback_hook::on_predict_start(cb, *this, module); });
      detail::module_hook::on_predict_start(module, ctx);
      each_callback([&](auto& cb) { detail::callback_hook::on_predict_epoch_start(cb, *this, module); });
      detail::module_hook::on_predict_epoch_start(module, ctx);
      detail::for_each_batch(processed, n, [&](auto&& batch, int64_t idx, bool) {
        enter_batch(batch, idx);
        each_callback([&](auto& cb) { detail::callback_hook::on_predict_batch_start(cb, *this, module, batch, idx); });
        detail::module_hook::on_predict_batch_start(module, ctx, batch, idx);
        results.push_back(run_step(batch, [&](auto& b) { return module.predict_step(b, ctx); }));
        each_callback([&](auto& cb) { detail::callback_hook::on_predict_batch_end(cb, *this, module, results.back(), batch, idx); });
        detail::module_hook::on_predict_batch_end(module, ctx, results.back(), batch, idx);
        leave_batch();
        return true;
      });
      each_callback([&](auto& cb) { detail::callback_hook::on_predict_epoch_end(cb, *this, module); });
      detail::module_hook::on_predict_epoch_end(module, ctx);
      each_callback([&](auto& cb) { detail::callback_hook::on_predict_end(cb, *this, module); });
      detail::module_hook::on_predict_end(module, ctx);
      each_callback([&](auto& cb) { detail::callback_hook::teardown(cb, *this, module, Stage::predict); });
      detail::module_hook::teardown(module, ctx, Stage::predict);
    }
    if (was_training) module.train();
    return results;
  }

  TrainerOptions options_;
  std::tuple<Callbacks...> callbacks_;
  strategy_type strategy_;
  P precision_;
  detail::StrategyCollectives<strategy_type> collectives_{nullptr};

  detail::LoopState state_;
  detail::MetricStore train_store_;
  detail::MetricStore eval_store_;
  std::map<std::string, torch::Tensor> callback_metrics_;
  std::map<std::string, torch::Tensor> progress_bar_metrics_;
  std::map<std::string, torch::Tensor> logged_metrics_;
  std::map<std::string, torch::Tensor> pending_log_;

  OptimizerConfig optim_;
  std::vector<torch::Tensor> params_;
  int64_t max_epochs_ = 1000;
  int64_t num_training_batches_ = -1;
  int64_t num_val_batches_ = 0;
  int64_t num_eval_batches_ = 0;
  int64_t val_check_batch_ = -1;
  int64_t total_batch_idx_ = 0;
  bool should_stop_ = false;

  // Checkpoints and resuming.
  struct Resume {
    int64_t batch_in_epoch = 0;
    bool epoch_finished = false;
    bool val_pending = false;
    bool loader_positioned = false;
    int world_size = 1;
    std::vector<at::Tensor> rng;
  };
  std::optional<Resume> resume_;
  torch::nn::Module* module_ = nullptr;
  std::function<data::LoaderState()> train_loader_state_;
  std::function<void(checkpoint::Dict&)> module_save_hook_;
  std::optional<data::LoaderState> final_loader_state_;  // the training loader's position when the last fit ended
  bool fitting_ = false;
  bool in_train_batch_ = false;
  bool in_epoch_end_ = false;
  bool train_is_last_ = false;
  bool mid_window_ = false;  // the running batch does not end its gradient-accumulation window
  bool val_started_ = false;
  int64_t train_batch_idx_ = 0;
  int64_t batches_this_epoch_ = 0;
};

/// Builds a Trainer whose callback pack is deduced from the arguments:
/// `auto trainer = volt::make_trainer<volt::SingleDevice, volt::Bf16, volt::CPU>({.max_epochs = 3}, volt::ProgressBar{});`
template <class S = SingleDevice, class P = Fp32, class A = CPU, class... Callbacks>
Trainer<S, P, A, std::remove_cvref_t<Callbacks>...> make_trainer(TrainerOptions options = {}, Callbacks&&... callbacks) {
  return Trainer<S, P, A, std::remove_cvref_t<Callbacks>...>(std::move(options), std::forward<Callbacks>(callbacks)...);
}

}  // namespace volt
