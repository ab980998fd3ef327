#pragma once
/// \file
/// The byte-level pieces under volt/checkpoint.hpp: the checksum over a checkpoint's contents, and
/// reading a file's bytes without trusting them (a zip reader that stays inside the bytes, pickle lengths checked
/// against what is left). Include volt/checkpoint.hpp.

#include "volt/errors.hpp"

#include <ATen/core/ivalue.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/storage_context.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace volt {

namespace checkpoint {
namespace detail {

inline uint32_t crc(uint32_t c, const void* data, std::size_t n) {
  return static_cast<uint32_t>(crc32_z(c, static_cast<const Bytef*>(data), n));
}
inline uint32_t crc(uint32_t c, const std::string& s) {
  c = crc(c, s.data(), s.size());
  return crc(c, "\0", 1);
}

/// Refuses a tensor whose sizes, strides and storage offset reach past its storage (a file can claim any of them;
/// reading such a tensor would read memory that is not its own).
inline void check_tensor_extent(const at::Tensor& t) {
  const auto shape = [&] {
    std::ostringstream s;
    s << "sizes " << t.sizes() << ", strides " << t.strides() << ", storage offset " << t.storage_offset();
    return s.str();
  };
  if (!t.defined()) throw CheckpointError("volt: a checkpoint holds an undefined tensor: the file is corrupt.");
  if (t.layout() != c10::kStrided || !t.has_storage()) {
    throw CheckpointError("volt: a checkpoint holds dense tensors only; this file has a tensor of layout " +
                          std::string(c10::toString(t.layout())) + ": it is corrupt or not volt's.");
  }
  if (t.storage_offset() < 0) {
    throw CheckpointError("volt: a tensor in this checkpoint has a negative storage offset (" + shape() +
                          "): the file is corrupt.");
  }
  unsigned __int128 last = static_cast<unsigned __int128>(t.storage_offset());  // the last element's index
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) < 0 || t.stride(d) < 0) {
      throw CheckpointError("volt: a tensor in this checkpoint has a negative size or stride (" + shape() +
                            "): the file is corrupt.");
    }
    if (t.size(d) == 0) return;  // no elements: nothing is read
    last += static_cast<unsigned __int128>(t.size(d) - 1) * static_cast<unsigned __int128>(t.stride(d));
  }
  const unsigned __int128 needed = (last + 1) * t.element_size();
  if (needed > t.storage().nbytes()) {
    throw CheckpointError("volt: a tensor in this checkpoint (" + shape() + ") reaches past its storage of " +
                          std::to_string(t.storage().nbytes()) + " bytes: the file is corrupt.");
  }
}

/// CRC-32 over a value's contents in a fixed order (dictionary keys sorted), so it does not depend on
/// how the file lays them out.
inline uint32_t checksum(const c10::IValue& v, uint32_t c) {
  if (v.isNone()) return crc(c, "N");
  if (v.isBool()) return crc(c, v.toBool() ? "T" : "F");
  if (v.isInt()) {
    const int64_t i = v.toInt();
    return crc(crc(c, "I"), &i, sizeof i);
  }
  if (v.isDouble()) {
    const double d = v.toDouble();
    return crc(crc(c, "D"), &d, sizeof d);
  }
  if (v.isString()) return crc(crc(c, "S"), v.toStringRef());
  if (v.isTensor()) {
    check_tensor_extent(v.toTensor());
    const at::Tensor t = v.toTensor().cpu().contiguous();
    c = crc(crc(c, "X"), std::string(c10::toString(t.scalar_type())));
    for (int64_t s : t.sizes()) c = crc(c, &s, sizeof s);
    return crc(c, t.data_ptr(), t.nbytes());
  }
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    std::vector<std::pair<std::string, c10::IValue>> items;  // by key: a string as it is, an integer as "#<n>"
    for (const auto& e : d) {
      if (e.key().isInt()) {
        items.emplace_back("#" + std::to_string(e.key().toInt()), e.value());
      } else if (e.key().isString()) {
        items.emplace_back(e.key().toStringRef(), e.value());
      } else {
        throw CheckpointError("volt: a checkpoint's dictionaries have string or integer keys; got a " +
                              e.key().tagKind());
      }
    }
    std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    c = crc(c, "{");
    for (const auto& [k, value] : items) c = checksum(value, crc(c, k));
    return crc(c, "}");
  }
  if (v.isList()) {
    c = crc(c, "[");
    for (const auto& e : v.toListRef()) c = checksum(e, c);
    return crc(c, "]");
  }
  throw CheckpointError("volt: a checkpoint may hold numbers, strings, tensors, lists and dictionaries; got a " +
                        v.tagKind());
}

inline std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

[[noreturn]] inline void fail_errno(const std::string& what, const std::string& path) {
  throw CheckpointError("volt: " + what + " " + path + " failed: " + std::strerror(errno));
}

inline void fsync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

/// Hands a checkpoint's bytes to LibTorch's zip reader, copying only what is there. (LibTorch's own VectorReader,
/// behind `torch::pickle_load`, copies whatever range the reader asks for, also past the end of a damaged file's
/// bytes: a heap overflow that fuzzing found with a file whose zip directory points beyond its end.)
class BoundedReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BoundedReader(const std::vector<char>& bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<size_t>(n, bytes_.size() - static_cast<size_t>(pos));
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  const std::vector<char>& bytes_;
};

/// What follows a pickle opcode, for `check_pickle_lengths`: nothing, a fixed number of bytes, a length of 1, 4 or 8
/// bytes and that many bytes, one or two lines; `stop` ends the pickle, `unknown` an opcode this does not know.
enum class PickleArg { stop, none, fixed1, fixed2, fixed4, fixed8, length1, length4, length8, line, two_lines, unknown };

