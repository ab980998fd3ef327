#pragma once
/// \file
/// Callbacks: plain objects given to the Trainer as a compile-time pack,
/// `Trainer<S, P, A, ProgressBar, CSVLogger> trainer(options, ProgressBar{}, CSVLogger{})` (or
/// `make_trainer<S, P, A>(options, ProgressBar{}, CSVLogger{})`). Every hook is optional and found at compile
/// time; a member named like a hook with other parameters is a compile error (a misspelt name is not seen: list the
/// hooks in `using volt_hooks = volt::Hooks<volt::hook::...>` to have them checked, volt/declared_hooks.hpp). `trainer` is the Trainer
/// (take it as `auto&`), `module` the user's module.
///
/// | hook | extra arguments | when |
/// |---|---|---|
/// | `setup`, `teardown` | `Stage` | start / end of fit, validate, test, predict |
/// | `configure_model` | `volt::ModelPlan&` | at each run's start, after the module's placement and before `setup` and the module's own `configure_model`: a callback may plan parts too (volt/model_plan.hpp) |
/// | `on_optimizers_configured` | | in fit, after `configure_optimizers` and before the strategy takes the optimizers (ZeRO shards them) and a checkpoint's state is loaded into them: a callback may add parameter groups (BackboneFinetuning) |
/// | `on_fit_start`, `on_fit_end` | | around fit |
/// | `on_sanity_check_start`, `on_sanity_check_end` | | around the sanity validation run |
/// | `on_train_start`, `on_train_end` | | around the training loop |
/// | `on_train_epoch_start`, `on_train_epoch_end` | | each training epoch |
/// | `on_train_batch_start` | `batch, batch_idx` | before a training step |
/// | `on_train_batch_end` | `loss, batch, batch_idx` | after it (and after the optimizer step it may end) |
/// | `on_validation_start/end`, `on_validation_epoch_start/end` | | each validation run (also in the sanity check) |
/// | `on_validation_batch_start` / `_end` | `batch, batch_idx` / `output, batch, batch_idx` | |
/// | the same four for `test` and `predict` | | |
/// | `on_before_zero_grad`, `on_before_optimizer_step` | `torch::optim::Optimizer&` | |
/// | `on_before_backward` | `const torch::Tensor& loss` | |
/// | `on_after_backward` | | |
/// | `on_exception` | `std::exception_ptr` | a run is ending with an exception (it is rethrown) |
/// | `on_save_checkpoint` | `volt::checkpoint::Dict& checkpoint` | a checkpoint of the running (or last) fit is about to be written, on rank zero, its callback states already in it; also for weights-only ones (unlike Lightning), which hold only `state_dict`. EMAWeightAveraging puts its average there |
///
/// State in checkpoints (optional too): `state_dict() const` returning `std::map<std::string, double>` or a
/// `checkpoint::Dict`, and `load_state_dict(...)` taking the same; saved under `state_key()` when the callback
/// has one (ModelCheckpoint's includes its monitor, so two of them keep apart), else its type's name. A
/// resumed fit gives each callback the state saved under its key.
///
/// Order, as Lightning: callbacks (in pack order) before the module's own hook, except for
/// `on_train_epoch_end`, where callbacks that declare `static constexpr bool monitors_metrics = true`
/// (EarlyStopping, checkpointing) run after the module so they see what its hook logged.
///
/// **What a callback may use of the Trainer** (`trainer` in every hook; these are the members kept stable for
/// callbacks, defined in volt/trainer.hpp):
///
/// | member | what it says or does |
/// |---|---|
/// | `options()` | the `TrainerOptions` in effect (fast_dev_run applied): `default_root_dir`, limits, ... |
/// | `current_epoch()`, `global_step()`, `batch_idx()`, `stage()`, `sanity_checking()` | where the loops stand |
/// | `batch_indices()` | during `predict`: the data set indices of the batch's samples (volt's loaders; undefined for others) |
/// | `max_epochs()`, `max_steps()`, `num_training_batches()`, `num_eval_batches()` | the run's extent (-1: until the loader ends) |
/// | `fitting()`, `fast_dev_run()`, `has_validation()`, `is_global_zero()` | what kind of run this is, and whether this process is rank zero |
/// | `validation_has_run()` | a validation run of this fit has ended (a validation metric can be there) |
/// | `ckpt_path()` | the checkpoint this fit resumed from ("" when none): never delete it |
/// | `callback_metrics()`, `progress_bar_metrics()`, `logged_metrics()`, `callback_metric_values()` | the latest logged values |
/// | `record_metric(name, value, prog_bar, logger)`, `record_metrics(values, ...)` | values of the callback's own (a learning rate), to callback_metrics and loggers (one logging event per call) |
/// | `logs_this_batch()` | in `on_train_batch_end`: the batch stepped and loggers get its metrics (every `log_every_n_steps`) |
/// | `logging_step()` | the step loggers file values under now (in a training batch: the batches that stepped before it) |
/// | `request_stop()`, `should_stop()` | ask the fit to stop (honoured once min_epochs/min_steps are met) |
/// | `save_checkpoint(path, weights_only)` | write a checkpoint now; every rank must call it |
/// | `optimizer()`, `lr_scheduler()`, `optimizers()` | the running fit's (the first; null before one), and all of them (several under manual optimization) |
/// | `strategy()`, `precision()`, `callback<C>()`, `callbacks()` | the policies and the other callbacks |
///
/// **Finding checkpoints: `"last"` and `"best"`.** `fit(..., ckpt_path = "last")` (or `"best"`) asks every
/// callback that has both `std::string find_last_checkpoint(const auto& trainer) const` and
/// `std::string find_best_checkpoint(const auto& trainer) const`, in pack order; the first non-empty answer
/// is the file to resume from. No such callback is a `ConfigError`; an empty `"last"` is a fresh start (as
/// Lightning), an empty `"best"` a `CheckpointError`. A callback with `best_model_path()` also gives `fit`'s
/// result its `best_model_path` (the first non-empty one). ModelCheckpoint implements both; it finds the best
/// path in a new process through `checkpoint::saved_callback_state` (volt/checkpoint.hpp).
/// Such a callback may also name where a stop signal's checkpoint goes,
/// `std::string signal_checkpoint_path(const auto& trainer) const` (the first answer is used; none:
/// `<default_root_dir>/checkpoints/interrupted.ckpt`), so that its `find_last_checkpoint` finds it.
///
/// **The loss in graph mode.** Under `Graphed<...>` the step's loss is an output of a CUDA graph, rewritten by the next
/// replay, so `on_train_batch_end` gets a copy of it, made once per batch while any hook that takes it may keep it: the
/// module's own, or a callback's unless the callback declares `static constexpr bool keeps_loss = false` (it reads the
/// loss, if at all, during the hook: ProgressBar and ModelCheckpoint do).
///
/// **Loggers** are callbacks with hooks of their own (`log_metrics`, `log_hyperparams`, `flush`, `finalize`), checked at
/// compile time: volt/loggers/concept.hpp.
///
/// Writing your own:
/// \code
///   struct PrintEpoch {
///     void on_train_epoch_end(auto& trainer, auto&) { std::cout << trainer.current_epoch() << "\n"; }
///   };
/// \endcode

