#pragma once
/// \file
/// Part of volt/trainer.hpp, included at its end (ensmallen's `_impl` pattern): what every run shares —
/// fast_dev_run, the set-up of a run, the batch a step sees, the hook fan-out, and handing metrics to loggers.
/// Not a header of its own: include volt/trainer.hpp.

#include "volt/comm/watchdog.hpp"
#include "volt/model_plan.hpp"

#include <ATen/Context.h>
#include <c10/core/InferenceMode.h>
#include <torch/utils.h>

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <typeinfo>

namespace volt {
namespace detail {

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

/// The first run of this process (a fit, or a validate, test or predict before any) says what makes accelerator `A`
/// on this host much slower than it should be (its optional `slow_settings`: accelerators/concept.hpp), from the
/// host's first rank only, naming the host when the job spans several.
inline std::atomic<bool> said_slow_settings{false};  ///< once per process, whatever the Trainer types
template <class A>
void say_slow_settings_once(int local_rank, int ranks_on_host, bool several_hosts) {
  if constexpr (requires { A::slow_settings(1); }) {
    if (local_rank != 0 || said_slow_settings.exchange(true)) return;
    std::string who = "volt: ";
    if (several_hosts) {
      char host[256] = {};
      ::gethostname(host, sizeof(host) - 1);
      who = std::string("volt (") + host + "): ";
    }
    for (const std::string& sentence : A::slow_settings(ranks_on_host)) std::cerr << who << sentence << "\n";
    std::cerr << std::flush;
  }
}

}  // namespace detail

/// Phase (b) on this machine: the accelerator is there with enough devices, and the strategy can use them.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::check_machine() {
  using Acc = accelerator_type;
  if (!Acc::is_available()) {
    throw ConfigError(std::string("volt: ") + Acc::name + " requested (devices=" + std::to_string(options_.devices) +
                      ") but it is not available here: " + Acc::name + "::device_count() is " +
                      std::to_string(Acc::device_count()) +
                      ". Check the driver and visible devices (CUDA_VISIBLE_DEVICES), or use the CPU accelerator.");
  }
  if (options_.devices > Acc::device_count()) {
    throw ConfigError(std::string("volt: devices=") + std::to_string(options_.devices) + " but " + Acc::name +
                      "::device_count() is " + std::to_string(Acc::device_count()) + " here. Ask for at most " +
                      std::to_string(Acc::device_count()) + ".");
  }
  strategy_.check_devices(options_, Acc::device_count(), Acc::name);
  if (detail::captures_step<Acc> && options_.detect_anomaly) {
    throw ConfigError("volt: detect_anomaly=true with graph mode (Graphed<...>) is not allowed: anomaly mode reads every "
                      "gradient on the host, which a captured step cannot. Look for the NaN with the accelerator "
                      "without Graphed.");
  }
}

/// fast_dev_run's and overfit_batches' overrides, as Lightning's; then max_epochs in effect.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::apply_fast_dev_run() {
  if (overfits()) options_.limit_train_batches = options_.limit_val_batches = options_.overfit_batches;
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

/// Phase (c): seeds, determinism, the strategy's environment (and what would make it slow, said once), the module's
/// placement, its plan of parts (configure_model: ModelParallel lays them out, the other strategies read nothing of
/// it) and precision.
template <class S, class P, class A, class... Cs>
template <class Impl>
void Trainer<S, P, A, Cs...>::setup_run(Impl& module) {
  hparams_.effective = detail::effective_hyper_parameters(hparams_.given, module);  // before any callback's setup
  if (options_.seed) torch::manual_seed(*options_.seed);
  if (options_.deterministic) {
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  }
  if (options_.benchmark) at::globalContext().setBenchmarkCuDNN(*options_.benchmark);
  strategy_.setup_environment(accelerator_type::device(strategy_.local_rank()));
  detail::say_slow_settings_once<accelerator_type>(
      strategy_.local_rank(), std::max(1, strategy_.world_size() / options_.num_nodes), options_.num_nodes > 1);
  state_.device = strategy_.root_device();
  state_.global_rank = strategy_.global_rank();
  state_.world_size = strategy_.world_size();
  collectives_ = detail::StrategyCollectives<strategy_type>(&strategy_);
  state_.collectives = &collectives_;
  strategy_.setup_module(module);
  ModelPlan plan;
  Context ctx(state_, train_store_);
  hook<detail::hooks::configure_model>(module, ctx, plan);
  if constexpr (declares_role<strategy_type, role::plans_parts>) strategy_.apply_plan(module, plan);
  strategy_.set_compute_dtype(detail::compute_dtype_of<precision_type>);
  precision_.convert_module(module);
}

template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::save_hyperparameters(Json hparams) {
  if (!hparams.is_object()) {
    throw ConfigError("volt: save_hyperparameters takes a JSON object of names and values (Config::json()); got " +
                      config::shown(hparams) + " (" + config::kind_of(hparams) + ").");
  }
  hparams_.given = hparams_.effective = std::move(hparams);
}

