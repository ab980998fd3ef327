#pragma once
/// \file
/// The Trainer's run-time settings: one aggregate filled with designated initializers,
/// `Trainer<...> trainer({.max_epochs = 5, .accumulate_grad_batches = 4});`, checked once when the Trainer
/// is built (`validate_options`), before anything runs.

#include "volt/errors.hpp"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace volt {

/// A batch limit or interval in Lightning's two spellings: an integer is a number of batches, a floating
/// value is a fraction of the loader (0.25 = a quarter of it, 1.0 = all of it).
class Limit {
 public:
  constexpr Limit(std::integral auto batches) : count_(static_cast<int64_t>(batches)) {}
  constexpr Limit(std::floating_point auto fraction) : fraction_(static_cast<double>(fraction)), is_fraction_(true) {}
  Limit(bool) = delete;  // `true` is not a number of batches

  /// All batches.
  static constexpr Limit all() { return Limit(1.0); }

  constexpr bool is_fraction() const { return is_fraction_; }
  /// No batches at all (0 or 0.0).
  constexpr bool is_zero() const { return is_fraction_ ? fraction_ == 0.0 : count_ == 0; }
  constexpr int64_t count() const { return count_; }
  constexpr double fraction() const { return fraction_; }
  /// The same spelling and value (`5` is not `5.0`: a count is not a fraction).
  friend constexpr bool operator==(const Limit&, const Limit&) = default;

  /// Throws unless this is a count >= `min_count` or a fraction in [min_fraction, 1] (`name` and the value are quoted).
  void check(std::string_view name, int64_t min_count, double min_fraction, bool fraction_may_be_min = true) const {
    std::ostringstream s;
    if (is_fraction_) {
      const bool low = fraction_may_be_min ? fraction_ < min_fraction : fraction_ <= min_fraction;
      if (!std::isfinite(fraction_) || low || fraction_ > 1.0) {
        s << "volt: " << name << "=" << fraction_ << " is not allowed: a fraction must lie in "
          << (fraction_may_be_min ? "[" : "(") << min_fraction << ", 1.0] (or give an integer number of batches).";
        throw ConfigError(s.str());
      }
    } else if (count_ < min_count) {
      s << "volt: " << name << "=" << count_ << " is not allowed: a number of batches must be >= " << min_count
        << " (or give a fraction in [0.0, 1.0]).";
      throw ConfigError(s.str());
    }
  }

  /// How many batches this limit allows out of `available` (-1: the loader's length is unknown, which
  /// only the full fraction 1.0 and counts can work with). Returns -1 for "until the loader ends".
  int64_t resolve(int64_t available, std::string_view name) const {
    if (!is_fraction_) return available < 0 ? count_ : std::min(count_, available);
    if (fraction_ == 1.0 || available == 0) return available;  // an empty loader (a rank dealt none): no batch
    if (available < 0) {
      std::ostringstream s;
      s << "volt: " << name << "=" << fraction_ << " is a fraction of the loader, but this loader has no size(). "
        << "Give an integer number of batches, or a loader with size().";
      throw ConfigError(s.str());
    }
    const auto n = static_cast<int64_t>(static_cast<double>(available) * fraction_);
    if (n == 0 && fraction_ > 0.0) {
      std::ostringstream s;
      s << "volt: " << name << "=" << fraction_ << " of " << available << " batches is less than one batch. "
        << "Increase " << name << " or give an integer number of batches.";
      throw ConfigError(s.str());
    }
    return n;
  }

 private:
  int64_t count_ = 0;
  double fraction_ = 0.0;
  bool is_fraction_ = false;
};

/// How gradients are clipped when `gradient_clip_val` is set.
enum class ClipAlgorithm { norm, value };

