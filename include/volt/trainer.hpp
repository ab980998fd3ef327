#pragma once
/// \file
/// `volt::Trainer<Strategy, Precision, Accelerator, Callbacks...>`: runs a module's training, validation,
/// test and prediction loops the way Lightning's Trainer does. It only orchestrates: it calls the same members
/// on whatever policies it holds (each kind's concept.hpp lists them) and never asks which ones they are.
///
/// This file holds the rules (phase (a), volt/rules.hpp), the constructor (phase (b)), the four runs, what
/// callbacks and callers may read, and the members grouped by owner. The loops are out-of-class definitions,
/// included at the end (ensmallen's `_impl` files): trainer/run_impl.hpp (what every run shares),
/// trainer/fit_loop_impl.hpp (the fit and its training batches), trainer/evaluation_loop_impl.hpp, and
/// trainer/checkpoint_impl.hpp (saving and resuming; the format is connectors/checkpoint_connector.hpp). A
/// training batch's optimization is one of three step objects the fit loop owns: loops/automatic_step.hpp,
/// loops/graphed_step.hpp (graph mode) and loops/manual_step.hpp (manual optimization); they see the Trainer through
/// the bundle of loops/step_parts.hpp only.

#include "volt/accelerators/cpu.hpp"
#include "volt/accelerators/graphed.hpp"
#include "volt/batch.hpp"
#include "volt/callbacks/concept.hpp"
#include "volt/checkpoint.hpp"
#include "volt/cluster/signals.hpp"
#include "volt/connectors/checkpoint_connector.hpp"
#include "volt/connectors/hyper_parameters.hpp"
#include "volt/connectors/logger_connector.hpp"
#include "volt/context.hpp"
#include "volt/data/concept.hpp"
#include "volt/detail/fit_transfer.hpp"
#include "volt/detail/torch_compat.hpp"
#include "volt/errors.hpp"
#include "volt/loggers/concept.hpp"
#include "volt/loops/automatic_step.hpp"
#include "volt/loops/batches.hpp"
#include "volt/loops/evaluation.hpp"
#include "volt/loops/graphed_step.hpp"
#include "volt/loops/hooks.hpp"
#include "volt/loops/manual_step.hpp"
#include "volt/loops/optimization.hpp"
#include "volt/loops/progress.hpp"
#include "volt/module.hpp"
#include "volt/options.hpp"
#include "volt/precision/fp32.hpp"
#include "volt/rules.hpp"
#include "volt/strategies/single_device.hpp"

#include <torch/types.h>

#include <concepts>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

template <class S = SingleDevice, class P = Fp32, class A = CPU, class... Callbacks>
class Trainer {
  using checked_ = detail::CheckedSlots<S, P, A>;  // phase (a): each slot its kind, then the rules between slots (rules.hpp)
  static_assert((Callback<Callbacks> && ...), "volt: every callback must be a movable object type.");
  static_assert((detail::check_logger<Callbacks>() && ...));  // a logger's hooks take what volt passes (loggers/concept.hpp)

 public:
  /// The strategy as it runs on this accelerator (DDP<Spawn> with its backend resolved).
  using strategy_type = typename checked_::strategy;
  static_assert(detail::check_strategy_roles<strategy_type>());  // its optional roles (strategies/concept.hpp)
  using precision_type = typename checked_::precision;
  using accelerator_type = typename checked_::accelerator;
  using callback_tuple = std::tuple<Callbacks...>;

