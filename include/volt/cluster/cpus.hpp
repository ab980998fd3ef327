#pragma once
/// \file
/// The CPUs a job may use on this host, read off the running process: its CPU affinity, its cgroup's cpuset and CPU
/// quota (cgroup v1 and v2), and the physical cores they sit on (sysfs' topology). What volt's own launchers split
/// among the ranks they start (`threads_per_started_rank`), and what the CPU accelerator's findings weigh LibTorch's
/// threads against (accelerators/cpu_speed.hpp). Functions that read files take a `root` ("/" but in tests).

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace volt::detail {

/// A whole decimal number, or nullopt.
inline std::optional<long long> to_number(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  long long n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return n;
}

/// The CPUs in a list such as "0-3,8,10-11" (the kernel's cpuset format); empty when it is not one.
inline std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    part.erase(std::remove_if(part.begin(), part.end(), [](char c) { return c == '\n' || c == ' '; }), part.end());
    if (part.empty()) continue;
    const auto dash = part.find('-');
    const auto lo = to_number(std::string_view(part).substr(0, dash));
    const auto hi = dash == std::string::npos ? lo : to_number(std::string_view(part).substr(dash + 1));
    if (!lo || !hi || *lo < 0 || *hi < *lo || *hi - *lo > (1 << 16)) return {};
    for (auto c = *lo; c <= *hi; ++c) cpus.push_back(static_cast<int>(c));
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

/// The folders of this process's cgroups that may hold `v1_controller`'s files, innermost first and then each one
/// above it up to its hierarchy's mount: the v2 hierarchy's (`0::/path`; mounted at /sys/fs/cgroup, or
/// /sys/fs/cgroup/unified beside v1 ones) and the v1 hierarchy listing that controller (`3:cpuset:/path`). Read from
/// `<root>/proc/self/cgroup` and `<root>/sys/fs/cgroup` (`root` is "/" but in tests).
inline std::vector<std::filesystem::path> cgroup_folders(const std::filesystem::path& root,
                                                         const std::string& v1_controller) {
  std::vector<std::filesystem::path> out;
  std::ifstream in(root / "proc/self/cgroup");
  std::error_code ec;
  for (std::string line; std::getline(in, line);) {
    const auto c1 = line.find(':'), c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1);
    std::vector<std::filesystem::path> mounts;
    if (controllers.empty()) {
      mounts = {root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"};
      std::erase_if(mounts, [&](const auto& m) { return !std::filesystem::exists(m / "cgroup.controllers", ec); });
    } else if (("," + controllers + ",").find("," + v1_controller + ",") != std::string::npos) {
      mounts = {root / "sys/fs/cgroup" / controllers, root / "sys/fs/cgroup" / v1_controller};
      std::erase_if(mounts, [&](const auto& m) { return !std::filesystem::is_directory(m, ec); });
    }
    if (mounts.empty()) continue;
    for (auto rel = std::filesystem::path(line.substr(c2 + 1)).relative_path();; rel = rel.parent_path()) {
      out.push_back(mounts.front() / rel);
      if (rel.empty() || rel == rel.parent_path()) break;
    }
  }
  return out;
}

/// The CPUs this job may use on its host: its cgroup's cpuset (v2 `cpuset.cpus.effective`, v1
/// `cpuset.effective_cpus` or `cpuset.cpus`, the innermost cgroup that has one), else the online CPUs.
inline std::vector<int> host_cpus(const std::filesystem::path& root = "/") {
  for (const auto& dir : cgroup_folders(root, "cpuset")) {
    for (const char* file : {"cpuset.cpus.effective", "cpuset.effective_cpus", "cpuset.cpus"}) {
      auto cpus = parse_cpu_list(first_line(dir / file));
      if (!cpus.empty()) return cpus;
    }
  }
  auto online = parse_cpu_list(first_line(root / "sys/devices/system/cpu/online"));
  if (online.empty()) {
    for (long c = 0, n = ::sysconf(_SC_NPROCESSORS_ONLN); c < n; ++c) online.push_back(static_cast<int>(c));
  }
  return online;
}

/// The tightest CPU quota of this process's cgroups (v2 `cpu.max`, v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us`),
/// in CPUs rounded up; nullopt where none is set.
inline std::optional<int> cgroup_cpu_quota(const std::filesystem::path& root = "/") {
  std::optional<int> quota;
  for (const auto& dir : cgroup_folders(root, "cpu")) {
    std::optional<long long> q, period;
    std::stringstream max(first_line(dir / "cpu.max"));  // "max 100000" or "<quota> <period>", microseconds
    std::string q_text, period_text;
    if (max >> q_text >> period_text) {
      q = to_number(q_text);
      period = to_number(period_text);
    } else {
      q = to_number(first_line(dir / "cpu.cfs_quota_us"));  // -1: none
      period = to_number(first_line(dir / "cpu.cfs_period_us"));
    }
    if (!q || !period || *q <= 0 || *period <= 0) continue;
    const int cpus = static_cast<int>(std::clamp<long long>((*q + *period - 1) / *period, 1, 1 << 20));
    quota = quota ? std::min(*quota, cpus) : cpus;
  }
  return quota;
}

/// The CPUs of this host the job may use (`host`: host_cpus()) and those of them this process may run on (`mine`: its
/// affinity within `host`; all of `host` where the affinity cannot be read).
struct HostCpus {
  std::vector<int> host, mine;
};

inline HostCpus read_host_cpus() {
  HostCpus h{host_cpus(), {}};
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c : h.host) {
      if (c < CPU_SETSIZE && CPU_ISSET(c, &set)) h.mine.push_back(c);
    }
  }
  if (h.mine.empty()) h.mine = h.host;
  return h;
}

/// The intra-op threads each of `ranks` processes that volt starts on this host should run: the cores this process
/// may use (read_host_cpus().mine, which the processes it starts inherit; capped by the cgroup's quota) over the
/// ranks, at least 1; nullopt when OMP_NUM_THREADS is set, which is the user's to choose. As torchrun, which sets
/// OMP_NUM_THREADS for the processes it starts; here each gets its share rather than 1.
inline std::optional<int> threads_per_started_rank(int ranks) {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return std::nullopt;
  int cores = count_cores(read_host_cpus().mine);
  if (const auto quota = cgroup_cpu_quota()) cores = std::min(cores, *quota);
  return std::max(1, cores / std::max(1, ranks));
}

}  // namespace volt::detail