inline PickleArg pickle_arg(unsigned char op) {
  switch (op) {
    case '.': return PickleArg::stop;
    case 'K':
    case 'h':
    case 'q':
    case 0x80:
    case 0x82: return PickleArg::fixed1;  // one-byte arguments
    case 'M':
    case 0x83: return PickleArg::fixed2;
    case 'J':
    case 'j':
    case 'r':
    case 0x84: return PickleArg::fixed4;
    case 'G':
    case 0x95: return PickleArg::fixed8;  // BINFLOAT, FRAME
    case 'U':
    case 'C':
    case 0x8a:
    case 0x8c: return PickleArg::length1;  // short strings, bytes, LONG1
    case 'T':
    case 'X':
    case 'B':
    case 0x8b: return PickleArg::length4;  // strings, bytes, LONG4
    case 0x8d:
    case 0x8e:
    case 0x96: return PickleArg::length8;  // 8-byte lengths
    case 'F':
    case 'I':
    case 'L':
    case 'P':
    case 'S':
    case 'V':
    case 'g':
    case 'p': return PickleArg::line;
    case 'c':
    case 'i': return PickleArg::two_lines;  // GLOBAL, INST: module and name
    case '(':
    case '0':
    case '1':
    case '2':
    case 'N':
    case 'Q':
    case 'R':
    case 'a':
    case 'b':
    case 'd':
    case '}':
    case 'e':
    case 'l':
    case ']':
    case 'o':
    case 's':
    case 't':
    case ')':
    case 'u':
    case 0x81:
    case 0x85:
    case 0x86:
    case 0x87:
    case 0x88:
    case 0x89:
    case 0x8f:
    case 0x90:
    case 0x91:
    case 0x92:
    case 0x93:
    case 0x94:
    case 0x97:
    case 0x98: return PickleArg::none;
    default: return PickleArg::unknown;
  }
}

/// Walks a pickle's opcodes and throws when a length field asks for more bytes than the pickle has left, or a
/// LONG_BINPUT memo index is beyond what the pickle could have written (one object per index, each at least one
/// opcode byte). (LibTorch's Unpickler sizes its buffer from a length before reading, and grows its memo to the
/// index: damaged files asked for a 4 GB string and a 28 GB memo, which fuzzing found.) Opcodes it does not know
/// end the walk; the Unpickler judges the rest.
inline void check_pickle_lengths(const char* p, std::size_t size) {
  std::size_t at = 0;
  auto need = [&](std::size_t n) {
    if (n > size - at) {
      throw std::runtime_error("a length in the pickle asks for " + std::to_string(n) + " bytes at byte " +
                               std::to_string(at) + " of " + std::to_string(size));
    }
  };
  auto number = [&](int width) {  // little-endian, as pickle writes lengths
    need(static_cast<std::size_t>(width));
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[at + i]);
    at += static_cast<std::size_t>(width);
    return v;
  };
  auto skip = [&](uint64_t n) {
    need(static_cast<std::size_t>(std::min<uint64_t>(n, SIZE_MAX)));
    at += static_cast<std::size_t>(n);
  };
  auto line = [&] {
    const void* nl = std::memchr(p + at, '\n', size - at);
    if (nl == nullptr) throw std::runtime_error("a pickle line has no end");
    at = static_cast<std::size_t>(static_cast<const char*>(nl) - p) + 1;
  };
  while (at < size) {
    const auto op = static_cast<unsigned char>(p[at++]);
    if (op == 'r') {  // LONG_BINPUT
      const uint64_t index = number(4);
      if (index >= size) {
        throw std::runtime_error("a memo index in the pickle (" + std::to_string(index) + ") is beyond its " +
                                 std::to_string(size) + " bytes");
      }
      continue;
    }
    switch (pickle_arg(op)) {
      case PickleArg::stop:
      case PickleArg::unknown: return;
      case PickleArg::none: break;
      case PickleArg::fixed1: skip(1); break;
      case PickleArg::fixed2: skip(2); break;
      case PickleArg::fixed4: skip(4); break;
      case PickleArg::fixed8: skip(8); break;
      case PickleArg::length1: skip(number(1)); break;
      case PickleArg::length4: skip(number(4)); break;
      case PickleArg::length8: skip(number(8)); break;
      case PickleArg::line: line(); break;
      case PickleArg::two_lines:
        line();
        line();
        break;
    }
  }
}

/// `torch::pickle_load` over a BoundedReader, with the pickle's lengths checked first: the same archive ("data"),
/// read within its bytes.
/// Each tensor's storage is its record's bytes, at the record's own size: LibTorch's Unpickler would size a storage
/// from the element count the pickle claims, however few bytes its record holds (fuzzing found a tensor whose storage
/// claimed more than its record had), and `checksum` checks every tensor against its storage before reading it.
inline c10::IValue unpickle(const std::vector<char>& bytes) {
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BoundedReader>(bytes));
  const auto [pickle, size] = reader.getRecord("data.pkl");
  check_pickle_lengths(static_cast<const char*>(pickle.get()), size);
  auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
  const std::string tensor_dir = "data/";
  for (const auto& name : reader.getAllRecords()) {
    if (name.size() <= tensor_dir.size() || name.compare(0, tensor_dir.size(), tensor_dir) != 0) continue;
    auto [data, record_size] = reader.getRecord(name);
    storages->addStorage(name.substr(tensor_dir.size()),
                         c10::Storage(c10::Storage::use_byte_size_t(), record_size, std::move(data),
                                      /*allocator=*/nullptr, /*resizable=*/false));
  }
  return torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"", {}, {}, {}, reader,
                                           torch::jit::Unpickler::defaultTypeParser, storages);
}

}  // namespace detail

}  // namespace checkpoint
}  // namespace volt