  /// Checks every run-time setting against what is allowed and what this machine has (phase (b)); sets up
  /// nothing else until a run starts (phase (c)).
  explicit Trainer(TrainerOptions options = {}, Callbacks... callbacks)
      : options_(std::move(options)), callbacks_(std::move(callbacks)...) {
    validate_options(options_);
    check_machine();
    apply_fast_dev_run();
  }
  /// Callbacks whose types are not the Trainer's callback types: said at compile time, with the fix.
  template <class... Given>
    requires(sizeof...(Given) > 0 && !std::is_same_v<std::tuple<std::remove_cvref_t<Given>...>, std::tuple<Callbacks...>>)
  explicit Trainer(TrainerOptions, Given&&...) {
    static_assert(detail::dependent_false<std::tuple<Given...>>,
                  "volt: build the Trainer with volt::make_trainer<Strategy, Precision, Accelerator>(options, "
                  "callbacks...), which puts the callbacks' types into its type, or list them after the accelerator "
                  "in the order given (Trainer<S, P, A, volt::ProgressBar, volt::CSVLogger>): the callbacks given are "
                  "not the Trainer's callback types.");
  }

  // ---- runs -------------------------------------------------------------------------------------------

  /// Trains `module` on `train_loader`, validating on `val_loader` as the options say. With `ckpt_path`,
  /// resumes from a checkpoint: a file, `"last"` (the newest a ModelCheckpoint wrote; a fresh start when
  /// there is none yet) or `"best"` (its best). Everything the checkpoint holds is restored — weights,
  /// optimizer, scheduler, precision, counters, the training loader's position, metric sums, generators,
  /// callbacks — so the fit goes on as if it had never stopped. Without a validation loader, give the path
  /// third: `fit(module, train, "last")` (or pass `volt::NoLoader{}` before it).
  template <class M, class TrainLoader, class ValLoader = NoLoader>
    requires(!std::convertible_to<ValLoader, std::string>)
  FitResult fit(M& module, TrainLoader&& train_loader, ValLoader&& val_loader = {}, std::string ckpt_path = {}) {
    constexpr bool has_val = !std::is_same_v<std::remove_cvref_t<ValLoader>, NoLoader>;
    using ValBatch = typename std::conditional_t<has_val, detail::batch_of<std::remove_cvref_t<ValLoader>>,
                                                 std::type_identity<void>>::type;
    if constexpr (!detail::CheckedFit<M, detail::batch_t<TrainLoader>, ValBatch, strategy_type>::ok) {
      return {};  // the broken rule has been said, alone
    } else {
      if constexpr (detail::captures_step<accelerator_type>) (void)detail::CheckedGraphRules<Trainer, module_impl_t<M>>::ok;
      if constexpr (manual_optimization<M>) check_manual_options();
      auto body = [&]() -> FitResult {
        auto& impl = detail::unwrap(module);
        auto& train = detail::deref_loader(train_loader);
        if constexpr (has_val) {
          run_fit(impl, train, &detail::deref_loader(val_loader), ckpt_path);
        } else {
          run_fit(impl, train, static_cast<NoLoader*>(nullptr), ckpt_path);
        }
        return FitResult{callback_metric_values(), best_model_path()};
      };
      detail::FitTransfer<module_impl_t<M>> transfer{&detail::unwrap(module), &state_.current_epoch, &state_.global_step};
      try {
        return strategy_.launch(body, transfer);
      } catch (const Interrupted& stop) {  // a stop signal: the checkpoint is written (SignalOptions)
        if (!options_.signals.exit_process) throw;
        std::fflush(nullptr);
        std::exit(stop.exit_status());
      }
    }
  }
  /// Resumes a fit without validation from `ckpt_path` (a file, `"last"` or `"best"`).
  template <class M, class TrainLoader>
  FitResult fit(M& module, TrainLoader&& train_loader, std::string ckpt_path) {
    return fit(module, std::forward<TrainLoader>(train_loader), NoLoader{}, std::move(ckpt_path));
  }

  /// One validation run; returns its epoch metrics. With `ckpt_path` (a file, `"best"` or `"last"`, found as `fit`
  /// finds them), the checkpoint's weights are loaded into the module first, after its on_load_checkpoint saw the
  /// file, as Lightning's; nothing else of the file is taken. Empty: the module as it is.
  template <class M, class Loader>
  std::map<std::string, double> validate(M& module, Loader&& loader, const std::string& ckpt_path = {});
  /// One test run; returns its epoch metrics. `ckpt_path` as validate's.
  template <class M, class Loader>
  std::map<std::string, double> test(M& module, Loader&& loader, const std::string& ckpt_path = {});

