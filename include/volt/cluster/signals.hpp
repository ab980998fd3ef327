#pragma once
/// \file
/// Stopping a fit on a signal (TrainerOptions::signals, SignalOptions in volt/options.hpp): the handler that
/// only sets a flag, the scope that installs it for the length of a fit, the `volt::Interrupted` outcome that
/// carries the signal and the checkpoint to the top of `fit`, and SLURM's requeue.
///
/// The handler is async-signal-safe: it stores the signal number in a `sig_atomic_t`. The loops read it at
/// training batch boundaries (the Trainer agrees on it across ranks). A second signal while the first is still
/// pending ends the process at once: the handler puts the default action back and raises the signal again
/// (after killing the worker processes a Spawn main process forwards to).

#include "volt/errors.hpp"
#include "volt/options.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace volt {

namespace cluster {

/// "SIGTERM", "SIGINT", "SIGUSR1", ... ("signal N" for others).
inline std::string signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGHUP: return "SIGHUP";
    case SIGQUIT: return "SIGQUIT";
    default: return "signal " + std::to_string(sig);
  }
}

namespace detail {
inline volatile std::sig_atomic_t pending_signal = 0;
/// Processes a Spawn main process forwards to, killed at once on a second signal.
inline constexpr int kMaxForward = 256;
inline std::array<volatile pid_t, kMaxForward> forward_pids{};
inline volatile std::sig_atomic_t forward_count = 0;

inline void on_signal(int sig) {
  if (pending_signal != 0) {  // a second signal: end now
    for (int i = 0; i < forward_count; ++i) ::kill(forward_pids[static_cast<std::size_t>(i)], SIGKILL);
    ::signal(sig, SIG_DFL);
    ::raise(sig);  // delivered when the handler returns, with the default action
    return;
  }
  pending_signal = sig;
}
}  // namespace detail

/// The signal received since the running fit installed its handlers (0: none).
inline int pending_signal() { return detail::pending_signal; }

/// Installs the stop handlers for SIGTERM, SIGINT and `options.requeue_signal` for its lifetime and puts the
/// earlier ones back at the end. Does nothing when `options.enabled` is false.
class SignalScope {
 public:
  explicit SignalScope(const SignalOptions& options) {
    if (!options.enabled) return;
    detail::pending_signal = 0;
    detail::forward_count = 0;
    install(SIGTERM);
    install(SIGINT);
    if (options.requeue_signal != 0) install(options.requeue_signal);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;
  ~SignalScope() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) ::sigaction(it->first, &it->second, nullptr);
    detail::forward_count = 0;
  }

  /// Also ends `pid` at once if a second signal comes (a Spawn worker this process forwards the first to).
  static void forward_to(pid_t pid) {
    if (detail::forward_count < detail::kMaxForward) {
      detail::forward_pids[static_cast<std::size_t>(detail::forward_count)] = pid;
      detail::forward_count = detail::forward_count + 1;
    }
  }

 private:
  void install(int sig) {
    struct sigaction action {};
    action.sa_handler = &detail::on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    struct sigaction old {};
    if (::sigaction(sig, &action, &old) == 0) saved_.emplace_back(sig, old);
  }

  std::vector<std::pair<int, struct sigaction>> saved_;
};

/// Whether a stop on `sig` requeues the job: SLURM's job id is set, auto_requeue is on, and the signal is
/// SIGTERM or the requeue signal (Ctrl-C never requeues).
inline bool should_requeue(const SignalOptions& options, int sig) {
  const char* job = std::getenv("SLURM_JOB_ID");
  return options.auto_requeue && job != nullptr && *job != '\0' && sig != SIGINT;
}

/// Runs `<options.scontrol> requeue $SLURM_JOB_ID` (looked up on PATH unless it names a path) and waits up to 60 s.
/// Returns "" on success, else what went wrong.
///
/// scontrol starts with the stop signals blocked (SIGTERM, SIGINT, the requeue signal): it is part of the job step,
/// and the signal that stops the fit can reach this host after another rank's copy already did (the ranks agree on
/// the first), so SLURM's delivery to every process of the step would otherwise end scontrol before it requeues.
inline std::string requeue_slurm_job(const SignalOptions& options) {
  const std::string& scontrol = options.scontrol;
  const char* job = std::getenv("SLURM_JOB_ID");
  if (job == nullptr || *job == '\0') return "SLURM_JOB_ID is not set";
  std::string a0 = scontrol, a1 = "requeue", a2 = job;
  char* argv[] = {a0.data(), a1.data(), a2.data(), nullptr};
  posix_spawnattr_t attr;
  ::posix_spawnattr_init(&attr);
  sigset_t blocked;
  sigemptyset(&blocked);
  for (const int sig : {SIGTERM, SIGINT, options.requeue_signal}) {
    if (sig != 0) sigaddset(&blocked, sig);
  }
  ::posix_spawnattr_setsigmask(&attr, &blocked);
  ::posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, scontrol.c_str(), nullptr, &attr, argv, environ);
  ::posix_spawnattr_destroy(&attr);
  if (rc != 0) return "could not start " + scontrol + ": " + std::string(std::strerror(rc));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return "waiting for scontrol failed";
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return scontrol + " requeue " + std::string(job) + " did not finish in 60 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return scontrol + " requeue " + std::string(job) + " ended with status " +
         std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

}  // namespace cluster
}  // namespace volt
