#pragma once
/// \file
/// Where the members of a process group run, as they tell each other when the group forms: the host's name (what
/// launchers and schedulers call a node), the kernel's identity (whether `kill(pid, 0)` can see a member), and each
/// member's local and node rank derived from the names.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace volt::detail {

inline std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

/// What says whether `kill(pid, 0)` can see another process: the kernel's boot id and this process's PID namespace.
/// Two processes that share both see each other's PIDs; the host name alone does not say so (two containers may both
/// be called "localhost"), nor does sharing them say the processes are on one host as the job sees it (network and UTS
/// namespaces make hosts of one kernel, as the cluster tests do).
inline std::string kernel_identity() {
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char line[64] = {};
    if (std::fgets(line, sizeof line, f) != nullptr) boot = line;
    std::fclose(f);
  }
  struct stat ns {};
  const bool have_ns = ::stat("/proc/self/ns/pid", &ns) == 0;
  if (boot.empty() || !have_ns) return {};  // unknown: never compared equal
  while (!boot.empty() && (boot.back() == '\n' || boot.back() == '\r')) boot.pop_back();
  return boot + "/" + std::to_string(static_cast<unsigned long long>(ns.st_ino));
}

/// Each member's local rank (its place among the members on its host, in rank order) and node rank (its host's place
/// among the hosts, in the order of their first member), from every member's host name in rank order. As Lightning's
/// MPIEnvironment, whatever the launcher's mapping (by slot, by node, a scheduler's daemons in between).
struct Placement {
  std::vector<int> local_rank, node_rank;
  int nodes = 0;
};
inline Placement place(const std::vector<std::string>& hosts) {
  Placement p;
  std::vector<std::string> seen;
  std::vector<int> count;
  for (const std::string& h : hosts) {
    const auto at = std::find(seen.begin(), seen.end(), h);
    const auto node = static_cast<std::size_t>(at - seen.begin());
    if (at == seen.end()) {
      seen.push_back(h);
      count.push_back(0);
    }
    p.node_rank.push_back(static_cast<int>(node));
    p.local_rank.push_back(count[node]++);
  }
  p.nodes = static_cast<int>(seen.size());
  return p;
}

}  // namespace volt::detail
