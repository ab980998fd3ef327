#pragma once
/// \file
/// The file side of checkpoints, under volt/checkpoint.hpp and the safetensors writer: atomic writes (a temporary
/// file in the same folder, fsync, rename, fsync of the folder: a process killed mid-write leaves the previous file
/// whole), a file or folder swapped in place of another (`replace_atomically`), one deleted whole or not at all
/// (`remove_atomically`), what saves cut short left deleted (`remove_stale_temporaries`), the check that a folder takes
/// checkpoints before training starts, and the version counter's free names.

#include "volt/checkpoint/bytes.hpp"
#include "volt/errors.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>  // renameat2
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace volt {
namespace checkpoint {

namespace detail {

/// Test-only: `VOLT_TEST_KILL_AFTER_FILE_OPS=<marker>:<n>` SIGKILLs the job's rank-zero process (OMPI_COMM_WORLD_RANK,
/// else RANK, unset or 0) right after its n-th file operation of a save or a deletion, counted from the first whose path
/// holds `marker` (`step=4.ckpt`), so that a test can end a job after each operation in turn. Without it, nothing.
inline void after_file_op(const std::string& path) {
  struct Plan {
    std::string marker;
    long at = 0;
  };
  static const Plan plan = [] {
    Plan p;
    const char* spec = std::getenv("VOLT_TEST_KILL_AFTER_FILE_OPS");
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr) rank = std::getenv("RANK");
    if (spec == nullptr || (rank != nullptr && std::string(rank) != "0")) return p;
    const std::string text = spec;
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) return p;
    p.marker = text.substr(0, colon);
    p.at = std::atol(text.c_str() + colon + 1);
    return p;
  }();
  static std::atomic<long> done{0};
  static std::atomic<bool> counting{false};
  if (plan.at <= 0) return;
  if (!counting && path.find(plan.marker) == std::string::npos) return;
  counting = true;
  if (++done == plan.at) ::raise(SIGKILL);
}

}  // namespace detail

/// Puts `tmp` (a file or a folder) at `path` in one step and flushes the folder: a rename where `path` is absent or both
/// are files; else (a sharded checkpoint's folder in place of a file, or the other way round) a swap, Linux's
/// `renameat2(RENAME_EXCHANGE)`, after which what `path` held, now at `tmp`, is deleted. A process killed at any moment
/// leaves at `path` the old contents or the new, whole.
inline void replace_atomically(const std::string& tmp, const std::string& path) {
  std::error_code ec;
  const auto there = std::filesystem::symlink_status(path, ec).type();
  const bool swap = there == std::filesystem::file_type::directory ||
                    (there != std::filesystem::file_type::not_found && std::filesystem::is_directory(tmp, ec));
  if (!swap) {
    if (::rename(tmp.c_str(), path.c_str()) != 0) detail::fail_errno("renaming the finished checkpoint onto", path);
    detail::after_file_op(path);
  } else {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_EXCHANGE) != 0) {
      detail::fail_errno("swapping the finished checkpoint with what is at", path);
    }
    detail::after_file_op(path);
    std::filesystem::remove_all(tmp, ec);  // the previous checkpoint (a temporary's name: no reader takes it)
    detail::after_file_op(tmp);
  }
  detail::fsync_dir(std::filesystem::path(path).parent_path());
  detail::after_file_op(path);
}

/// Deletes the checkpoint (file or sharded folder) at `path` so that it is there whole or not at all: renamed to a
/// temporary's name first (`<path>.tmp.<pid>`, which no reader takes for a checkpoint, and the next save of a
/// ModelCheckpoint in the folder deletes: `remove_stale_temporaries`), then deleted. Nothing where `path` is absent.
inline void remove_atomically(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::symlink_status(path, ec).type() == std::filesystem::file_type::not_found) return;
  const std::string doomed = path + ".tmp." + std::to_string(::getpid());
  std::filesystem::remove_all(doomed, ec);
  if (::rename(path.c_str(), doomed.c_str()) != 0) {
    std::filesystem::remove_all(path, ec);  // (cannot be renamed: deleted in place, as before)
    return;
  }
  detail::after_file_op(path);
  detail::fsync_dir(std::filesystem::path(path).parent_path());
  std::filesystem::remove_all(doomed, ec);
  detail::after_file_op(doomed);
}