/// What a fit does when the job is told to stop: a scheduler's SIGTERM (SLURM at the time limit or on
/// preemption, Kubernetes), Ctrl-C (SIGINT), or the early warning a scheduler can send (SLURM's
/// `--signal=USR1@90`). The signal sets a flag; every rank reads it at the next training batch boundary and
/// all agree (a signal that reached one rank stops all). The fit then writes a full checkpoint where
/// `fit(..., "last")` finds it (ModelCheckpoint's folder, `interrupted.ckpt`), flushes the loggers, requeues a
/// SLURM job when asked, and ends the process with exit status 128 + the signal number (143 for SIGTERM, 130
/// for SIGINT, 138 for SIGUSR1), the status a shell reports for a process that signal ended. A second
/// signal ends the process at once. Under mpirun, SIGTERM to mpirun reaches the ranks with a 1 s grace
/// before SIGKILL (Open MPI's `odls_base_sigkill_timeout`): send SIGUSR1, which mpirun forwards, or raise
/// that timeout. The agreement is one small host collective per training batch, so every rank must run the
/// same number of training batches (as DDP's padded shards do); a ManualParallel module that gives ranks
/// different counts turns signals off (`enabled = false`).
struct SignalOptions {
  /// Handle SIGTERM, SIGINT and `requeue_signal` while a fit runs (false: the process keeps its own handlers).
  bool enabled = true;
  /// The extra signal a scheduler sends before its deadline; 0: none.
  int requeue_signal = SIGUSR1;
  /// In a SLURM job (SLURM_JOB_ID set), run `scontrol requeue $SLURM_JOB_ID` on rank zero after the
  /// checkpoint is written, for SIGTERM and `requeue_signal` (not for Ctrl-C), as Lightning's auto_requeue.
  bool auto_requeue = true;
  /// The program that requeues: `<scontrol> requeue $SLURM_JOB_ID`, looked up on PATH unless it names a path (for a
  /// cluster that keeps SLURM's commands elsewhere, or a wrapper of its own).
  std::string scontrol = "scontrol";
  /// End the process after the checkpoint (false: fit throws `volt::Interrupted` instead, for programs that
  /// clean up themselves).
  bool exit_process = true;

  bool operator==(const SignalOptions&) const = default;
};

/// The Trainer's run-time settings. Every field has Lightning's default and meaning unless said otherwise.
struct TrainerOptions {
  /// Number of processes (CPU) or devices (GPU) per node. SingleDevice takes exactly 1.
  int devices = 1;
  /// Number of nodes (distributed strategies only).
  int num_nodes = 1;

  /// Stop after this many epochs; -1 runs until `max_steps` or a stop request. Unset: 1000 when `max_steps`
  /// is -1 too, as Lightning.
  std::optional<int64_t> max_epochs;
  /// Run at least this many epochs before a stop request (early stopping) takes effect.
  int64_t min_epochs = 0;
  /// Stop after this many optimizer steps; -1: no step limit.
  int64_t max_steps = -1;
  /// Run at least this many optimizer steps before a stop request takes effect.
  int64_t min_steps = 0;
  /// Stop training after this much time (`std::chrono::hours(12)`, `90min`), as Lightning's `max_time`: at the first
  /// training batch boundary after it where min_epochs and min_steps are met (rank zero's clock decides for every
  /// rank, in the collective stop signals use), the fit writes a checkpoint as at a stop signal (SignalOptions) and returns as a finished fit does. The
  /// time of the fits it resumed from counts too (it is saved in checkpoints). Unset: no limit.
  std::optional<std::chrono::milliseconds> max_time;

  /// Batches used per epoch / per evaluation run: an integer count or a fraction of the loader.
  Limit limit_train_batches = Limit::all();
  Limit limit_val_batches = Limit::all();
  Limit limit_test_batches = Limit::all();
  Limit limit_predict_batches = Limit::all();
  /// Train and validate on this many batches (or this fraction) of each loader, the same ones every epoch (their
  /// shuffling off for the fit), to check that a model can drive its loss to zero: Lightning's `overfit_batches`.
  /// 0: off. It sets limit_train_batches and limit_val_batches, which are then left unset.
  Limit overfit_batches = 0;

  /// Validate every this many training batches (integer) or this fraction of the training epoch.
  Limit val_check_interval = Limit::all();
  /// Validate in every n-th epoch; unset: an integer `val_check_interval` counts batches across epochs.
  std::optional<int64_t> check_val_every_n_epoch = 1;
  /// Validation batches run before training to catch bugs early (-1: the whole validation loader).
  int64_t num_sanity_val_steps = 2;

