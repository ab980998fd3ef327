#pragma once
/// \file
/// Where this process stands in a job that something else started: rank, world size and local rank, read from the
/// variables of the launcher that started it: Open MPI (`mpirun`, also inside a SLURM allocation, where the
/// `SLURM_PROCID` a rank sees is that of Open MPI's daemon), PMIx (`srun --mpi=pmix`), SLURM (`srun`) or torchrun.
/// `Source::none` means no launcher is around: volt's own launchers create the processes.
///
/// The node rank is not read here: Open MPI has no variable for it, and `rank / local size` holds only for by-slot
/// mapping. The process group finds both local and node rank from every member's host name
/// (`detail::place`, comm/hosts.hpp), whatever the mapping.

#include "volt/options.hpp"

#include <cstdlib>
#include <optional>
#include <string>

namespace volt::cluster {

enum class Source { none, open_mpi, slurm, torchrun };

inline const char* to_string(Source s) {
  switch (s) {
    case Source::none: return "none";
    case Source::open_mpi: return "Open MPI";
    case Source::slurm: return "SLURM";
    case Source::torchrun: return "torchrun";
  }
  return "?";
}

struct Environment {
  Source source = Source::none;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;

  /// Whether an outside launcher started this process (mpirun, srun, torchrun).
  bool launched_externally() const { return source != Source::none; }
};

namespace detail {
inline std::optional<int> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0') {
    throw ConfigError(std::string("volt: the environment variable ") + name + "=\"" + v + "\" is not an integer.");
  }
  return static_cast<int>(x);
}
}  // namespace detail

/// Set (through MPI_Info "env") in the processes volt's launchers start: "script" or "spawn".
inline constexpr const char* kRoleVariable = "VOLT_LAUNCH_ROLE";

/// The role volt's launcher gave this process; "" when it was not started by one.
inline std::string launch_role() {
  const char* v = std::getenv(kRoleVariable);
  return v == nullptr ? std::string() : std::string(v);
}

/// Reads the environment. Open MPI first (it also covers processes spawned by volt's launchers), then
/// SLURM (inside an `srun` step), then torchrun.
inline Environment detect() {
  using detail::env_int;
  Environment e;
  if (auto size = env_int("OMPI_COMM_WORLD_SIZE")) {
    e.source = Source::open_mpi;
    e.world_size = *size;
    e.rank = env_int("OMPI_COMM_WORLD_RANK").value_or(0);
    e.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
  } else if (auto size = env_int("PMIX_SIZE"); size && env_int("PMIX_RANK")) {
    e.source = Source::open_mpi;
    e.world_size = *size;
    e.rank = *env_int("PMIX_RANK");
    e.local_rank = env_int("PMIX_LOCAL_RANK").value_or(0);
  } else if (auto size = env_int("SLURM_STEP_NUM_TASKS"); size && env_int("SLURM_PROCID")) {
    e.source = Source::slurm;
    e.world_size = *size;
    e.rank = *env_int("SLURM_PROCID");
    e.local_rank = env_int("SLURM_LOCALID").value_or(0);
  } else if (auto size = env_int("WORLD_SIZE"); size && env_int("RANK")) {
    e.source = Source::torchrun;
    e.world_size = *size;
    e.rank = *env_int("RANK");
    e.local_rank = env_int("LOCAL_RANK").value_or(0);
  }
  return e;
}

/// Throws when the settings contradict the launch: devices × num_nodes must equal the world size.
inline void check_against(const Environment& e, int devices, int num_nodes) {
  if (!e.launched_externally()) return;
  if (static_cast<long>(devices) * num_nodes != e.world_size) {
    throw ConfigError("volt: " + std::string(to_string(e.source)) + " started " + std::to_string(e.world_size) +
                      " processes, but devices=" + std::to_string(devices) + " x num_nodes=" +
                      std::to_string(num_nodes) + " = " + std::to_string(static_cast<long>(devices) * num_nodes) +
                      ". Start devices x num_nodes processes, or set devices and num_nodes to match the launch.");
  }
}

}  // namespace volt::cluster
