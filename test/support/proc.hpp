#pragma once
// Reading another process's /proc files in the process drivers (test/distributed.cpp, test/resume.cpp), which scan
// /proc for what a job left behind while other processes of the machine come and go.

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace vt {

/// The whole of /proc/<pid>/<file>, or "" when it cannot be read: the process may end between the scan that listed it
/// and the read, and its files then read with ESRCH, which std::ifstream's buffer turns into an exception
/// ("basic_filebuf::underflow error reading the file: No such process").
inline std::string proc_file(const std::string& pid, const char* file) {
  const int fd = ::open(("/proc/" + pid + "/" + file).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string out;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n > 0) {
      out.append(buffer, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      if (n < 0) out.clear();
      break;
    }
  }
  ::close(fd);
  return out;
}

}  // namespace vt