  /// Runs predict_step on every batch (up to limit_predict_batches) and returns the results in order (across
  /// ranks: gathered, data/predict_gather.hpp); `return_predictions = false` keeps none (a PredictionWriter writes them).
  /// `ckpt_path` as validate's; `predict(module, loader, "best")` also works.
  template <class M, class Loader>
  auto predict(M& module, Loader&& loader, bool return_predictions = true, const std::string& ckpt_path = {}) {
    static_assert(!data::is_loaders_v<std::remove_cvref_t<Loader>>, "volt: predict takes one loader: call it once per "
                  "loader (several loaders, data::loaders, are for validate and test).");
    using Batch = detail::batch_t<Loader>;
    static_assert(requires(module_impl_t<M>& m, Batch& b, Context& c) { m.predict_step(b, c); },
                  "volt: predict needs the module's predict_step(const Batch&, volt::Context&) returning a result "
                  "for this loader's batches.");
    using R = std::remove_cvref_t<decltype(std::declval<module_impl_t<M>&>().predict_step(
        std::declval<Batch&>(), std::declval<Context&>()))>;
    return strategy_.launch([&] {
      return run_predict<R>(detail::unwrap(module), detail::deref_loader(loader), return_predictions, ckpt_path);
    });
  }
  template <class M, class Loader, class Path>
    requires std::convertible_to<Path, std::string> && (!std::same_as<std::remove_cvref_t<Path>, bool>)
  auto predict(M& module, Loader&& loader, Path&& ckpt_path) {
    return predict(module, std::forward<Loader>(loader), true, std::string(std::forward<Path>(ckpt_path)));
  }

  // ---- what callbacks and callers read (callbacks/concept.hpp lists it for callback authors) --------

  /// The options in effect (fast_dev_run applied).
  const TrainerOptions& options() const { return options_; }
  /// Completed training epochs (the index of the running one while training).
  int64_t current_epoch() const { return state_.current_epoch; }
  /// Optimizer steps taken.
  int64_t global_step() const { return state_.global_step; }
  /// The batch index within the running loop.
  int64_t batch_idx() const { return state_.batch_idx; }
  /// Which of several evaluation loaders (`data::loaders`) the running batch comes from (0 with one loader).
  int64_t dataloader_idx() const { return state_.dataloader_idx; }
  /// The data set indices of the batch `predict` is at (undefined where its loader cannot tell).
  torch::Tensor batch_indices() const { return batch_indices_ ? batch_indices_(state_.batch_idx) : torch::Tensor(); }
  /// In on_train_batch_end: the batch stepped and its metrics go to loggers (every log_every_n_steps), so a monitor
  /// that records values (ThroughputMonitor) records them now.
  bool logs_this_batch() const { return progress_.log_due; }
  /// The step loggers file values under now (Lightning's `_batches_that_stepped` when it logs; loops/progress.hpp).
  int64_t logging_step() const { return progress_.logging_step(); }
  /// The running loop (train, sanity_check, validate, test, predict).
  Stage stage() const { return state_.stage; }
  /// Whether the short validation run before training is running.
  bool sanity_checking() const { return state_.stage == Stage::sanity_check; }
  /// Whether this process is rank zero (the one that writes files and prints).
  bool is_global_zero() const { return strategy_.is_global_zero(); }
  /// max_epochs in effect (-1: until max_steps).
  int64_t max_epochs() const { return max_epochs_; }
  /// Optimizer steps after which the fit stops (-1: no limit).
  int64_t max_steps() const { return options_.max_steps; }
  /// Training batches per epoch (-1: until the loader ends).
  int64_t num_training_batches() const { return num_training_batches_; }
  /// Batches of the running (or last) evaluation loader's run (of the running one of several; -1: until it ends).
  int64_t num_eval_batches() const { return num_eval_batches_; }
  /// Whether fast_dev_run's short run is in effect (callbacks that write files skip it).
  bool fast_dev_run() const { return options_.fast_dev_run > 0; }
  /// Whether overfit_batches is in effect (the same batches every epoch).
  bool overfits() const { return !options_.overfit_batches.is_zero(); }
  /// Whether a fit is running (callbacks that act only while fitting ask).
  bool fitting() const { return fitting_; }
  /// Whether the running (or last) fit validates at all.
  bool has_validation() const { return num_val_batches_ != 0; }
  /// Whether a validation run of the running (or last) fit has ended (the sanity check does not count).
  bool validation_has_run() const { return progress_.validated; }
  /// The checkpoint the running (or last) fit resumed from ("" when it started afresh).
  const std::string& ckpt_path() const { return ckpt_path_; }

