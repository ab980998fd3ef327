#pragma once
/// \file
/// Every exception type volt defines for its users to catch, in one place. Each message starts with `volt:` and says
/// what was given, what is allowed and what to do (STYLE.md); LibTorch's and the standard library's exceptions that
/// volt passes on keep their types (a module's step wraps them in a `StepError`, nested).
///
/// Besides these, volt throws the standard types where they say all there is to say, each with a `volt:` message:
/// `std::invalid_argument` for an argument a function refuses (a tensor of the wrong shape for a collective, a
/// callback's setting), `std::logic_error` for a call out of order (a manual optimizer stepped twice, a hook used
/// outside a fit), `std::runtime_error` for what the system refused (a file, a process, MPI) and `std::out_of_range`
/// for an index past the end. One more type is not an error and never leaves volt: `data::FetchStopped`
/// (data/fetch.hpp), which a loader's fetch throws to its own worker when the loader is shutting down.
///
/// | type | base | when |
/// |---|---|---|
/// | `ConfigError` | `std::invalid_argument` | a run-time setting or a combination of them is not allowed (phases (b) and (c), volt/rules.hpp) |
/// | `CheckpointError` | `std::runtime_error` | a checkpoint could not be written, read or resumed from; the message names the file |
/// | `StepError` | `std::runtime_error` | a module's step failed; says the step, stage, epoch, batch and rank, with the original nested |
/// | `LoaderError` | `std::runtime_error` | reading a batch failed (on the training thread or a loader's worker); says the batch, the epoch and the sample indices, with the original nested |
/// | `Interrupted` | `std::runtime_error` | a stop signal ended a fit after its checkpoint was written (cluster/signals.hpp) |
/// | `RankFailure` | `std::runtime_error` | another rank failed or fell silent, or a collective outlived the `timeout`; carries the failing rank's message and rank (comm/runtime.hpp) |

#include <stdexcept>
#include <string>
#include <utility>

namespace volt {

/// Every run-time configuration error volt raises. The message says what was given and what is allowed.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A checkpoint could not be written or read; the message names the file.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An exception thrown by a module's step, with where it was thrown: the step, the stage, the epoch, the batch
/// and the rank (`volt: training_step failed in epoch 2, batch 17 (global step 81): Target 10 is out of bounds.`).
/// The original exception is nested in it (`std::rethrow_if_nested` gives it back).
class StepError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Reading a batch failed: `volt: reading batch 3 of epoch 1 (samples 12, 40, 7) on loader worker 2 failed: <the
/// original message>`. The original exception is nested in it.
class LoaderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A fit stopped by a stop signal (SIGTERM, SIGINT, SIGUSR1) after its checkpoint was written
/// (cluster/signals.hpp says how signals are agreed and what is saved).
class Interrupted : public std::runtime_error {
 public:
  Interrupted(int signal, std::string checkpoint, const std::string& message)
      : std::runtime_error(message), signal_(signal), checkpoint_(std::move(checkpoint)) {}
  /// The signal that stopped the fit.
  int signal() const { return signal_; }
  /// The checkpoint written at the stop ("" when none could be written: a Spawn main process that was not told).
  const std::string& checkpoint() const { return checkpoint_; }
  /// 128 + the signal number: what a shell reports for a process that signal ended.
  int exit_status() const { return 128 + signal_; }

 private:
  int signal_;
  std::string checkpoint_;
};

/// Thrown in every rank that was waiting on a rank that failed (and, under Spawn, in the main process); also when a
/// collective waited past the Trainer's `timeout` or a peer fell silent (comm/runtime.hpp). `what()` carries the
/// failing rank's own message.
class RankFailure : public std::runtime_error {
 public:
  RankFailure(int rank, const std::string& message) : std::runtime_error(message), rank_(rank) {}
  /// The rank that failed first (-1 when unknown).
  int failed_rank() const { return rank_; }

 private:
  int rank_;
};

}  // namespace volt
