#pragma once
/// \file
/// What makes a CPU run much slower than it should be without anything saying so, read off the running process:
/// the BLAS that LibTorch's matrix products (linear layers, matmul, im2col convolutions) land in, and LibTorch's
/// intra-op threads against the CPUs this process and the other ranks on its host may use (affinity, cgroup cpuset,
/// cgroup CPU quota). `CPU::slow_settings` hands the sentences to the Trainer, which says them once per process when
/// its first run sets up (trainer/run_impl.hpp); `volt::blas_info()` is also what the benchmarks record.
///
/// | finding | when | what it costs |
/// |---|---|---|
/// | the reference BLAS | `sgemm_` comes from netlib's `libblas.so.3` (Debian's `libblas3`) | 15x on an MLP's Fp32 step |
/// | bound to few cores | the affinity covers at most half of the rank's share (not said in a SLURM job) | idle cores |
/// | too few threads | intra-op threads at most half of the cores the rank may use (its share, its affinity) | idle cores |
/// | oversubscribed | more threads than the logical CPUs a rank can have (affinity, share) | OpenMP teams spin |
///
/// A rank's share is the job's cores on its host (cluster/cpus.hpp: the cgroup's cpuset, else the online CPUs; capped
/// by the cgroup's CPU quota) over the ranks there. The findings concern the CPU accelerator only.

#include "volt/cluster/cpus.hpp"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace volt {

/// The BLAS whose `sgemm_` this process calls.
struct BlasInfo {
  /// "MKL" (inside LibTorch, as pip's wheels), "OpenBLAS (OpenMP)" (or "(pthreads)", "(serial)"), "BLIS",
  /// "FlexiBLAS", "Arm Performance Libraries", "ATLAS", "reference" (netlib's), "unknown" (a library volt does not
  /// recognise), or "none" (no `sgemm_` in the process).
  std::string name;
  /// The file that provides `sgemm_` (symbolic links resolved), or "" where it is LibTorch's own MKL or none.
  std::string library;
  bool reference() const { return name == "reference"; }
};

namespace detail {

/// OpenBLAS's threading, from its own `openblas_get_parallel` (0 serial, 1 pthreads, 2 OpenMP) where it exports it.
inline std::string openblas_threading(void* lib) {
  using GetParallel = int (*)();
  const auto get = reinterpret_cast<GetParallel>(::dlsym(lib, "openblas_get_parallel"));
  if (get == nullptr) return "OpenBLAS";
  const int parallel = get();
  return parallel == 2 ? "OpenBLAS (OpenMP)" : parallel == 1 ? "OpenBLAS (pthreads)" : "OpenBLAS (serial)";
}

/// The name of the BLAS in `file` (opened as `lib`) from a symbol only that library (or one it loads) exports; "" when
/// none is found.
inline std::string blas_by_marker(void* lib) {
  if (::dlsym(lib, "openblas_get_config") != nullptr) return openblas_threading(lib);
  const std::pair<const char*, const char*> markers[] = {{"MKL_Get_Version_String", "MKL"},
                                                         {"bli_info_get_version_str", "BLIS"},
                                                         {"flexiblas_current_backend", "FlexiBLAS"},
                                                         {"armplversion", "Arm Performance Libraries"},
                                                         {"ATL_buildinfo", "ATLAS"}};
  for (const auto& [symbol, name] : markers) {
    if (::dlsym(lib, symbol) != nullptr) return name;
  }
  return "";
}

}  // namespace detail