template <class S, class P, class A, class... Cs>
std::vector<torch::optim::Optimizer*> Trainer<S, P, A, Cs...>::optimizers() {
  std::vector<torch::optim::Optimizer*> out;
  for (auto& o : optim_) out.push_back(o.config.optimizer.get());
  return out;
}

/// A fresh loop state that keeps the epoch and step counters of earlier runs (as Lightning's Trainer).
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::reset_state_keeping_progress() {
  const int64_t epoch = state_.current_epoch, step = state_.global_step;
  state_ = detail::LoopState{};
  state_.current_epoch = epoch;
  state_.global_step = step;
}

/// The batch Context::log sizes values by, until leave_batch.
template <class S, class P, class A, class... Cs>
template <class B>
void Trainer<S, P, A, Cs...>::enter_batch(const B& batch, int64_t batch_idx) {
  state_.batch_idx = batch_idx;
  detail::collective_tag().step = state_.global_step;  // the collectives' flight record names the step
  state_.in_batch = true;
  state_.batch = &batch;
  state_.batch_size_of = &detail::batch_size_of<B>;
  state_.batch_type = &typeid(B);
}
/// Runs the body of a run (fit, validate, test, predict); when it throws (a failure, or a stop signal after its
/// checkpoint), every callback's on_exception hears of it, the batch is left and `cleanup(error)` runs (errors inside
/// it are dropped: the run's own error says more), then the error goes on. Either way the loggers flush and are told
/// how the run ended (loggers/concept.hpp).
template <class S, class P, class A, class... Cs>
template <class Impl, class Body, class Cleanup>
void Trainer<S, P, A, Cs...>::guarded(Impl& module, Body&& body, Cleanup&& cleanup) {
  try {
    body();
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    try {
      detail::call_callbacks<detail::hooks::on_exception>(callbacks_, *this, module, error);
    } catch (...) {  // a callback that fails here loses nothing of the run's own error
    }
    leave_batch();
    try {
      cleanup(error);
    } catch (...) {
    }
    try {
      flush_loggers();
      detail::finalize_loggers(callbacks_, strategy_.is_global_zero(), detail::run_status(error));
    } catch (...) {  // likewise a logger's last write
    }
    throw;
  }
  flush_loggers();
  detail::finalize_loggers(callbacks_, strategy_.is_global_zero(), RunStatus::finished);
}

/// The batch is over: Context::log no longer sizes values by it.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::leave_batch() {
  state_.in_batch = false;
  state_.batch = nullptr;
}

/// Runs an evaluation step under the precision's forward context; a void step yields an undefined tensor.
template <class S, class P, class A, class... Cs>
template <class B, class F>
auto Trainer<S, P, A, Cs...>::run_eval_step(B& batch, F&& step) {
  return detail::with_device_batch<accelerator_type, precision_type>(batch, state_.device, [&](auto& b) {
    [[maybe_unused]] auto guard = precision_.forward_context(accelerator_type::device_type);
    if constexpr (std::is_void_v<decltype(step(b))>) {
      step(b);
      return torch::Tensor();
    } else {
      return step(b);
    }
  });
}

/// Hook `H` on every callback in pack order, then on the module (loops/hooks.hpp).
template <class S, class P, class A, class... Cs>
template <class H, class Impl, class... Args>
decltype(auto) Trainer<S, P, A, Cs...>::hook(Impl& module, Context& ctx, Args&&... args) {
  return detail::call_hook<H>(callbacks_, *this, module, ctx, std::forward<Args>(args)...);
}

/// Hands metrics to every logger (with the epoch, as Lightning adds it) on rank zero, and clears them everywhere.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::send_to_loggers(detail::MetricMap& metrics) {
  if constexpr (has_loggers()) {
    if (metrics.empty()) return;
    auto values = detail::to_doubles(metrics);
    values["epoch"] = static_cast<double>(state_.current_epoch);
    detail::log_metrics(callbacks_, strategy_.is_global_zero(), values, progress_.logging_step());
  }
  metrics.clear();
}

/// Every logger with a `flush()` writes what it holds, on rank zero (loggers/concept.hpp says when).
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::flush_loggers() {
  detail::flush_loggers(callbacks_, strategy_.is_global_zero());
}

/// See the declaration: callback_metrics (and the progress bar) now, loggers at once.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::record_metrics(const std::map<std::string, double>& values, bool prog_bar, bool logger) {
  detail::MetricMap now;
  for (const auto& [name, value] : values) {
    const torch::Tensor v = torch::scalar_tensor(value, torch::kFloat64);
    logger_.record(name, v, prog_bar, logger);
    now.emplace(name, v);
  }
  if (logger) send_to_loggers(now);
}

/// The first non-empty best_model_path() among the callbacks that have one (callbacks/concept.hpp).
template <class S, class P, class A, class... Cs>
std::string Trainer<S, P, A, Cs...>::best_model_path() const {
  return detail::first_answer<std::string>(
      callbacks_, [](const auto& c) requires requires { c.best_model_path(); } { return c.best_model_path(); });
}

}  // namespace volt