  /// Writes a checkpoint of the running (or last) fit to `path` (volt/checkpoint.hpp says what it holds); every rank
  /// calls it (each gives its generator states), rank zero writes atomically, all wait. `weights_only`: weights only.
  void save_checkpoint(const std::string& path, bool weights_only = false) {
    save_checkpoint({path}, SaveOptions{weights_only});
  }
  /// The same state to each of `paths`. `.async_save`: returns once it is copied to host memory and writes on a
  /// thread, one save in flight (the next save, a stop and the fit's end wait for it; `wait_for_checkpoint` too).
  void save_checkpoint(const std::vector<std::string>& paths, const SaveOptions& options);
  void wait_for_checkpoint() { writer_.wait(); }

  /// Keeps `hparams` (a JSON object, as `Config::json()`) as the hyper-parameters, with the module's own added
  /// (`hyper_parameters()`), for every checkpoint and the loggers' folders (volt/connectors/hyper_parameters.hpp).
  void save_hyperparameters(Json hparams);
  const Json& hyper_parameters() const { return hparams_.effective; }  ///< in the running (or last) run
  /// Asks the training loop to stop (honoured once min_epochs and min_steps are met).
  void request_stop() { progress_.should_stop = true; }
  /// Whether a stop was asked for.
  bool should_stop() const { return progress_.should_stop; }

  /// The latest value of every logged name (step values and epoch values), as Lightning's `callback_metrics`.
  const std::map<std::string, torch::Tensor>& callback_metrics() const { return logger_.callback_metrics(); }
  /// The latest values logged with prog_bar.
  const std::map<std::string, torch::Tensor>& progress_bar_metrics() const { return logger_.progress_bar_metrics(); }
  /// The latest values logged for loggers (logger = true).
  const std::map<std::string, torch::Tensor>& logged_metrics() const { return logger_.logged_metrics(); }
  /// `callback_metrics` as numbers (reads device values).
  std::map<std::string, double> callback_metric_values() const { return detail::to_doubles(logger_.callback_metrics()); }
  /// Records a value from outside a module step (a callback's own measurement, such as a learning rate):
  /// it joins callback_metrics (and the progress bar), and loggers receive it now.
  void record_metric(const std::string& name, double value, bool prog_bar = false, bool logger = true) {
    record_metrics({{name, value}}, prog_bar, logger);
  }
  /// Several values at once: loggers receive them as one logging event (one CSV row).
  void record_metrics(const std::map<std::string, double>& values, bool prog_bar = false, bool logger = true);

  /// The (first) optimizer and scheduler of the running (or last) fit; null before.
  torch::optim::Optimizer* optimizer() { return optim_.empty() ? nullptr : optim_[0].config.optimizer.get(); }
  torch::optim::LRScheduler* lr_scheduler() { return optim_.empty() ? nullptr : optim_[0].config.scheduler.get(); }
  /// Every optimizer of the running (or last) fit, in configure_optimizers' order (several: manual optimization).
  std::vector<torch::optim::Optimizer*> optimizers();

