#pragma once
/// \file
/// Loggers: callbacks that also write what a run logs, as Lightning's `Logger`s. A logger is given to the Trainer
/// with the other callbacks (`make_trainer<S, P, A>(options, CSVLogger{}, MyLogger{})`), has every callback hook
/// (volt/callbacks/concept.hpp: `setup` finds its folder, `state_dict` keeps a run id in checkpoints), and these hooks
/// of its own, which the Trainer calls on the global rank zero only:
///
/// | hook | when |
/// |---|---|
/// | `void log_metrics(const std::map<std::string, double>& metrics, int64_t step)` | **required**: each logging event, `epoch` among the values, at the step values are filed under (`Trainer::logging_step`) |
/// | `void log_hyperparams(const volt::Json& params)` | each run (fit, validate, test, predict) after the callbacks' `setup`, with the run's hyper-parameters (`Trainer::hyper_parameters`) when there are any |
/// | `void flush()` | write what it holds: at each training epoch's end, after each validation or test run, on a stop signal, when a run fails and when a fit ends |
/// | `void after_save_checkpoint(const std::vector<std::string>& files)` | a checkpoint save's files are all in place (the checkpoints, and the weights files beside them): after `Trainer::save_checkpoint` (ModelCheckpoint's saves, a stop signal's), on the checkpoint writer's thread when the save is asynchronous |
/// | `void finalize(volt::RunStatus status)` | a run ends: `finished`, `failed` (an exception), or `interrupted` (a stop signal's `volt::Interrupted`, the fit to be resumed); after the last `flush` |
///
/// **A type is a logger** when it declares `static constexpr bool is_logger = true` (volt's own do), or has a member
/// named like one of these hooks. The Trainer checks every logger at compile time: no `log_metrics`, or a hook with
/// parameters volt does not pass, is a compile error naming the hook and its signature, so a misspelt or mistyped hook
/// of a declared logger is never silently left uncalled. C++ cannot see a misspelt name of an optional hook
/// (`finalise`, `log_hyperparameters`): declare `is_logger` so that at least a misspelt `log_metrics` is caught, and
/// list the hooks it implements in `using volt_hooks = volt::Hooks<volt::hook::log_metrics, volt::hook::finalize>;`
/// to have each checked by name (volt/declared_hooks.hpp).
///
/// Writing your own:
/// \code
///   struct PrintLogger {
///     static constexpr bool is_logger = true;
///     void log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
///       for (const auto& [name, value] : metrics) std::cout << step << " " << name << "=" << value << "\n";
///     }
///   };
/// \endcode

#include "volt/batch.hpp"
#include "volt/callbacks/concept.hpp"
#include "volt/config/values.hpp"
#include "volt/declared_hooks.hpp"
#include "volt/errors.hpp"

#include <cstdint>
#include <exception>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace volt {

/// How a run ended, as a logger's `finalize` hears it (MLflow's FINISHED, FAILED, KILLED).
enum class RunStatus { finished, failed, interrupted };

/// Lightning's names for a run's end ("success", "failed", "interrupted").
constexpr const char* to_string(RunStatus s) {
  switch (s) {
    case RunStatus::finished: return "success";
    case RunStatus::failed: return "failed";
    case RunStatus::interrupted: return "interrupted";
  }
  return "?";
}

/// A logger: a callback that takes logged metrics.
template <class L>
concept Logger = Callback<L> && requires(L& l, const std::map<std::string, double>& metrics, int64_t step) {
  l.log_metrics(metrics, step);
};

