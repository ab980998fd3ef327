#pragma once
/// \file
/// The file side of checkpoints, under volt/checkpoint.hpp and the safetensors writer: atomic writes (a temporary
/// file in the same folder, fsync, rename, fsync of the folder: a process killed mid-write leaves the previous file
/// whole), a file or folder swapped in place of another (`replace_atomically`), the check that a folder takes checkpoints before training starts, and the version counter's free names.

#include "volt/checkpoint/bytes.hpp"
#include "volt/errors.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>  // renameat2
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace volt {
namespace checkpoint {

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
  } else {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_EXCHANGE) != 0) {
      detail::fail_errno("swapping the finished checkpoint with what is at", path);
    }
    std::filesystem::remove_all(tmp, ec);  // the previous checkpoint
  }
  detail::fsync_dir(std::filesystem::path(path).parent_path());
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
