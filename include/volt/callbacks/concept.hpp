#pragma once
/// \file
/// Callbacks: plain objects given to the Trainer as a compile-time pack,
/// `Trainer<S, P, A, ProgressBar, CSVLogger> trainer(options, ProgressBar{}, CSVLogger{})` (or
/// `make_trainer<S, P, A>(options, ProgressBar{}, CSVLogger{})`). Every hook is optional and found at compile
/// time; a member named like a hook with other parameters is a compile error. `trainer` is the Trainer
/// (take it as `auto&`), `module` the user's module.
///
/// | hook | extra arguments | when |
/// |---|---|---|
/// | `setup`, `teardown` | `Stage` | start / end of fit, validate, test, predict |
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
/// | `on_log_metrics` | `(trainer, const std::map<std::string, double>&, int64_t step)`: no module | metrics for loggers |
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
/// Writing your own:
/// \code
///   struct PrintEpoch {
///     void on_train_epoch_end(auto& trainer, auto&) { std::cout << trainer.current_epoch() << "\n"; }
///   };
/// \endcode

#include <concepts>
#include <type_traits>

namespace volt {

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

}  // namespace volt