  /// The strategy object (DDP's bucket settings, ranks).
  strategy_type& strategy() { return strategy_; }
  const strategy_type& strategy() const { return strategy_; }
  /// The precision object (Fp16Mixed's loss scale).
  precision_type& precision() { return precision_; }
  const precision_type& precision() const { return precision_; }
  /// The callback of type `C` (the first, if the pack has several).
  template <class C>
  C& callback() { return std::get<C>(callbacks_); }
  /// Every callback, in pack order.
  std::tuple<Callbacks...>& callbacks() { return callbacks_; }

  /// The best checkpoint a callback recorded ("" when none does).
  std::string best_model_path() const;

 private:
  // ---- shared by every run (trainer/run_impl.hpp) ----
  void check_machine();
  void apply_fast_dev_run();
  template <class Impl> void setup_run(Impl& module);  // (a configure_model hook takes the module's type)
  void reset_state_keeping_progress();
  template <class B>
  void enter_batch(const B& batch, int64_t batch_idx);
  void leave_batch();
  template <class Impl, class Body, class Cleanup>
  void guarded(Impl& module, Body&& body, Cleanup&& cleanup);
  template <class B, class F>
  auto run_eval_step(B& batch, F&& step);
  template <class H, class Impl, class... Args>
  decltype(auto) hook(Impl& module, Context& ctx, Args&&... args);
  static constexpr bool has_loggers() { return (Logger<Callbacks> || ... || false); }
  void send_to_loggers(detail::MetricMap& metrics);
  void flush_loggers();

  // ---- fit (trainer/fit_loop_impl.hpp) ----
  template <class Impl, class TL, class VL>
  void run_fit(Impl& module, TL& train, VL* val, const std::string& ckpt_path);
  template <class Impl, class TL, class VL>
  void fit_loop(Impl& module, Context& ctx, TL& train, VL* val, std::optional<detail::ResumePoint> resume);
  template <class Impl, class Step, class TL, class VL>
  void train_epoch(Impl& module, Context& ctx, Step& step, TL& train, VL* val, std::optional<detail::ResumePoint>& resume);
  template <class TL, class VL>
  void resolve_fit_sizes(TL& train, VL* val);
  void check_manual_options() const;
  bool can_stop_early() const;
  bool max_steps_reached() const;
  bool fit_done() const;
  bool should_check_val(int64_t batch_idx, bool is_last) const;
  void close_epoch();
  void stop_if_asked();
  std::string signal_checkpoint_path() const;
  template <class Impl, class VL>
  void run_validation(Impl& module, VL* val);
  template <class Impl, class Step, class B, class VL>
  bool train_batch(Impl& module, Context& ctx, Step& step, B& batch, int64_t batch_idx, bool is_last, VL* val);

  // ---- evaluation (trainer/evaluation_loop_impl.hpp) ----
  template <class Kind, class Impl, class L, class LimitOf, class Sink>
  void eval_epoch(Impl& module, Context& ctx, L& loader, LimitOf&& limit_of, Stage stage, Sink&& sink);
  template <class Kind, class Impl, class L, class LimitOf>
  void run_eval_loop(Impl& module, L& loader, Stage stage, LimitOf&& limit_of);
  template <class Kind, class Impl, class L>
  std::map<std::string, double> run_standalone_eval(Impl& module, L& loader, Stage stage, const std::string& ckpt_path);
  template <class R, class Impl, class L>
  std::vector<R> run_predict(Impl& module, L& loader, bool keep, const std::string& ckpt_path);

  // ---- checkpoints (trainer/checkpoint_impl.hpp) ----
  at::Tensor gather_ranks(const at::Tensor& t);
  checkpoint::Dict checkpoint_contents(checkpoint::Dict d, const std::vector<at::Tensor>& archives, bool weights_only);
  std::string resolve_ckpt_path(const std::string& path, const char* run) const;
  template <class Impl>
  void load_for_evaluation(Impl& module, const std::string& ckpt_path, const char* run);
  template <class Impl, class TL>
  detail::ResumePoint restore(Impl& module, TL& train_loader, const std::string& path);

