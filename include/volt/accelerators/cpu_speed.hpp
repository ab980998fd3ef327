#pragma once
/// \file
/// What makes a CPU run much slower than it should be without anything saying so, read off the running process:
/// the BLAS that LibTorch's matrix products (linear layers, matmul, im2col convolutions) land in, and LibTorch's
/// intra-op threads against the CPUs this process and the other ranks on its host may use (affinity, cgroup cpuset,
/// cgroup CPU quota). `CPU::slow_settings` hands the sentences to the Trainer, which says them once per process when
/// its first run sets up (loops/run_impl.hpp); `volt::blas_info()` is also what the benchmarks record.
///
/// | finding | when | what it costs |
/// |---|---|---|
/// | the reference BLAS | `sgemm_` comes from netlib's `libblas.so.3` (Debian's `libblas3`) | 14x on an MLP's Fp32 step |
/// | bound to few cores | the process's affinity covers at most half of its share of the job's cores on the host | idle cores |
/// | too few threads | intra-op threads at most half of that share (OMP_NUM_THREADS, a call, LibTorch's own count) | idle cores |
/// | oversubscribed | more threads than the logical CPUs a rank can have (affinity, ranks on the host, cgroup quota) | OpenMP teams spinning against each other |
///
/// A rank's share is the job's cores on its host (the cgroup's cpuset, else the online CPUs; capped by a `cpu.max`
/// quota) over the ranks there. Findings are hints for the CPU accelerator only: a GPU fit's speed does not hang on them.

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace volt {

/// The BLAS whose `sgemm_` this process calls.
struct BlasInfo {
  /// "MKL" (inside LibTorch, as pip's wheels), "OpenBLAS", "BLIS", "FlexiBLAS", "ATLAS", "reference" (netlib's),
  /// "unknown" (a library volt does not recognise), or "none" (no `sgemm_` in the process).
  std::string name;
  /// The file that provides `sgemm_` (symbolic links resolved), or "" where it is LibTorch's own MKL or none.
  std::string library;
  bool reference() const { return name == "reference"; }
};

/// Which library provides `sgemm_` in this process (`dlsym` then `dladdr`), told apart by a symbol only that library
/// exports (`openblas_get_config`, ...), else by Debian's folder layout (`.../blas/libblas.so.3` is the reference
/// implementation's, `.../atlas/` ATLAS's). LibTorch built with MKL (pip's) multiplies there, whatever else is loaded.
inline BlasInfo blas_info() {
  if (at::hasMKL()) return {"MKL", ""};
  void* sgemm = ::dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info where{};
  if (sgemm == nullptr || ::dladdr(sgemm, &where) == 0 || where.dli_fname == nullptr) return {"none", ""};
  std::error_code ec;
  const std::filesystem::path file = std::filesystem::canonical(where.dli_fname, ec);
  BlasInfo info{"unknown", ec ? std::string(where.dli_fname) : file.string()};
  if (void* lib = ::dlopen(where.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
    const std::pair<const char*, const char*> markers[] = {{"openblas_get_config", "OpenBLAS"},
                                                           {"MKL_Get_Version_String", "MKL"},
                                                           {"bli_info_get_version_str", "BLIS"},
                                                           {"flexiblas_current_backend", "FlexiBLAS"},
                                                           {"ATL_buildinfo", "ATLAS"}};
    for (const auto& [symbol, name] : markers) {
      if (::dlsym(lib, symbol) != nullptr) {
        info.name = name;
        break;
      }
    }
    ::dlclose(lib);
  }
  if (info.name != "unknown") return info;
  const std::filesystem::path named(where.dli_fname);  // the name asked for, e.g. .../blas/libblas.so.3
  const std::string folder = named.parent_path().filename().string(), real_folder = file.parent_path().filename();
  if (folder == "atlas" || real_folder == "atlas") {
    info.name = "ATLAS";
  } else if (named.filename().string().rfind("libblas.so", 0) == 0 ||
             file.filename().string().rfind("libblas.so", 0) == 0) {
    info.name = "reference";  // netlib's libblas3 is the only provider named plain libblas.so without a marker
  }
  return info;
}

namespace detail {

/// The CPUs in a list such as "0-3,8,10-11" (the kernel's cpuset format); empty when it is not one.
inline std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    part.erase(std::remove_if(part.begin(), part.end(), [](char c) { return c == '\n' || c == ' '; }), part.end());
    if (part.empty()) continue;
    const auto dash = part.find('-');
    try {
      const int lo = std::stoi(part.substr(0, dash));
      const int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
      if (lo < 0 || hi < lo || hi - lo > (1 << 16)) return {};
      for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    } catch (const std::exception&) {
      return {};
    }
  }
  return cpus;
}

/// The first line of a file, or "" when it cannot be read.
inline std::string first_line(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  return line;
}

/// How many physical cores the CPUs sit on (hyper-threads of one core count once), from sysfs' topology; each CPU
/// counts as a core where that is unreadable.
inline int count_cores(const std::vector<int>& cpus) {
  std::vector<std::string> cores;
  for (int c : cpus) {
    const auto dir = std::filesystem::path("/sys/devices/system/cpu") / ("cpu" + std::to_string(c)) / "topology";
    const std::string core = first_line(dir / "core_id"), package = first_line(dir / "physical_package_id");
    cores.push_back(core.empty() ? "cpu" + std::to_string(c) : package + ":" + core);
  }
  std::sort(cores.begin(), cores.end());
  return static_cast<int>(std::unique(cores.begin(), cores.end()) - cores.begin());
}

/// The numbers a CPU run's speed depends on, read off this process. CPUs are logical (hyper-threads count); cores
/// are physical, which LibTorch's default thread count follows.
struct CpuView {
  int threads = 1;               ///< LibTorch's intra-op threads (`at::get_num_threads()`)
  int affinity = 1;              ///< CPUs this process may run on (`sched_getaffinity`)
  int affinity_cores = 1;        ///< ... and the cores they sit on
  int host = 1;                  ///< CPUs of the host this job may use: its cgroup's cpuset, else the online CPUs
  int host_cores = 1;            ///< ... and the cores they sit on
  std::optional<int> quota;      ///< CPUs' worth of time the cgroup's `cpu.max` allows (rounded up), if limited
  int ranks = 1;                 ///< processes of this job on this host
  std::optional<std::string> omp_num_threads;  ///< the environment's OMP_NUM_THREADS, if set
};

/// The CPUs this job may use on its host: its cgroup's (v2) effective cpuset, else the online CPUs.
inline std::vector<int> host_cpus() {
  const std::string self = first_line("/proc/self/cgroup");  // "0::/path" on cgroup v2
  if (self.rfind("0::", 0) == 0) {
    auto cpus = parse_cpu_list(first_line(std::filesystem::path("/sys/fs/cgroup") / self.substr(4) /
                                          "cpuset.cpus.effective"));
    if (!cpus.empty()) return cpus;
  }
  auto online = parse_cpu_list(first_line("/sys/devices/system/cpu/online"));
  if (online.empty()) {
    for (long c = 0, n = ::sysconf(_SC_NPROCESSORS_ONLN); c < n; ++c) online.push_back(static_cast<int>(c));
  }
  return online;
}

/// The tightest `cpu.max` quota (cgroup v2) of this process's cgroup and those above it, in CPUs rounded up.
inline std::optional<int> cgroup_cpu_quota() {
  const std::string self = first_line("/proc/self/cgroup");
  if (self.rfind("0::", 0) != 0) return std::nullopt;
  std::optional<int> quota;
  for (std::filesystem::path dir = std::filesystem::path("/sys/fs/cgroup") / self.substr(4);; dir = dir.parent_path()) {
    std::stringstream max(first_line(dir / "cpu.max"));  // "max 100000" or "<quota> <period>", microseconds
    std::string q;
    long period = 0;
    if (max >> q >> period && q != "max" && period > 0) {
      try {
        const int cpus = std::max(1, static_cast<int>((std::stol(q) + period - 1) / period));
        quota = quota ? std::min(*quota, cpus) : cpus;
      } catch (const std::exception&) {
      }
    }
    if (dir == "/sys/fs/cgroup" || dir == dir.parent_path()) break;
  }
  return quota;
}

/// This process as it runs now, `ranks` of its job on this host.
inline CpuView read_cpu_view(int ranks) {
  CpuView v;
  v.threads = at::get_num_threads();
  const std::vector<int> host = host_cpus();
  std::vector<int> mine;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) mine.push_back(c);
    }
  }
  if (mine.empty()) mine = host;
  v.host = std::max<int>(1, static_cast<int>(host.size()));
  v.host_cores = std::max(1, count_cores(host));
  v.affinity = std::max<int>(1, static_cast<int>(mine.size()));
  v.affinity_cores = std::max(1, count_cores(mine));
  v.quota = cgroup_cpu_quota();
  v.ranks = std::max(1, ranks);
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) v.omp_num_threads = omp;
  return v;
}

