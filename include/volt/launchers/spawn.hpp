#pragma once
/// \file
/// `volt::Spawn`: only `fit` runs in `devices` fresh worker processes, as Lightning's `ddp_spawn`.
///
/// The workers are new processes of the same program with the same arguments (Open MPI's
/// `MPI_Comm_spawn`); the main process is not a rank, never builds the job's devices, and waits. So:
///  - **Code before `fit` runs in every worker too** (the program starts from `main`); when a worker's
///    `fit` ends, the worker exits, so code after `fit` runs in the main process only. Guard work that
///    must happen once with `if (!volt::Spawn::is_worker())`.
///  - When `fit` returns in the main process, the module holds rank 0's trained weights, and the result holds
///    rank 0's logged metrics and best checkpoint path.
///  - `fit` may be called once per process with Spawn (a second call would repeat the first in the workers),
///    and not inside an mpirun/srun job (each process would start its own workers): both throw.
///  - `validate`, `test` and `predict` run in the calling process as a world of one.
///  - Unless OMP_NUM_THREADS is set, each worker runs its share of the cores (the cores over `devices`) in
///    intra-op threads; workers are not bound to cores.
///  - A worker that fails ends the others; `fit` throws `volt::RankFailure` with its message in the main process.
///  - A stop signal (SignalOptions) sent to the main process is forwarded to the workers; they checkpoint and
///    tell the main process, which then ends as they do (exit status 128 + the signal). One sent to a worker
///    stops them all the same way.

#include "volt/cluster/environment.hpp"
#include "volt/launchers/concept.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace volt {

class Spawn {
 public:
  static constexpr const char* name = "Spawn";
  /// Refuses to run inside a job that mpirun/srun started.
  static constexpr bool joins_external_jobs = false;

  /// Whether this process is one of the workers a Spawn launch started.
  static bool is_worker() { return detail::launch_role() == "spawn"; }

  /// Runs other than fit: here, as a world of one.
  template <class F>
  decltype(auto) launch(const LaunchSpec&, detail::Processes& procs, F&& body, detail::NoTransfer*) {
    procs = detail::Processes{};
    return std::forward<F>(body)();
  }

  /// fit: in the workers, or (in the main process) start them and bring rank 0's result back.
  template <class F, class T>
  auto launch(const LaunchSpec& spec, detail::Processes& procs, F&& body, T* transfer) -> decltype(body()) {
    if (is_worker()) run_worker(spec, procs, std::forward<F>(body), *transfer);
    return run_main(spec, *transfer);
  }

 private:
  template <class F, class T>
  [[noreturn]] static void run_worker(const LaunchSpec& spec, detail::Processes& procs, F&& body, T& transfer) {
    auto& runtime = detail::MpiRuntime::instance();
    runtime.ensure_initialized();
    MPI_Comm parent = runtime.parent();
    if (parent == MPI_COMM_NULL) {
      throw std::runtime_error("volt: VOLT_LAUNCH_ROLE=spawn is set, but this process has no MPI parent.");
    }
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    auto* group = new detail::MpiGroup(MPI_COMM_WORLD, parent);
    group->set_timeout(spec.timeout);
    procs = detail::Processes::of(*group);
    const int pid = static_cast<int>(::getpid());
    MPI_Send(&pid, static_cast<int>(sizeof pid), MPI_BYTE, 0, detail::kHelloTag, parent);
    try {
      auto result = detail::run_as_rank(procs, std::forward<F>(body));
      MPI_Request request;
      detail::mpi_check(MPI_Ibarrier(group->comm(), &request), "MPI_Ibarrier");
      group->wait(request);  // every worker finished: no failure can follow the result
      if (rank == 0) {
        const std::string bytes = transfer.pack(result);
        MPI_Request send;
        detail::mpi_check(MPI_Isend(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, 0, detail::kResultTag, parent, &send),
                          "MPI_Isend");
        group->wait(send);
      }
    } catch (const Interrupted& stop) {
      // Every worker agreed on the stop and the checkpoint is written: rank 0 tells the main process.
      MPI_Request request;
      detail::mpi_check(MPI_Ibarrier(group->comm(), &request), "MPI_Ibarrier");
      group->wait(request);
      if (rank == 0) {
        const std::string note = std::to_string(stop.signal()) + " " + stop.checkpoint();
        MPI_Request send;
        detail::mpi_check(MPI_Isend(note.data(), static_cast<int>(note.size()), MPI_BYTE, 0, detail::kInterruptedTag,
                                    parent, &send),
                          "MPI_Isend");
        group->wait(send);
      }
      MPI_Comm_disconnect(&parent);
      std::fflush(nullptr);
      std::exit(stop.exit_status());
    } catch (const RankFailure&) {
      std::fflush(nullptr);
      std::_Exit(1);  // another worker failed and told the main process
    } catch (const std::exception& e) {
      std::cerr << "volt: rank " << rank << " failed: " << e.what() << std::endl;
      std::fflush(nullptr);
      std::_Exit(1);
    } catch (...) {
      std::fflush(nullptr);
      std::_Exit(1);
    }
    MPI_Comm_disconnect(&parent);
    std::exit(0);  // finalises MPI at exit; code after fit belongs to the main process
  }