  // ---- members, by owner ----
  // The policies and the options (set at construction).
  /// The options as given, with fast_dev_run's overrides applied.
  TrainerOptions options_;
  /// The callbacks, in pack order (the order their hooks run).
  std::tuple<Callbacks...> callbacks_;
  /// The strategy, bound to the accelerator.
  strategy_type strategy_;
  /// The precision, with its state (Fp16Mixed's loss scale).
  precision_type precision_;
  /// The strategy's collectives as Contexts and the logger connector see them (set when a run starts).
  detail::StrategyCollectives<strategy_type> collectives_{nullptr};

  // What modules see, and what they log.
  /// Stage, epoch, step, batch, rank and device: every Context reads it.
  detail::LoopState state_;
  /// Values logged in the running training epoch (its sums are kept across a resume).
  detail::MetricStore train_store_;
  /// Values logged in the running evaluation run.
  detail::MetricStore eval_store_;
  /// callback_metrics, progress_bar_metrics, logged_metrics and the values waiting for loggers.
  detail::LoggerConnector logger_;

  // The running (or last) fit.
  /// The optimizers and schedulers configure_optimizers returned, with the steps each has taken.
  std::vector<detail::ScheduledOptimizer> optim_;
  /// The module's parameters (clipping, accumulated gradients in checkpoints).
  std::vector<torch::Tensor> params_;
  int64_t max_epochs_ = 1000;  // max_epochs in effect (-1: until max_steps)
  int64_t num_training_batches_ = -1;  // training batches per epoch (-1: until the loader ends)
  int64_t num_val_batches_ = 0;  // validation batches per run (-1: until the loader ends; 0: no validation)
  int64_t num_eval_batches_ = 0;  // batches of the running (or last) evaluation loader's run
  std::function<torch::Tensor(int64_t)> batch_indices_;  // set while predict runs
  int64_t val_check_batch_ = -1;  // training batches between validations (-1: at the epoch's end)
  /// Batch counters, where the loop stands inside an epoch, and the stop request.
  detail::FitProgress progress_;

  // What save_checkpoint needs from the running fit.
  /// The module being fitted (null before the first fit).
  torch::nn::Module* module_ = nullptr;
  /// The training loader's position now (set while a fit runs over a loader that keeps one).
  std::function<data::LoaderState()> train_loader_state_;
  /// The callbacks' on_save_checkpoint and the module's (full checkpoints only), set while a fit runs.
  std::function<void(checkpoint::Dict&, bool weights_only)> save_hooks_;
  checkpoint::AsyncWriter writer_;  ///< asynchronous saves
  std::optional<data::LoaderState> final_loader_state_;  ///< the training loader's position when the last fit ended
  bool fitting_ = false;  ///< a fit is running
  std::string ckpt_path_;  ///< the checkpoint the running (or last) fit resumed from ("" when none)
  detail::HyperParameters hparams_;  ///< given by save_hyperparameters, and with the module's in the running run
};

/// Builds a Trainer whose callback pack is deduced from the arguments:
/// `auto trainer = volt::make_trainer<volt::SingleDevice, volt::Bf16, volt::CPU>({.max_epochs = 3}, volt::ProgressBar{});`
template <class S = SingleDevice, class P = Fp32, class A = CPU, class... Callbacks>
Trainer<S, P, A, std::remove_cvref_t<Callbacks>...> make_trainer(TrainerOptions options = {}, Callbacks&&... callbacks) {
  return Trainer<S, P, A, std::remove_cvref_t<Callbacks>...>(std::move(options), std::forward<Callbacks>(callbacks)...);
}

}  // namespace volt

// The Trainer's out-of-class definitions.
#include "volt/trainer/run_impl.hpp"
#include "volt/trainer/evaluation_loop_impl.hpp"
#include "volt/trainer/fit_loop_impl.hpp"
#include "volt/trainer/stop_impl.hpp"
#include "volt/trainer/checkpoint_impl.hpp"