/// Which library provides `sgemm_` in this process (`dlsym` then `dladdr`), told apart by a symbol only that library
/// (or one it loads) exports, else by the file itself, symbolic links resolved (Debian reaches every provider through
/// the alias `libblas.so.3`): netlib's reference BLAS is Debian's `.../blas/libblas.so.3.*`, or a `libblas.so.3.*` in
/// `lib` or `lib64` elsewhere; ATLAS's lives in `.../atlas/`. LibTorch built with MKL (pip's) multiplies there,
/// whatever else is loaded.
inline BlasInfo blas_info() {
  if (at::hasMKL()) return {"MKL", ""};
  void* sgemm = ::dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info where{};
  if (sgemm == nullptr || ::dladdr(sgemm, &where) == 0 || where.dli_fname == nullptr) return {"none", ""};
  std::error_code ec;
  std::filesystem::path file = std::filesystem::canonical(where.dli_fname, ec);
  if (ec) file = where.dli_fname;
  BlasInfo info{"unknown", file.string()};
  if (void* lib = ::dlopen(where.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
    std::string name = detail::blas_by_marker(lib);
    ::dlclose(lib);
    if (!name.empty()) {
      info.name = std::move(name);
      return info;
    }
  }
  const std::string folder = file.parent_path().filename().string();
  if (folder == "atlas") {
    info.name = "ATLAS";
  } else if (file.filename().string().rfind("libblas.so", 0) == 0 &&
             (folder == "blas" || folder == "lib" || folder == "lib64")) {
    info.name = "reference";  // netlib's libblas3 exports no marker of its own
  }
  return info;
}

namespace detail {

/// The numbers a CPU run's speed depends on, read off this process. CPUs are logical (hyper-threads count); cores
/// are physical, which LibTorch's default thread count follows.
struct CpuView {
  int threads = 1;               ///< LibTorch's intra-op threads (`at::get_num_threads()`)
  int affinity = 1;              ///< CPUs this process may run on (`sched_getaffinity`)
  int affinity_cores = 1;        ///< ... and the cores they sit on
  int host = 1;                  ///< CPUs of the host this job may use: its cgroup's cpuset, else the online CPUs
  int host_cores = 1;            ///< ... and the cores they sit on
  std::optional<int> quota;      ///< CPUs' worth of time the cgroup's quota allows (rounded up), if limited
  int ranks = 1;                 ///< processes of this job on this host
  std::optional<std::string> omp_num_threads;  ///< the environment's OMP_NUM_THREADS, if set
  bool under_mpirun = false;     ///< started by mpirun (OMPI_COMM_WORLD_SIZE), which may have bound it
  bool under_scheduler = false;  ///< a SLURM job (SLURM_JOB_ID): its binding is the allocation, not a mistake
};

/// This process as it runs now, `ranks` of its job on this host.
inline CpuView read_cpu_view(int ranks) {
  CpuView v;
  v.threads = at::get_num_threads();
  const HostCpus cpus = read_host_cpus();
  v.host = std::max<int>(1, static_cast<int>(cpus.host.size()));
  v.host_cores = std::max(1, count_cores(cpus.host));
  v.affinity = std::max<int>(1, static_cast<int>(cpus.mine.size()));
  v.affinity_cores = std::max(1, count_cores(cpus.mine));
  v.quota = cgroup_cpu_quota();
  v.ranks = std::max(1, ranks);
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) v.omp_num_threads = omp;
  v.under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  v.under_scheduler = std::getenv("SLURM_JOB_ID") != nullptr;
  return v;
}

/// Where LibTorch's thread count came from, in a few words: the environment, or (unset) a call or LibTorch's own count
/// of the cores, which reads low on some virtual machines and knows nothing of other ranks or a cgroup's quota.
inline std::string thread_source(const CpuView& v) {
  if (v.omp_num_threads) return "OMP_NUM_THREADS=" + *v.omp_num_threads + " is set";
  return "OMP_NUM_THREADS unset";
}

/// The sentence for threads, if any: one short line. Each rank's fair share is the job's cores on this host (cpuset,
/// quota) over its ranks there: bound to at most half of it, or running at most half of what it may use in threads,
/// leaves cores idle (cores, as LibTorch's default counts them: a second hyper-thread adds little to dense math); more
/// threads than the logical CPUs a rank can have (its affinity, its share) makes OpenMP teams spin against each other.
inline std::vector<std::string> thread_findings(const CpuView& v) {
  const int cpus = v.quota ? std::min(v.host, *v.quota) : v.host;
  const int cores = v.quota ? std::min(v.host_cores, *v.quota) : v.host_cores;
  const int fair = std::max(1, cores / v.ranks);
  const int usable = std::min(fair, v.affinity_cores);
  const int share = std::max(1, std::min(v.affinity, cpus / v.ranks));
  const auto n = [](int k, const char* what) { return std::to_string(k) + " " + what + (k == 1 ? "" : "s"); };
  const std::string on_host = n(cores, "core") + (v.quota && *v.quota < v.host_cores ? " (its cgroup's quota)" : "") +
                              (v.ranks > 1 ? " for " + std::to_string(v.ranks) + " ranks" : "") + " here";
  if (2 * v.affinity_cores <= fair && !v.under_scheduler) {
    return {"this process may run on " + n(v.affinity_cores, "core") + " only (its CPU affinity; the job has " +
            on_host + "): " +
            (v.under_mpirun ? "pass mpirun --bind-to none, or --map-by slot:PE=" + std::to_string(fair) + "."
                            : "start it unbound (taskset, numactl), or bound to " + n(fair, "core") + ".")};
  }
  if (2 * v.threads <= usable) {
    return {"LibTorch runs " + n(v.threads, "intra-op thread") + " while this process may use " + n(usable, "core") +
            " (" + thread_source(v) + "); set OMP_NUM_THREADS=" + std::to_string(usable) + "."};
  }
  if (v.threads > share) {
    return {"LibTorch runs " + n(v.threads, "intra-op thread") + " per process where each may have " +
            n(share, "CPU") + " (" + on_host + "; " + thread_source(v) + "); set OMP_NUM_THREADS=" +
            std::to_string(share) + " for each rank."};
  }
  return {};
}

/// The sentence for a reference BLAS, or none.
inline std::vector<std::string> blas_findings(const BlasInfo& blas) {
  if (!blas.reference()) return {};
  return {"LibTorch does its matrix products (linear layers, matmul, convolutions not run by oneDNN) on the reference "
          "BLAS (" + blas.library + "), unoptimised Fortran: they run 10-15x slower than with an optimised one (an "
          "MLP's step 15x, the quick start's epoch 3x). On Debian or Ubuntu: apt-get install libopenblas0-openmp, which "
          "takes over libblas.so.3 for every program (update-alternatives --config libblas.so.3-x86_64-linux-gnu "
          "where the alternative was set by hand)."};
}

}  // namespace detail

/// Every setting found that makes a CPU fit much slower than it should be, one sentence each (empty: none), for a
/// process with `ranks_on_host` ranks of its job on its host.
inline std::vector<std::string> cpu_slow_settings(int ranks_on_host) {
  auto out = detail::blas_findings(blas_info());
  for (auto& s : detail::thread_findings(detail::read_cpu_view(ranks_on_host))) out.push_back(std::move(s));
  return out;
}

}  // namespace volt
