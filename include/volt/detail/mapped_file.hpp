#pragma once
/// \file
/// A file mapped into memory, unmapped with its last owner: token files (data/token_file.hpp) and safetensors files
/// (checkpoint/safetensors.hpp) are read through one, so a window or a tensor costs the pages it touches, not the
/// file's size.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace volt::detail {

/// Why a file could not be mapped ("cannot open it: No such file or directory"); the caller names the file.
struct MapError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class MappedFile {
 public:
  /// How the pages may be used.
  enum class Access {
    read_only,      ///< a write faults (token files)
    copy_on_write,  ///< a write copies the page for this process only, the file never changes (tensors handed out)
  };

  explicit MappedFile(const std::filesystem::path& path, Access access = Access::read_only) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw MapError("cannot open it: " + std::string(std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw MapError("cannot read its size: " + std::string(std::strerror(e)));
    }
    bytes_ = static_cast<std::size_t>(st.st_size);
    if (bytes_ > 0) {
      const int prot = access == Access::read_only ? PROT_READ : PROT_READ | PROT_WRITE;
      void* p = ::mmap(nullptr, bytes_, prot, access == Access::read_only ? MAP_SHARED : MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        throw MapError("cannot map it: " + std::string(std::strerror(e)));
      }
      data_ = static_cast<unsigned char*>(p);
    }
    ::close(fd);  // the mapping keeps the file
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }

  unsigned char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  unsigned char* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace volt::detail