namespace detail {

/// Whether `C` says it is a logger, or names a logger's hook (a non-template member of that name).
template <class C>
inline constexpr bool declares_logger = [] {
  if constexpr (requires { C::is_logger; }) {
    return static_cast<bool>(C::is_logger);
  } else {
    return requires { &C::log_metrics; } || requires { &C::log_hyperparams; } || requires { &C::finalize; } ||
           requires { &C::after_save_checkpoint; };
  }
}();

/// The compile-time check of one callback type of a Trainer: a logger's hooks take what volt passes, and the hooks
/// it declares in its `volt_hooks` it has (volt/declared_hooks.hpp). Instantiated by the Trainer for each of its
/// callback types; `true` when it compiles.
template <class C>
constexpr bool check_logger() {
  (void)check_declared_hooks<C>();
  if constexpr (requires { &C::on_log_metrics; }) {
    static_assert(dependent_false<C>, "volt: a callback's on_log_metrics(trainer, metrics, step) is a logger's "
                                      "log_metrics(metrics, step) now; see volt/loggers/concept.hpp.");
  }
  if constexpr (declares_logger<C>) {
    static_assert(requires { &C::log_metrics; } || Logger<C>,
                  "volt: a logger has no log_metrics: it needs `void log_metrics(const std::map<std::string, double>& "
                  "metrics, int64_t step)`; see volt/loggers/concept.hpp.");
    static_assert(Logger<C> || !requires { &C::log_metrics; },
                  "volt: a logger's log_metrics has a signature volt does not call: it is `void log_metrics(const "
                  "std::map<std::string, double>& metrics, int64_t step)`.");
    if constexpr (requires { &C::log_hyperparams; }) {
      static_assert(requires(C& c, const Json& params) { c.log_hyperparams(params); },
                    "volt: a logger's log_hyperparams has a signature volt does not call: it is `void "
                    "log_hyperparams(const volt::Json& params)`.");
    }
    if constexpr (requires { &C::flush; }) {
      static_assert(requires(C& c) { c.flush(); },
                    "volt: a logger's flush has a signature volt does not call: it is `void flush()`.");
    }
    if constexpr (requires { &C::after_save_checkpoint; }) {
      static_assert(requires(C& c, const std::vector<std::string>& files) { c.after_save_checkpoint(files); },
                    "volt: a logger's after_save_checkpoint has a signature volt does not call: it is `void "
                    "after_save_checkpoint(const std::vector<std::string>& files)`.");
    }
    if constexpr (requires { &C::finalize; }) {
      static_assert(requires(C& c) { c.finalize(RunStatus::finished); },
                    "volt: a logger's finalize has a signature volt does not call: it is `void "
                    "finalize(volt::RunStatus status)`.");
    }
  }
  return true;
}

/// Calls `f(logger)` for every logger of the pack, in pack order.
template <class Tuple, class F>
void for_each_logger(Tuple& callbacks, F&& f) {
  for_each_callback(callbacks, [&](auto& c) {
    if constexpr (Logger<std::remove_cvref_t<decltype(c)>>) f(c);
  });
}

/// Calls `f(name, value)` for each leaf of a JSON object, named by its path (`trainer/max_epochs`), as Lightning's loggers
/// flatten hyper-parameters; a list is one leaf.
template <class F>
void for_each_hparam(const Json& j, F&& f, const std::string& prefix = "") {
  for (const auto& [k, v] : j.items()) {
    const std::string name = prefix.empty() ? k : prefix + "/" + k;
    if (v.is_object()) {
      for_each_hparam(v, f, name);
    } else {
      f(name, v);
    }
  }
}

/// How a run that threw ended: a stop signal's `Interrupted`, or a failure.
inline RunStatus run_status(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const Interrupted&) {
    return RunStatus::interrupted;
  } catch (...) {
  }
  return RunStatus::failed;
}

/// Calls `call(logger)` for every logger `call` can take (a hook it needs states it in a requires-clause, as
/// detail::first_answer's questions do; the loggers without that hook are passed over), on the global rank zero only.
template <class Tuple, class Call>
void call_loggers(Tuple& callbacks, bool global_zero, Call&& call) {
  if (!global_zero) return;
  for_each_logger(callbacks, [&](auto& l) {
    if constexpr (std::is_invocable_v<Call&, decltype(l)>) call(l);
  });
}

/// The Trainer's calls of the hooks above.
template <class Tuple>
void log_metrics(Tuple& callbacks, bool global_zero, const std::map<std::string, double>& metrics, int64_t step) {
  call_loggers(callbacks, global_zero, [&](auto& l) { l.log_metrics(metrics, step); });
}
template <class Tuple>
void log_hyperparams(Tuple& callbacks, bool global_zero, const Json& params) {
  call_loggers(callbacks, global_zero, [&](auto& l) requires requires { l.log_hyperparams(params); } {
    l.log_hyperparams(params);
  });
}
template <class Tuple>
void flush_loggers(Tuple& callbacks, bool global_zero) {
  call_loggers(callbacks, global_zero, [](auto& l) requires requires { l.flush(); } { l.flush(); });
}
/// Whether a logger of the pack takes `after_save_checkpoint`.
template <class C>
inline constexpr bool hears_save = requires(C& c, const std::vector<std::string>& f) { c.after_save_checkpoint(f); };
template <class... Cs>
inline constexpr bool hears_saves = (hears_save<Cs> || ...);
template <class Tuple>
void after_save_checkpoint(Tuple& callbacks, bool global_zero, const std::vector<std::string>& files) {
  call_loggers(callbacks, global_zero, [&](auto& l) requires requires { l.after_save_checkpoint(files); } {
    l.after_save_checkpoint(files);
  });
}
template <class Tuple>
void finalize_loggers(Tuple& callbacks, bool global_zero, RunStatus status) {
  call_loggers(callbacks, global_zero, [&](auto& l) requires requires { l.finalize(status); } { l.finalize(status); });
}

}  // namespace detail

}  // namespace volt
