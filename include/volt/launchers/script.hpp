#pragma once
/// \file
/// `volt::Script`: every process runs the whole program, as Lightning's `ddp` strategy.
///  - Under `mpirun -np N` or `srun` (or any Open MPI/SLURM launch) it just runs; the environment must
///    agree with `devices × num_nodes`.
///  - Started plainly with `devices = N > 1`, the process starts the other N-1 copies of itself with the same
///    arguments (Open MPI's `MPI_Comm_spawn`) and is rank 0; the copies are ranks 1..N-1. One machine only:
///    for `num_nodes > 1`, use mpirun or srun. Unless OMP_NUM_THREADS is set, each of the N runs its share of the
///    cores in intra-op threads (rank 0 through `at::set_num_threads`); none is bound to cores.
/// The job is made once per process and serves every later run (fit, validate, test, predict).

#include "volt/cluster/environment.hpp"
#include "volt/launchers/concept.hpp"

#include <ATen/Parallel.h>

#include <memory>
#include <string>

namespace volt {

class Script {
 public:
  static constexpr const char* name = "Script";
  /// Joins a job that mpirun/srun started (and checks devices x num_nodes against it).
  static constexpr bool joins_external_jobs = true;

  template <class F, class T>
  decltype(auto) launch(const LaunchSpec& spec, detail::Processes& procs, F&& body, T* /*transfer*/) {
    procs = detail::Processes::of(job(spec));
    procs.group->set_timeout(spec.timeout);
    return detail::run_as_rank(procs, std::forward<F>(body));
  }

 private:
  /// The process-wide job, made on the first launch.
  static detail::MpiGroup& job(const LaunchSpec& spec) {
    static detail::MpiGroup* group = nullptr;
    const int wanted = spec.devices * spec.num_nodes;
    if (group != nullptr) {
      if (group->size() != wanted) {
        throw ConfigError("volt: this process already runs in a job of " + std::to_string(group->size()) +
                          " processes, but a " + spec.strategy + "<Script> run asks for devices x num_nodes = " +
                          std::to_string(wanted) + ". Use the same devices and num_nodes for every Script run.");
      }
      return *group;
    }
    auto& runtime = detail::MpiRuntime::instance();
    const std::string role = detail::launch_role();
    if (role == "spawn") {
      throw ConfigError(std::string("volt: a ") + spec.strategy +
                        "<Script> run was reached in a DDP<Spawn> worker (code before fit runs in every worker). "
                        "Guard it with `if (!volt::Spawn::is_worker())`, or use one launcher in the program.");
    }
    if (role == "script") {  // a copy started by rank 0 below
      runtime.ensure_initialized();
      MPI_Comm parent = runtime.parent();
      if (parent == MPI_COMM_NULL) {
        throw std::runtime_error("volt: VOLT_LAUNCH_ROLE=script is set, but this process has no MPI parent.");
      }
      MPI_Comm merged;
      detail::mpi_check(MPI_Intercomm_merge(parent, /*high=*/1, &merged), "MPI_Intercomm_merge");
      runtime.disconnect_at_exit(parent);
      runtime.close_at_exit([merged]() mutable { MPI_Comm_free(&merged); });
      group = new detail::MpiGroup(merged);
      return *group;
    }
    const cluster::Environment env = cluster::detect();
    if (env.launched_externally()) {
      cluster::check_against(env, spec.devices, spec.num_nodes);
      runtime.ensure_initialized();
      int size = 0;
      MPI_Comm_size(MPI_COMM_WORLD, &size);
      if (size != env.world_size) {
        throw ConfigError("volt: " + std::string(cluster::to_string(env.source)) + " says the world has " +
                          std::to_string(env.world_size) + " processes, but MPI sees " + std::to_string(size) +
                          ": they are not one MPI job. Start them with `mpirun -np " + std::to_string(env.world_size) +
                          "` or `srun`.");
      }
      group = new detail::MpiGroup(MPI_COMM_WORLD);
      return *group;
    }
    if (spec.num_nodes > 1) {
      throw ConfigError("volt: num_nodes=" + std::to_string(spec.num_nodes) +
                        " but no launcher started this process; Script starts copies on this machine only. Start the "
                        "job with `mpirun` or `srun` across the nodes.");
    }
    if (wanted > 1) detail::allow_oversubscription();
    runtime.ensure_initialized();
    if (wanted == 1) {
      group = new detail::MpiGroup(MPI_COMM_SELF);
      return *group;
    }
    if (const auto threads = detail::threads_per_started_rank(wanted)) at::set_num_threads(*threads);  // rank 0's share
    MPI_Comm inter = detail::spawn_copies(wanted - 1, "script", wanted);
    MPI_Comm merged;
    detail::mpi_check(MPI_Intercomm_merge(inter, /*high=*/0, &merged), "MPI_Intercomm_merge");
    runtime.disconnect_at_exit(inter);
    runtime.close_at_exit([merged]() mutable { MPI_Comm_free(&merged); });
    group = new detail::MpiGroup(merged);
    return *group;
  }
};

}  // namespace volt
