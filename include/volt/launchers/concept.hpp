#pragma once
/// \file
/// The Launcher kind: how the processes of a distributed run come to exist. A distributed strategy holds
/// its launcher as a template parameter (`DDP<Spawn>`), and the Trainer only calls the strategy's `launch`.
/// This table is every member volt calls:
///
/// | member | meaning |
/// |---|---|
/// | `static constexpr const char* name` | for messages |
/// | `static constexpr bool joins_external_jobs` | the launcher runs inside a job that mpirun/srun started (Script), so the strategy checks `devices x num_nodes` against it in phase (b); false: such a job is refused (Spawn) |
/// | `launch(const LaunchSpec&, detail::Processes&, body, detail::NoTransfer*) -> body's result` | validate/test/predict: runs `body` as a rank of the job (creating the job if needed) and fills `Processes` |
/// | `launch(const LaunchSpec&, detail::Processes&, body, T* transfer) -> body's result` | fit: the same, where `transfer` (detail/fit_transfer.hpp) packs rank 0's result in a worker and unpacks it in the calling process |
///
/// Launchers: `Script` (every process runs the whole program; starts the other copies itself when no
/// outside launcher did) and `Spawn` (only `fit` runs in fresh worker processes; results come back).
/// The process-level pieces they are built from (MPI_Comm_spawn, roles, failure announcements) are in
/// volt/comm/processes.hpp.

#include "volt/comm/processes.hpp"
#include "volt/options.hpp"
#include "volt/detail/fit_transfer.hpp"

#include <concepts>

namespace volt {

/// What a strategy asks its launcher for.
struct LaunchSpec {
  int devices = 1;
  int num_nodes = 1;
  const char* strategy = "DDP";
  /// How the processes stop on a signal (a Spawn main process forwards it to its workers).
  SignalOptions signals = {};
  /// How long a collective may wait (TrainerOptions::timeout).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
};

namespace detail {
/// A run body for the concept's probe.
struct LauncherProbeBody {
  FitResult operator()() const { return {}; }
};
}  // namespace detail

template <class L>
concept Launcher = std::default_initializable<L> &&
    requires(L& l, const LaunchSpec& spec, detail::Processes& procs, detail::NoTransfer* none) {
      { L::name } -> std::convertible_to<const char*>;
      { L::joins_external_jobs } -> std::convertible_to<bool>;
      l.launch(spec, procs, detail::LauncherProbeBody{}, none);
    };

namespace detail {
/// Stands in for a launcher slot that holds something else, after the strategy's static_assert has said so: it
/// meets the concept, so no error follows that sentence; it is never run.
struct NotALauncher {
  static constexpr const char* name = "(not a launcher)";
  static constexpr bool joins_external_jobs = false;
  template <class F, class T>
  auto launch(const LaunchSpec&, Processes&, F&& body, T*) -> decltype(body()) {
    return body();
  }
};
}  // namespace detail

}  // namespace volt
