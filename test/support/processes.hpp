#pragma once
// Starting and watching processes for the process drivers (test/resume.cpp, test/distributed.cpp): this program
// again, or mpirun. Catch-free: a driver reports a failed check by printing "MISMATCH: ..." (CTest's
// FAIL_REGULAR_EXPRESSION) and exiting 1.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace vt {

inline std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

/// Prints the failed check for CTest and ends the driver.
[[noreturn]] inline void fail(const std::string& what) {
  std::cout << "MISMATCH: " << what << std::endl;
  std::exit(1);
}

/// The seed of a randomized check: VOLT_TEST_SEED when set (to replay a failure), else a fresh one. Printed with the
/// command that replays it, so a failure's output says how to see it again.
inline unsigned test_seed(const char* what) {
  unsigned seed = 0;
  if (const char* given = std::getenv("VOLT_TEST_SEED"); given != nullptr && *given != '\0') {
    char* end = nullptr;
    const unsigned long v = std::strtoul(given, &end, 10);
    if (*end != '\0' || v > 0xffffffffUL) {
      fail(std::string("VOLT_TEST_SEED='") + given + "' is not a seed: give an unsigned 32-bit decimal number");
    }
    seed = static_cast<unsigned>(v);
  } else {
    seed = std::random_device{}();
  }
  std::cout << what << ": random seed " << seed << " (replay with VOLT_TEST_SEED=" << seed << ")" << std::endl;
  return seed;
}

/// A started command: its pid and, when piped, its standard output.
struct Child {
  pid_t pid;
  FILE* out;
};

/// Starts `cmd` (searched on PATH), with its standard output on a pipe when `piped`; `env` entries
/// ("NAME=value") are added to its environment.
inline Child start(const std::vector<std::string>& cmd, bool piped, const std::vector<std::string>& env = {}) {
  int fds[2] = {-1, -1};
  if (piped && ::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (piped) {
      ::dup2(fds[1], STDOUT_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
    }
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv;
    for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::perror("exec");
    std::_Exit(127);
  }
  if (!piped) return {pid, nullptr};
  ::close(fds[1]);
  return {pid, ::fdopen(fds[0], "r")};
}

/// Waits for a child; its exit status, or -signal when a signal ended it.
inline int wait_for(const Child& c) {
  if (c.out != nullptr) std::fclose(c.out);
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

/// Runs a command to its end, echoing it first; returns its exit status (-signal when killed).
inline int run(const std::vector<std::string>& cmd, const std::vector<std::string>& env = {}) {
  std::cout << "$";
  for (const auto& e : env) std::cout << " " << e;
  for (const auto& a : cmd) std::cout << " " << a;
  std::cout << std::endl;
  return wait_for(start(cmd, false, env));
}

/// Runs a command to its end and returns its standard output (whatever its status).
inline std::string capture(const std::vector<std::string>& cmd) {
  const Child c = start(cmd, true);
  std::string out;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, c.out) != nullptr) out += buffer;
  wait_for(c);
  return out;
}

/// Starts a command with its stdout on a pipe; `on_line` sees each line and returns true to kill the
/// process with SIGKILL there. Returns the status as run() does.
template <class F>
int run_until(const std::vector<std::string>& cmd, F&& on_line) {
  const Child c = start(cmd, true);
  char line[512];
  while (std::fgets(line, sizeof line, c.out) != nullptr) {
    if (on_line(std::string(line))) {
      ::kill(c.pid, SIGKILL);
      break;
    }
  }
  return wait_for(c);
}

/// The words after "--" on the command line (an mpirun command); fails when there are none.
inline std::vector<std::string> after_dashes(int argc, char** argv) {
  std::vector<std::string> out;
  bool seen = false;
  for (int i = 1; i < argc; ++i) {
    if (seen) out.emplace_back(argv[i]);
    if (std::string(argv[i]) == "--") seen = true;
  }
  if (out.empty()) fail("give the mpirun command after --");
  return out;
}

/// Whether two checkpoints hold bit-identical weights under the same names (`why` says the first difference).
inline bool identical(const std::string& a, const std::string& b, std::string* why) {
  const auto da = volt::checkpoint::read(a).at("state_dict").toGenericDict();
  const auto db = volt::checkpoint::read(b).at("state_dict").toGenericDict();
  if (da.size() != db.size()) {
    *why = "different tensor counts";
    return false;
  }
  for (const auto& e : da) {
    const auto& k = e.key().toStringRef();
    if (!db.contains(k) || !torch::equal(e.value().toTensor(), db.at(k).toTensor())) {
      *why = k + " differs (max abs diff " +
             (db.contains(k) ? std::to_string((e.value().toTensor() - db.at(k).toTensor()).abs().max().item<double>())
                             : std::string("missing")) +
             ")";
      return false;
    }
  }
  return true;
}

}  // namespace vt