/// Deletes what saves and deletions cut short left in `folder`: every entry named `<name>.tmp.<pid>` (a checkpoint's
/// temporary file or folder, or one being deleted) of a process other than this one that no longer runs on this host.
/// Returns how many were deleted.
inline int remove_stale_temporaries(const std::filesystem::path& folder) {
  int removed = 0;
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (const auto& e : std::filesystem::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    const auto at = name.rfind(".tmp.");
    if (at == std::string::npos || at + 5 >= name.size()) continue;
    const std::string pid = name.substr(at + 5);
    if (pid.find_first_not_of("0123456789") != std::string::npos || pid.size() > 9) continue;
    const long owner = std::atol(pid.c_str());
    const bool alive = owner > 0 && (::kill(static_cast<pid_t>(owner), 0) == 0 || errno == EPERM);
    if (owner == static_cast<long>(::getpid()) || alive) continue;
    stale.push_back(e.path());
  }
  for (const auto& p : stale) removed += std::filesystem::remove_all(p, ec) > 0 ? 1 : 0;
  return removed;
}

/// Writes `pieces` one after another to `path` atomically (temporary file in the same folder, fsync, rename, fsync of
/// the folder). Creates the folder if needed.
inline void write_atomic(const std::string& path, const std::vector<std::pair<const char*, std::size_t>>& pieces) {
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.parent_path();
  std::error_code ec;
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  if (ec) throw CheckpointError("volt: cannot create the folder " + dir.string() + " for " + path + ": " + ec.message());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) detail::fail_errno("writing the checkpoint (opening)", tmp);
  for (const auto& [data, size] : pieces) {
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd, data + done, size - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int saved = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        errno = saved;
        detail::fail_errno("writing the checkpoint", tmp);
      }
      done += static_cast<std::size_t>(n);
    }
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int saved = errno;
    ::unlink(tmp.c_str());
    errno = saved;
    detail::fail_errno("flushing the checkpoint", tmp);
  }
  detail::after_file_op(path);
  try {
    replace_atomically(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

/// Writes `size` bytes at `data` to `path` atomically.
inline void write_atomic(const std::string& path, const char* data, std::size_t size) {
  write_atomic(path, {{data, size}});
}

/// Checks, before any training, that checkpoints can be written into `folder`: it exists or can be created, a
/// small file can be written there, flushed to the disk and removed, and the disk has at least `min_bytes` free
/// (a checkpoint holds at least the weights). `who` names the caller in the message. Throws CheckpointError
/// naming the folder and the fault (a read-only or full disk is found now, not after the first epoch).
inline void check_writable(const std::string& folder, std::uintmax_t min_bytes, const std::string& who) {
  const std::filesystem::path dir(folder.empty() ? "." : folder);
  auto fail = [&](const std::string& why) {
    throw CheckpointError("volt: " + who + " cannot write checkpoints into " + dir.string() + ": " + why +
                          ". Give a folder on a writable disk with room (dirpath, or default_root_dir), before "
                          "training starts.");
  };
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("the folder cannot be created (" + ec.message() + ")");
  const std::string probe = (dir / (".volt-write-check." + std::to_string(::getpid()))).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(std::string("a file cannot be created there (") + std::strerror(errno) + ")");
  const std::vector<char> block(4096, 0);
  errno = 0;
  const bool written = ::write(fd, block.data(), block.size()) == static_cast<ssize_t>(block.size());
  const int write_errno = written ? 0 : (errno != 0 ? errno : ENOSPC);
  const bool flushed = written && ::fsync(fd) == 0;
  const int flush_errno = flushed ? 0 : errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!written) fail(std::string("writing 4 KiB there failed (") + std::strerror(write_errno) + ")");
  if (!flushed) fail(std::string("flushing 4 KiB there failed (") + std::strerror(flush_errno) + ")");
  const std::filesystem::space_info room = std::filesystem::space(dir, ec);
  if (!ec && room.available < min_bytes) {
    fail("the disk has " + std::to_string(room.available) + " bytes free and one checkpoint needs at least " +
         std::to_string(min_bytes) + " (the weights alone)");
  }
}

/// Whether two paths name the same file or folder (as absolute, normalised paths; neither need exist).
inline bool same_path(const std::string& a, const std::string& b) {
  std::error_code ec;
  return std::filesystem::weakly_canonical(std::filesystem::absolute(a), ec) ==
         std::filesystem::weakly_canonical(std::filesystem::absolute(b), ec);
}

/// Where a run writes `<stem>.ckpt` in `folder` without replacing another run's file (Lightning's version counter):
/// the name itself while no file has it or `own(path)` says this run wrote it (or resumed from it), else the first
/// free `<stem>-v1.ckpt`, `<stem>-v2.ckpt`, ...; with `versioned` false, always the name itself.
template <class Own>
std::string free_checkpoint_path(const std::filesystem::path& folder, const std::string& stem, bool versioned, Own&& own) {
  std::string candidate = (folder / (stem + ".ckpt")).string();
  for (int v = 1; versioned && std::filesystem::exists(candidate) && !own(candidate); ++v) {
    candidate = (folder / (stem + "-v" + std::to_string(v) + ".ckpt")).string();
  }
  return candidate;
}

}  // namespace checkpoint
}  // namespace volt