/// Where LibTorch's thread count came from, for a sentence: the environment, else LibTorch's default or a call.
inline std::string thread_source(const CpuView& v) {
  if (v.omp_num_threads) return "OMP_NUM_THREADS=" + *v.omp_num_threads + " is set in the environment";
  return "no OMP_NUM_THREADS is set, so LibTorch counted the cores itself (its count reads low on some virtual "
         "machines) or the program called at::set_num_threads(" + std::to_string(v.threads) + ")";
}

/// The sentence for threads, if any. Each rank's fair share is the job's cores on this host (cpuset, quota) over its
/// ranks there: bound to at most half of it, or running at most half of it in threads, leaves cores idle (cores, as
/// LibTorch's default counts them: a second hyper-thread adds little to dense math); more threads than the logical
/// CPUs a rank can have (its affinity, its share) makes OpenMP teams spin against each other.
inline std::vector<std::string> thread_findings(const CpuView& v) {
  const int cpus = v.quota ? std::min(v.host, *v.quota) : v.host;
  const int cores = v.quota ? std::min(v.host_cores, *v.quota) : v.host_cores;
  const int fair = std::max(1, cores / v.ranks);
  const int share = std::max(1, std::min(v.affinity, cpus / v.ranks));
  const auto n = [](int k, const char* what) { return std::to_string(k) + " " + what + (k == 1 ? "" : "s"); };
  const std::string on_host = n(cores, "core") + (v.quota && *v.quota < v.host_cores ? " (its cgroup's cpu.max)" : "") +
                              (v.ranks > 1 ? " for " + std::to_string(v.ranks) + " ranks" : "");
  if (2 * v.affinity_cores <= fair) {
    return {"this process may run on " + n(v.affinity_cores, "core") + " only (its CPU affinity) while the job has " +
            on_host + " on this host: mpirun binds each rank to one core by default with 2 ranks or fewer (also "
            "taskset, numactl). Pass mpirun --bind-to none, or --map-by slot:PE=" + std::to_string(fair) +
            " to give each rank " + n(fair, "core") + "."};
  }
  if (2 * v.threads <= fair) {
    return {"LibTorch runs " + n(v.threads, "intra-op thread") + " while this process has " + n(fair, "core") +
            " (the job has " + on_host + " on this host): " + thread_source(v) + ". Set OMP_NUM_THREADS=" +
            std::to_string(fair) + " (or call at::set_num_threads(" + std::to_string(fair) + "))."};
  }
  if (v.threads > share) {
    return {"LibTorch runs " + n(v.threads, "intra-op thread") + " per process where each may have " +
            n(share, "CPU") + " (the job has " + on_host + " on this host), so OpenMP threads wait for each other: " +
            thread_source(v) + ". Set OMP_NUM_THREADS=" + std::to_string(share) + " for each rank (or call "
            "at::set_num_threads(" + std::to_string(share) + "))."};
  }
  return {};
}

/// The sentence for a reference BLAS, or none.
inline std::vector<std::string> blas_findings(const BlasInfo& blas) {
  if (!blas.reference()) return {};
  return {"LibTorch does its matrix products (linear layers, matmul, convolutions) on the reference BLAS (" +
          blas.library + "), unoptimised Fortran: a CPU fit runs about 10x slower than with an optimised one. On " +
          "Debian or Ubuntu: apt-get install libopenblas0-openmp (it takes over libblas.so.3 for every program)."};
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