#include <concepts>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>

namespace volt {

/// Whether a monitored value improves downwards (a loss) or upwards (an accuracy): `mode` of ModelCheckpoint and
/// EarlyStopping, as Lightning's `mode="min"`/`"max"` (`volt::Mode::max`, or `volt::ModelCheckpoint::Mode::max`).
enum class Mode { min, max };

/// Any movable object can be a callback: every hook is optional.
template <class C>
concept Callback = std::is_object_v<C> && std::move_constructible<C>;

/// Whether the callback decides from metrics and must see everything logged in an epoch-end hook first.
template <class C>
inline constexpr bool monitors_metrics = [] {
  if constexpr (requires { C::monitors_metrics; }) {
    return static_cast<bool>(C::monitors_metrics);
  } else {
    return false;
  }
}();

/// Whether the callback may keep the loss `on_train_batch_end` gives it past the hook (graph mode copies it then).
template <class C>
inline constexpr bool keeps_loss = [] {
  if constexpr (requires { C::keeps_loss; }) {
    return static_cast<bool>(C::keeps_loss);
  } else {
    return true;
  }
}();

namespace detail {
/// Calls `f(c)` on every callback `c` of the pack, in pack order: the one walk over a Trainer's callbacks (hooks,
/// loggers, checkpoint state, the questions below).
template <class Tuple, class F>
void for_each_callback(Tuple& callbacks, F&& f) {
  std::apply([&](auto&... cb) { (f(cb), ...); }, callbacks);
}

/// The first non-empty answer, in pack order, of the callbacks `ask` can ask (`ask` states what it needs of a
/// callback in a requires-clause; the others are passed over): "the first callback that answers", as the best
/// checkpoint, a `"last"` checkpoint, a stop signal's checkpoint path or a logger's shared folder are found. An empty
/// answer asks the next one.
template <class R, class Tuple, class Ask>
R first_answer(Tuple& callbacks, Ask&& ask) {
  R out{};
  for_each_callback(callbacks, [&](auto& c) {
    if constexpr (std::is_invocable_v<Ask&, decltype(c)>) {
      if (out.empty()) out = R(ask(c));
    }
  });
  return out;
}
}  // namespace detail

}  // namespace volt
