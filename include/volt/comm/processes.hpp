#pragma once
/// \file
/// The processes of a distributed job as MPI sees them, and the process-level steps volt's launchers are made
/// of: this process's place (`Processes`), the role a launcher gave it (`VOLT_LAUNCH_ROLE`), running a body as a
/// rank so that a failure reaches the other ranks, and starting copies of this program (`MPI_Comm_spawn`).

#include "volt/cluster/cpus.hpp"
#include "volt/cluster/environment.hpp"
#include "volt/cluster/signals.hpp"
#include "volt/comm/runtime.hpp"

#include <mpi.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace volt {
namespace detail {

/// This process's place in the running job. `group` is null in a world of one that needs no MPI.
struct Processes {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int node_rank = 0;
  MpiGroup* group = nullptr;

  static Processes of(MpiGroup& g) { return {g.rank(), g.size(), g.local_rank(), g.node_rank(), &g}; }
};

// The role a launcher gave this process (VOLT_LAUNCH_ROLE): cluster/environment.hpp.
using cluster::kRoleVariable;
using cluster::launch_role;

/// Runs `body` as this process's rank. An exception other than RankFailure is announced to the other
/// members before it propagates, so they stop waiting and end with its message.
template <class F>
decltype(auto) run_as_rank(const Processes& procs, F&& body) {
  try {
    return std::forward<F>(body)();
  } catch (const RankFailure&) {
    throw;
  } catch (const Interrupted&) {
    throw;  // every rank agreed on the stop: nobody is waiting for a failure notice
  } catch (const std::exception& e) {
    if (procs.group != nullptr && procs.group->size() > 1) {
      procs.group->announce_failure("volt: rank " + std::to_string(procs.rank) + " failed: " + e.what());
    }
    throw;
  } catch (...) {
    if (procs.group != nullptr && procs.group->size() > 1) {
      procs.group->announce_failure("volt: rank " + std::to_string(procs.rank) + " failed with a non-standard exception.");
    }
    throw;
  }
}

/// This program's path and arguments (argv[1..]), as the kernel knows them.
inline std::pair<std::string, std::vector<std::string>> own_command_line() {
  std::vector<char> exe(4096);
  const ssize_t n = ::readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  if (n <= 0) throw std::runtime_error("volt: cannot read /proc/self/exe to start copies of this program.");
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::size_t start = 0;
  while (start < all.size()) {
    const std::size_t end = all.find('\0', start);
    args.emplace_back(all.substr(start, end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (!args.empty()) args.erase(args.begin());  // argv[0]
  return {std::string(exe.data(), static_cast<std::size_t>(n)), args};
}

/// Before MPI starts in a process that will start others: let Open MPI place more ranks than cores
/// (a run asked for them; the user may still override the variable).
inline void allow_oversubscription() { ::setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", /*overwrite=*/0); }

/// Starts `count` copies of this program with the same arguments (MPI_Comm_spawn, from this process
/// alone) and returns the intercommunicator to them. The copies see `VOLT_LAUNCH_ROLE=role` and, unless the
/// environment sets OMP_NUM_THREADS, `OMP_NUM_THREADS` of their share of this host's cores among the `ranks_on_host`
/// processes that train (cluster/cpus.hpp). They are not bound to cores (Open MPI would bind each to one, the same one
/// for every copy started alone) unless OMPI_MCA_hwloc_base_binding_policy asks for a binding.
inline MPI_Comm spawn_copies(int count, const char* role, int ranks_on_host) {
  auto [exe, args] = own_command_line();
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  MPI_Info info;
  MPI_Info_create(&info);
  std::string env = std::string(kRoleVariable) + "=" + role;
  if (const auto threads = threads_per_started_rank(ranks_on_host)) {
    env += "\nOMP_NUM_THREADS=" + std::to_string(*threads);
  }
  MPI_Info_set(info, "env", env.c_str());  // newline-separated NAME=value pairs
  if (std::getenv("OMPI_MCA_hwloc_base_binding_policy") == nullptr) MPI_Info_set(info, "bind_to", "none");
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
  MPI_Comm inter = MPI_COMM_NULL;
  std::vector<int> codes(static_cast<std::size_t>(count), MPI_SUCCESS);
  const int rc = MPI_Comm_spawn(exe.c_str(), argv.data(), count, info, 0, MPI_COMM_SELF, &inter, codes.data());
  MPI_Info_free(&info);
  mpi_check(rc, ("MPI_Comm_spawn of " + std::to_string(count) + " copies of " + exe).c_str());
  for (int c : codes) mpi_check(c, ("starting a copy of " + exe).c_str());
  return inter;
}

}  // namespace detail
}  // namespace volt
