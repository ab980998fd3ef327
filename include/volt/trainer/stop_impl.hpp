#pragma once
/// \file
/// Part of volt/trainer.hpp, included at its end: stopping a fit at a training batch boundary, on a stop signal
/// (SIGTERM, SIGINT, the requeue signal) or when max_time has passed: the agreement between ranks, the checkpoint and
/// where it goes, the SLURM requeue. Not a header of its own: include volt/trainer.hpp.

#include "volt/detail/clock_text.hpp"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace volt {
namespace detail {

/// A callback that finds a fit's checkpoints for `fit(..., "last")` (ModelCheckpoint), as resolve_ckpt_path asks.
template <class C, class T>
concept FindsLastCheckpoint = requires(const C& c, const T& t) {
  c.find_last_checkpoint(t);
  c.find_best_checkpoint(t);
};

}  // namespace detail

/// At a training batch boundary: every rank reads its signal flag, rank zero its clock against max_time (once
/// min_epochs and min_steps are met, as Lightning's Timer), and all
/// agree in one host collective (twice the largest signal number, plus one for the time: one rank's signal stops
/// all, and a signal wins over the time). Either way a full checkpoint where "last" finds it and the loggers
/// flushed; on a signal a SLURM job requeued when asked, then volt::Interrupted to the top of fit (SignalOptions);
/// on max_time detail::TimeUp, which ends the fit as a finished one.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::stop_if_asked() {
  const bool timed = options_.max_time.has_value();
  if (!options_.signals.enabled && !timed) return;
  const bool time_up = timed && strategy_.is_global_zero() && can_stop_early() &&
                       progress_.time_elapsed() >= std::chrono::duration<double>(*options_.max_time).count();
  const int code = strategy_.host_max((options_.signals.enabled ? cluster::pending_signal() : 0) * 2 + (time_up ? 1 : 0));
  if (code == 0) return;
  const int sig = code / 2;
  const std::string path = strategy_.host_all_gather(signal_checkpoint_path())[0];  // rank zero's file names it
  if (sig == 0) progress_.stopped_in_batch = progress_.in_train_batch;  // later saves resume after this batch too
  save_checkpoint(path, /*weights_only=*/false);
  flush_loggers();
  constexpr bool finds_last = (detail::FindsLastCheckpoint<Cs, Trainer> || ... || false);
  // "last" only where a callback finds checkpoints (ModelCheckpoint); the path always works.
  const std::string where = "stopped at epoch " + std::to_string(state_.current_epoch) + ", step " +
                            std::to_string(state_.global_step) + " and saved " + path + " (resume with fit(..., " +
                            (finds_last ? "\"last\") or fit(..., \"" : "\"") + path + "\")).";
  if (sig == 0) {
    const double limit = std::chrono::duration<double>(*options_.max_time).count();
    throw detail::TimeUp{"volt: max_time (" + detail::clock_text(limit) + ") reached; " + where};
  }
  std::string requeue;
  if (strategy_.is_global_zero() && cluster::should_requeue(options_.signals, sig)) {
    const std::string failed = cluster::requeue_slurm_job(options_.signals);
    requeue = failed.empty() ? " SLURM job " + std::string(std::getenv("SLURM_JOB_ID")) + " requeued."
                             : " The SLURM job could not be requeued: " + failed + ".";
  }
  throw Interrupted(sig, path, "volt: " + cluster::signal_name(sig) + " received; " + where + requeue +
                                   (options_.signals.exit_process
                                        ? " Exiting with status " + std::to_string(128 + sig) + "."
                                        : ""));
}

/// Where a stop signal's checkpoint goes: the first callback that finds checkpoints and names a place for it
/// (ModelCheckpoint: `<its folder>/interrupted.ckpt`), else `<default_root_dir>/checkpoints/interrupted.ckpt`
/// (`interrupted-v1.ckpt`, ... where another run's file, not the one this fit resumed from, has that name).
template <class S, class P, class A, class... Cs>
std::string Trainer<S, P, A, Cs...>::signal_checkpoint_path() const {
  std::string path = detail::first_answer<std::string>(callbacks_, [this](const auto& c)
    requires requires { { c.signal_checkpoint_path(*this) } -> std::convertible_to<std::string>; }
  { return c.signal_checkpoint_path(*this); });
  if (path.empty()) {  // another run's file of that name is kept: interrupted-v1.ckpt, ...
    path = checkpoint::free_checkpoint_path(std::filesystem::path(options_.default_root_dir) / "checkpoints", "interrupted",
                                            true, [&](const std::string& p) {
                                              return !ckpt_path_.empty() && checkpoint::same_path(p, ckpt_path_);
                                            });
  }
  return path;
}

}  // namespace volt