  /// Accumulate gradients over this many batches before each optimizer step (losses are divided by it).
  int64_t accumulate_grad_batches = 1;
  /// Clip gradients to this norm or value before each optimizer step (after unscaling under Fp16Mixed).
  std::optional<double> gradient_clip_val;
  ClipAlgorithm gradient_clip_algorithm = ClipAlgorithm::norm;

  /// Run n batches of train, validation and test (true = 1) once, to find bugs: no sanity check, one epoch,
  /// loggers write nothing.
  int64_t fast_dev_run = 0;

  /// Use deterministic algorithms only (errors where an op has none), cuDNN deterministic, no benchmark.
  bool deterministic = false;
  /// cuDNN's autotuner (`torch.backends.cudnn.benchmark`): true times each convolution's algorithms for every new
  /// input shape and keeps the fastest (for fixed shapes, graph mode's included); false does not. Unset: as the
  /// process has it (LibTorch's default is false), or false under `deterministic`. As Lightning's `benchmark`.
  std::optional<bool> benchmark;
  /// Seed every generator at the start of each run (torch's CPU and CUDA generators, loaders' shuffling).
  std::optional<uint64_t> seed;
  /// LibTorch's anomaly mode while fitting (`torch::autograd::DetectAnomalyGuard`): a backward that makes NaN fails
  /// at once, naming the op whose gradient it computed, instead of training on. Slow; for finding a NaN's source.
  bool detect_anomaly = false;

  /// Evaluate under `torch::InferenceMode` (true) or `torch::NoGradGuard` (false).
  bool inference_mode = true;
  /// Send step-level metrics to loggers every n optimizer steps.
  int64_t log_every_n_steps = 50;
  /// Where loggers and checkpoints go unless they are told otherwise.
  std::string default_root_dir = ".";
  /// SIGTERM, SIGINT and the requeue signal during fit: checkpoint, flush, requeue, exit (SignalOptions).
  SignalOptions signals = {};
  /// Distributed strategies: how long a collective may wait for the other ranks before the job ends, as the
  /// `timeout` of Lightning's DDPStrategy (and PyTorch's process groups): 30 minutes. Every rank that can still act
  /// ends with `volt::RankFailure`, whose message names the rank and host that waited, the collective (kind, number,
  /// step, bucket), the ranks that had not issued it and the waiting rank's last collectives. A rank not heard from at
  /// all (its process, host or link gone) ends the job sooner: after 15 s of silence, or this timeout when shorter.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);

  /// Every field equal (a configuration read from a file or flags against the same options set in C++).
  bool operator==(const TrainerOptions&) const = default;
};

namespace detail {

inline void require(bool ok, const std::string& message) {
  if (!ok) throw ConfigError("volt: " + message);
}

template <class T>
std::string quote(std::string_view name, const T& value) {
  std::ostringstream s;
  s << name << "=" << value;
  return s.str();
}

}  // namespace detail