  /// Spawn can start workers here: the first fit of this process, not inside an outside job, on one machine.
  static void check_spawn_allowed(const LaunchSpec& spec, bool used) {
    if (used) {
      throw std::logic_error(
          "volt: fit was called a second time with DDP<Spawn> in this process. The workers start the program from "
          "the beginning, so they would repeat the first fit. Train in one fit call per process, or use DDP<Script>.");
    }
    const cluster::Environment env = cluster::detect();
    if (env.launched_externally()) {
      throw ConfigError(std::string("volt: ") + spec.strategy + "<Spawn> inside a job started by " +
                        cluster::to_string(env.source) + " (world size " + std::to_string(env.world_size) +
                        "): every process would start its own workers. Use " + spec.strategy +
                        "<Script> under mpirun/srun, or start the program plainly.");
    }
    if (spec.num_nodes > 1) {
      throw ConfigError("volt: num_nodes=" + std::to_string(spec.num_nodes) +
                        " with Spawn, which starts workers on this machine only. Use Script under mpirun or srun.");
    }
  }

  template <class T>
  auto run_main(const LaunchSpec& spec, T& transfer) {
    static bool used = false;
    check_spawn_allowed(spec, used);
    used = true;
    detail::allow_oversubscription();
    auto& runtime = detail::MpiRuntime::instance();
    runtime.ensure_initialized();
    cluster::SignalScope signals(spec.signals);  // forwarded to the workers, who stop and checkpoint
    int forwarded = 0;
    MPI_Comm workers = detail::spawn_copies(spec.devices, "spawn", spec.devices);

    std::vector<int> pids(static_cast<std::size_t>(spec.devices), 0);
    std::string result;
    bool have_result = false;
    int hellos = 0;
    auto next_check = std::chrono::steady_clock::now();
    while (!have_result) {
      if (const int sig = cluster::pending_signal(); sig != 0) {  // to every worker that has said hello, once
        for (; forwarded < static_cast<int>(pids.size()) && pids[static_cast<std::size_t>(forwarded)] > 0; ++forwarded) {
          ::kill(pids[static_cast<std::size_t>(forwarded)], sig);
        }
      }
      int flag = 0;
      MPI_Status status;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, workers, &flag, &status);
      if (!flag) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= next_check) {
          next_check = now + std::chrono::milliseconds(200);
          for (std::size_t r = 0; r < pids.size(); ++r) {
            if (detail::process_gone(pids[r])) {
              MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, workers, &flag, &status);
              if (flag) break;
              runtime.mark_failed();
              throw RankFailure(static_cast<int>(r), "volt: Spawn worker rank " + std::to_string(r) + " (pid " +
                                                         std::to_string(pids[r]) +
                                                         ") ended without a result or a message (killed or crashed).");
            }
          }
        }
        if (!flag) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          continue;
        }
      }
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      std::string bytes(static_cast<std::size_t>(count), '\0');
      MPI_Recv(bytes.data(), count, MPI_BYTE, status.MPI_SOURCE, status.MPI_TAG, workers, MPI_STATUS_IGNORE);
      if (status.MPI_TAG == detail::kHelloTag) {
        int pid = 0;
        std::memcpy(&pid, bytes.data(), sizeof pid);
        pids[static_cast<std::size_t>(status.MPI_SOURCE)] = pid;
        cluster::SignalScope::forward_to(pid);
        ++hellos;
      } else if (status.MPI_TAG == detail::kErrorTag || status.MPI_TAG == detail::kFailureTag) {
        runtime.mark_failed();
        throw RankFailure(status.MPI_SOURCE, bytes);
      } else if (status.MPI_TAG == detail::kResultTag) {
        result = std::move(bytes);
        have_result = true;
      } else if (status.MPI_TAG == detail::kInterruptedTag) {
        const auto space = bytes.find(' ');
        const int sig = std::atoi(bytes.substr(0, space).c_str());
        const std::string path = space == std::string::npos ? std::string() : bytes.substr(space + 1);
        MPI_Comm_disconnect(&workers);  // the workers' files are complete: they checkpointed and flushed first
        throw Interrupted(sig, path, "volt: the Spawn workers stopped on " + cluster::signal_name(sig) +
                                         " after writing " + path + ".");
      }
    }
    MPI_Comm_disconnect(&workers);
    return transfer.unpack(result);
  }
};

}  // namespace volt