/// Phase (b) of validation: every value on its own, before any process, device or file is touched.
/// Cross-checks with hardware (device counts) are the accelerator's and strategy's (`check_devices`).
inline void validate_options(const TrainerOptions& o) {
  using detail::quote;
  using detail::require;
  require(o.devices >= 1, quote("devices", o.devices) + " is not allowed: give at least 1.");
  require(o.num_nodes >= 1, quote("num_nodes", o.num_nodes) + " is not allowed: give at least 1.");
  require(o.timeout.count() > 0, "timeout=" + std::to_string(o.timeout.count()) +
                                     " ms is not allowed: give a positive time (Lightning's default: 30 minutes).");
  if (o.max_epochs) {
    require(*o.max_epochs >= -1,
            quote("max_epochs", *o.max_epochs) + " is not allowed: give -1 (no epoch limit) or a number >= 0.");
  }
  require(!(o.deterministic && o.benchmark.value_or(false)),
          "benchmark=true with deterministic=true is not allowed: cuDNN's autotuner picks algorithms by timing them, so "
          "a run would not be deterministic. Leave benchmark unset (or false) for deterministic runs, or set "
          "deterministic=false.");
  require(o.min_epochs >= 0, quote("min_epochs", o.min_epochs) + " is not allowed: give a number >= 0.");
  require(o.max_steps >= -1,
          quote("max_steps", o.max_steps) + " is not allowed: give -1 (no step limit) or a number >= 0.");
  require(o.min_steps >= 0, quote("min_steps", o.min_steps) + " is not allowed: give a number >= 0.");
  if (o.max_time) {
    require(o.max_time->count() > 0, "max_time=" + std::to_string(o.max_time->count()) +
                                         "ms is not allowed: give a positive duration (std::chrono::minutes(30)), "
                                         "or leave it unset for no time limit.");
  }
  o.limit_train_batches.check("limit_train_batches", 0, 0.0);
  o.limit_val_batches.check("limit_val_batches", 0, 0.0);
  o.limit_test_batches.check("limit_test_batches", 0, 0.0);
  o.limit_predict_batches.check("limit_predict_batches", 0, 0.0);
  o.overfit_batches.check("overfit_batches", 0, 0.0);
  if (!o.overfit_batches.is_zero()) {
    auto unset = [](const Limit& l) { return l.is_fraction() && l.fraction() == 1.0; };
    require(unset(o.limit_train_batches) && unset(o.limit_val_batches),
            "overfit_batches with limit_train_batches or limit_val_batches is not allowed: overfit_batches sets both "
            "(each loader's first batches, every epoch). Leave the limits unset, or set overfit_batches=0.");
    require(o.fast_dev_run == 0, "overfit_batches with fast_dev_run is not allowed: each sets the batch limits. Choose "
                                 "one (fast_dev_run runs n batches once; overfit_batches trains on n batches for every "
                                 "epoch).");
  }
  o.val_check_interval.check("val_check_interval", 1, 0.0, /*fraction_may_be_min=*/false);
  if (o.check_val_every_n_epoch) {
    require(*o.check_val_every_n_epoch >= 1,
            quote("check_val_every_n_epoch", *o.check_val_every_n_epoch) +
                " is not allowed: give a number >= 1, or leave it unset to count val_check_interval across epochs.");
  } else {
    require(!o.val_check_interval.is_fraction(),
            "check_val_every_n_epoch is unset, which needs an integer val_check_interval (a number of batches); "
            "got the fraction " + std::to_string(o.val_check_interval.fraction()) + ".");
  }
  require(o.num_sanity_val_steps >= -1,
          quote("num_sanity_val_steps", o.num_sanity_val_steps) +
              " is not allowed: give -1 (the whole validation loader), 0 (no sanity check) or a number of batches.");
  require(o.accumulate_grad_batches >= 1,
          quote("accumulate_grad_batches", o.accumulate_grad_batches) +
              " is not allowed: give 1 (no accumulation) or more batches per optimizer step.");
  if (o.gradient_clip_val) {
    require(std::isfinite(*o.gradient_clip_val) && *o.gradient_clip_val >= 0.0,
            quote("gradient_clip_val", *o.gradient_clip_val) +
                " is not allowed: give a finite value >= 0 (0 disables clipping), or leave it unset.");
  }
  require(o.fast_dev_run >= 0,
          quote("fast_dev_run", o.fast_dev_run) + " is not allowed: give 0 (off), true/1 or a number of batches.");
  require(o.log_every_n_steps >= 1,
          quote("log_every_n_steps", o.log_every_n_steps) + " is not allowed: give a number >= 1.");
  require(!o.signals.auto_requeue || !o.signals.scontrol.empty(),
          "signals.scontrol is empty, but signals.auto_requeue is on: name the program that requeues a SLURM job "
          "(\"scontrol\", found on PATH, or its path), or set signals.auto_requeue = false.");
  if (o.signals.enabled && o.signals.requeue_signal != 0) {
    const int s = o.signals.requeue_signal;
    require(s > 0 && s < NSIG && s != SIGKILL && s != SIGSTOP && s != SIGTERM && s != SIGINT,
            quote("signals.requeue_signal", s) + " is not allowed: give a catchable signal other than SIGTERM and "
            "SIGINT (which are always handled), such as SIGUSR1 (" + std::to_string(SIGUSR1) + ") or SIGUSR2 (" +
            std::to_string(SIGUSR2) + "), or 0 for none.");
  }
}

}  // namespace volt
