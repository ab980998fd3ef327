#pragma once
/// \file
/// The safetensors format (Hugging Face's weights files): read and written without trusting the bytes.
///
/// | bytes | contents |
/// |---|---|
/// | 0-7 | N, the header's length, an unsigned 64-bit little-endian integer (at most 100,000,000, as the reference reader) |
/// | 8 to 8+N | the header: a JSON object, UTF-8, starting with `{`, padded with spaces to a multiple of 8 bytes |
/// | 8+N to the end | the tensors' bytes, little-endian, C order, one after another with no gap and no overlap |
///
/// The header maps each tensor's name to `{"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}` (offsets
/// into the data, `end - begin` = the elements times the dtype's size); the optional `"__metadata__"` entry maps
/// strings to strings. The writer orders the tensors as the reference writer (the dtypes' order in `Dtype`, widest
/// first, then by name), so each tensor starts on a multiple of its element size, and writes `__metadata__` first.
/// The reader refuses, naming the file and the fault, and making no tensor: a file shorter than 8 bytes, a header
/// longer than the limit or than the file, a header that is not UTF-8 JSON or not an object, a duplicate name, an
/// entry without a dtype, shape or two offsets, an unknown dtype (the message lists the known ones), offsets that
/// overlap or leave a gap, a size that does not match the shape, data that ends before or after the file's end, a
/// boolean byte that is not 0 or 1, and `__metadata__` values that are not strings. The JSON is parsed by
/// nlohmann/json (Debian's `nlohmann-json3-dev`), with a callback that catches duplicate keys, which it would
/// otherwise keep the last of.
///
/// Dtypes: BOOL, U8, I8, I16, I32, I64, F16, BF16, F32, F64, C64 on every LibTorch line; U16, U32, U64, F8_E4M3,
/// F8_E5M2 (LibTorch's `Float8_e4m3fn`, `Float8_e5m2`) from LibTorch 2.3. The module-level calls
/// (`volt::save_safetensors`, `volt::load_weights`) are volt/weights.hpp. `read` reads a file into memory; `map` maps it.

#include "volt/checkpoint/files.hpp"
#include "volt/detail/mapped_file.hpp"
#include "volt/errors.hpp"

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

static_assert(std::endian::native == std::endian::little,
              "volt: safetensors files are little-endian; this reader and writer copy bytes as they are, which is "
              "right on little-endian machines only.");

namespace volt {

/// Named tensors and string metadata: what a weights file holds, in the file's order.
struct TensorFile {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> metadata;
};

namespace safetensors {

/// The largest header the reader accepts (the reference implementation's limit).
inline constexpr uint64_t kMaxHeader = 100'000'000;

/// One tensor of a file as its header describes it.
struct Entry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  ///< into the data that follows the header
};

/// A checked header: the entries in the order of their offsets, and the metadata.
struct Header {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
};

namespace detail {

/// A dtype's name in the format, LibTorch's type, and its place in the reference writer's order.
struct Dtype {
  const char* name;
  at::ScalarType type;
  int order;
};

inline const std::vector<Dtype>& dtypes() {
  static const std::vector<Dtype> table = {
      {"BOOL", at::kBool, 0},        {"U8", at::kByte, 4},     {"I8", at::kChar, 5},
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
      {"F8_E5M2", at::ScalarType::Float8_e5m2, 6},             {"F8_E4M3", at::ScalarType::Float8_e4m3fn, 7},
      {"U16", at::ScalarType::UInt16, 12},                     {"U32", at::ScalarType::UInt32, 16},
      {"U64", at::ScalarType::UInt64, 21},
#endif
      {"I16", at::kShort, 11},       {"F16", at::kHalf, 13},   {"BF16", at::kBFloat16, 14},
      {"I32", at::kInt, 15},         {"F32", at::kFloat, 17},  {"C64", at::kComplexFloat, 18},
      {"F64", at::kDouble, 19},      {"I64", at::kLong, 20}};
  return table;
}

inline const Dtype* find(std::string_view name) {
  for (const auto& d : dtypes()) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

inline const Dtype* find(at::ScalarType type) {
  for (const auto& d : dtypes()) {
    if (type == d.type) return &d;
  }
  return nullptr;
}

inline std::string known_dtypes() {
  std::string out;
  for (const auto& d : dtypes()) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

[[noreturn]] inline void refuse(const std::string& origin, const std::string& why) {
  throw CheckpointError("volt: " + origin + " is not a valid safetensors file: " + why + "; nothing was loaded.");
}

/// Parses JSON, refusing a key that appears twice in one object (nlohmann/json keeps the last) and nesting deeper
/// than a header has (an entry's shape is at depth 3).
inline nlohmann::json parse_json(std::string_view text, const std::string& origin) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate, too_deep;
  auto seen = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if ((event == E::object_start || event == E::array_start) && depth > 3 && too_deep.empty()) {
      too_deep = "nested " + std::to_string(depth) + " levels deep";
    }
    if (event == E::object_start) keys.emplace_back();
    if (event == E::object_end && !keys.empty()) keys.pop_back();
    if (event == E::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second &&
        duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return too_deep.empty();
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end(), seen);
  } catch (const nlohmann::json::exception& e) {
    refuse(origin, std::string("its header is not JSON (") + e.what() + ")");
  }
  if (!too_deep.empty()) refuse(origin, "its header has a value " + too_deep + " (a header has 3)");
  if (!duplicate.empty()) refuse(origin, "its header names \"" + duplicate + "\" twice");
  return j;
}

inline uint64_t unsigned_of(const nlohmann::json& v, const std::string& origin, const std::string& what) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
    refuse(origin, what + " is " + v.dump() + ", not a non-negative integer");
  }
  return v.get<uint64_t>();
}

/// One tensor's entry, checked on its own (its offsets against the others come after).
inline Entry entry_of(const std::string& name, const nlohmann::json& v, const std::string& origin) {
  const std::string who = "the entry of \"" + name + "\"";
  if (!v.is_object()) refuse(origin, who + " is " + v.dump() + ", not an object");
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(field)) refuse(origin, who + " has no \"" + field + "\"");
  }
  Entry e{.name = name, .dtype = at::kFloat, .shape = {}};
  const auto& dtype = v.at("dtype");
  const Dtype* d = dtype.is_string() ? find(dtype.get<std::string>()) : nullptr;
  if (d == nullptr) refuse(origin, who + " has the dtype " + dtype.dump() + "; known dtypes: " + known_dtypes());
  e.dtype = d->type;
  const auto& shape = v.at("shape");
  if (!shape.is_array()) refuse(origin, who + " has the shape " + shape.dump() + ", not a list");
  for (const auto& s : shape) {
    const uint64_t n = unsigned_of(s, origin, "a dimension of " + name);
    if (n > static_cast<uint64_t>(INT64_MAX)) refuse(origin, who + " has a dimension of " + s.dump());
    e.shape.push_back(static_cast<int64_t>(n));
  }
  const auto& offsets = v.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) {
    refuse(origin, who + " has the data_offsets " + offsets.dump() + ", not a list of two offsets");
  }
  e.begin = unsigned_of(offsets[0], origin, "the first offset of " + name);
  e.end = unsigned_of(offsets[1], origin, "the second offset of " + name);
  if (e.end < e.begin) refuse(origin, who + " ends (" + std::to_string(e.end) + ") before it begins");
  return e;
}

/// The bytes a tensor of `e`'s shape and dtype takes, or a refusal on overflow.
inline uint64_t bytes_of(const Entry& e, const std::string& origin) {
  uint64_t n = c10::elementSize(e.dtype);
  for (int64_t s : e.shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(s), &n)) {
      refuse(origin, "the shape of \"" + e.name + "\" has more elements than 64 bits count");
    }
  }
  return n;
}

/// The offsets of every entry, sorted, must tile the data exactly.
inline void check_tiling(std::vector<Entry>& entries, uint64_t data_size, const std::string& origin) {
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return std::pair(a.begin, a.end) < std::pair(b.begin, b.end); });
  uint64_t at = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (e.begin < at) {
      refuse(origin, "the bytes of \"" + e.name + "\" (" + std::to_string(e.begin) + " to " + std::to_string(e.end) +
                         ") overlap those of \"" + entries[i - 1].name + "\" (to " + std::to_string(at) + ")");
    }
    if (e.begin > at) {
      refuse(origin, "the bytes " + std::to_string(at) + " to " + std::to_string(e.begin) +
                         " belong to no tensor (before \"" + e.name + "\")");
    }
    if (const uint64_t need = bytes_of(e, origin); e.end - e.begin != need) {
      refuse(origin, "\"" + e.name + "\" has " + std::to_string(e.end - e.begin) + " bytes, and its shape " +
                         c10::str(c10::IntArrayRef(e.shape)) + " of " + c10::toString(e.dtype) + " needs " +
                         std::to_string(need));
    }
    at = e.end;
  }
  if (at != data_size) {
    refuse(origin, "its tensors' bytes end at " + std::to_string(at) + " and the file has " +
                       std::to_string(data_size) + " bytes of data after the header");
  }
}

}  // namespace detail

/// Checks a header's JSON (`text`, the N bytes after the length) for a file with `data_size` bytes after it.
inline Header parse_header(std::string_view text, uint64_t data_size, const std::string& origin) {
  if (text.empty() || text.front() != '{') detail::refuse(origin, "its header does not start with '{'");
  const nlohmann::json j = detail::parse_json(text, origin);
  if (!j.is_object()) detail::refuse(origin, "its header is not a JSON object");
  Header h;
  for (const auto& [name, v] : j.items()) {
    if (name != "__metadata__") {
      h.entries.push_back(detail::entry_of(name, v, origin));
      continue;
    }
    if (!v.is_object()) detail::refuse(origin, "its __metadata__ is " + v.dump() + ", not an object");
    for (const auto& [k, s] : v.items()) {
      if (!s.is_string()) detail::refuse(origin, "its __metadata__ gives \"" + k + "\" the value " + s.dump() +
                                                     ", not a string");
      h.metadata.emplace(k, s.get<std::string>());
    }
  }
  detail::check_tiling(h.entries, data_size, origin);
  return h;
}

namespace detail {

/// The header's length from the first 8 bytes of a file of `size` bytes, checked against the limit and the size.
inline uint64_t header_length(const unsigned char* first8, uint64_t size, const std::string& origin) {
  if (size < 8) refuse(origin, "it has " + std::to_string(size) + " bytes, fewer than the 8 of the header's length");
  uint64_t n = 0;
  std::memcpy(&n, first8, 8);
  if (n > kMaxHeader) {
    refuse(origin, "its header's length is " + std::to_string(n) + " bytes, more than the limit of " +
                       std::to_string(kMaxHeader));
  }
  if (n > size - 8) {
    refuse(origin, "its header's length is " + std::to_string(n) + " bytes and only " + std::to_string(size - 8) +
                       " follow");
  }
  return n;
}

/// A tensor for `e` whose bytes `fill(destination)` writes; a boolean byte other than 0 or 1 is refused.
template <class Fill>
at::Tensor make_tensor(const Entry& e, Fill&& fill, const std::string& origin) {
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  if (e.end == e.begin) return t;  // no bytes (and perhaps no storage: a null data pointer)
  fill(static_cast<char*>(t.data_ptr()), e.end - e.begin);
  if (e.dtype == at::kBool) {
    const auto* b = static_cast<const unsigned char*>(t.data_ptr());
    if (std::any_of(b, b + (e.end - e.begin), [](unsigned char c) { return c > 1; })) {
      refuse(origin, "the BOOL tensor \"" + e.name + "\" holds a byte that is neither 0 nor 1");
    }
  }
  return t;
}

}  // namespace detail

/// Reads a safetensors file held in memory (`origin` names it in messages).
inline TensorFile decode(const char* data, std::size_t size, const std::string& origin) {
  const uint64_t n = detail::header_length(reinterpret_cast<const unsigned char*>(data), size, origin);
  Header h = parse_header(std::string_view(data + 8, n), size - 8 - n, origin);
  TensorFile out{.tensors = {}, .metadata = std::move(h.metadata)};
  const char* base = data + 8 + n;
  for (const Entry& e : h.entries) {
    auto copy = [&](char* to, uint64_t bytes) { std::memcpy(to, base + e.begin, bytes); };
    out.tensors.emplace_back(e.name, detail::make_tensor(e, copy, origin));
  }
  return out;
}

/// A safetensors file opened for reading a tensor at a time: the header read and checked whole when it opens, each
/// tensor's bytes read straight into it when asked (`pread`); `bytes_read()` counts what came from the file.
class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw CheckpointError("volt: cannot open " + path_ + ": " + std::strerror(errno));
    try {
      const off_t end = ::lseek(fd_, 0, SEEK_END);
      if (end < 0) throw CheckpointError("volt: cannot read " + path_ + ": " + std::strerror(errno));
      size_ = static_cast<uint64_t>(end);
      unsigned char first8[8] = {};
      if (size_ >= 8) read_at(reinterpret_cast<char*>(first8), 8, 0);
      const uint64_t n = detail::header_length(first8, size_, path_);
      text_.assign(n, '\0');
      read_at(text_.data(), n, 8);
      header_ = parse_header(text_, size_ - 8 - n, path_);
      for (std::size_t i = 0; i < header_.entries.size(); ++i) by_name_.emplace(header_.entries[i].name, i);
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;
  ~Reader() { ::close(fd_); }

  const Header& header() const { return header_; }
  /// The header's JSON as the file holds it (the N bytes after its length).
  const std::string& header_text() const { return text_; }
  /// The file's size in bytes.
  uint64_t size() const { return size_; }
  uint64_t bytes_read() const { return bytes_read_; }
  /// The entry named `name`, or null.
  const Entry* find(const std::string& name) const {
    const auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &header_.entries[it->second];
  }
  /// Entry `e`'s tensor, read from the file.
  at::Tensor read(const Entry& e) {
    auto fill = [&](char* to, uint64_t bytes) { read_at(to, bytes, 8 + text_.size() + e.begin); };
    return detail::make_tensor(e, fill, path_);
  }

 private:
  void read_at(char* to, uint64_t bytes, uint64_t offset) {
    for (uint64_t done = 0; done < bytes;) {
      const ssize_t r = ::pread(fd_, to + done, bytes - done, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) throw CheckpointError("volt: reading " + path_ + " failed: " + (r == 0 ? "it ended early" :
                                                                                             std::strerror(errno)));
      done += static_cast<uint64_t>(r);
    }
    bytes_read_ += bytes;
  }

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0, bytes_read_ = 0;
  std::string text_;
  Header header_;
  std::map<std::string, std::size_t> by_name_;  // into header_.entries
};

/// Reads a safetensors file: the header first, checked whole, then each tensor's bytes straight into it.
inline TensorFile read(const std::string& path) {
  Reader file(path);
  TensorFile out{.tensors = {}, .metadata = file.header().metadata};
  for (const Entry& e : file.header().entries) out.tensors.emplace_back(e.name, file.read(e));
  return out;
}

/// Reads a safetensors file by mapping it, copy-on-write: each tensor a view of the file's pages, read from the disk
/// when first touched, so a file held costs the pages in use, not its size, and no memory of the process's own; a
/// tensor written to gets this process's copy of the pages, and the file never changes. The header is checked as
/// `read` checks it; a tensor not aligned to its element size in the file, a boolean one (its bytes are checked) and an
/// empty one are copies.
inline TensorFile map(const std::string& path) {
  std::shared_ptr<::volt::detail::MappedFile> file;
  try {
    file = std::make_shared<::volt::detail::MappedFile>(path, ::volt::detail::MappedFile::Access::copy_on_write);
  } catch (const ::volt::detail::MapError& e) {
    throw CheckpointError("volt: " + path + ": " + e.what());
  }
  const uint64_t size = file->bytes();
  unsigned char first8[8] = {};
  if (size >= 8) std::memcpy(first8, file->data(), 8);
  const uint64_t n = detail::header_length(first8, size, path);
  Header h = parse_header(std::string_view(reinterpret_cast<const char*>(file->data()) + 8, n), size - 8 - n, path);
  TensorFile out{.tensors = {}, .metadata = std::move(h.metadata)};
  unsigned char* base = file->data() + 8 + n;
  for (const Entry& e : h.entries) {
    unsigned char* bytes = base + e.begin;
    const auto element = static_cast<uintptr_t>(c10::elementSize(e.dtype));
    if (e.end == e.begin || e.dtype == at::kBool || reinterpret_cast<uintptr_t>(bytes) % element != 0) {
      auto copy = [&](char* to, uint64_t count) { std::memcpy(to, bytes, count); };
      out.tensors.emplace_back(e.name, detail::make_tensor(e, copy, path));
    } else {
      out.tensors.emplace_back(e.name, at::from_blob(bytes, e.shape, [file](void*) {}, at::TensorOptions().dtype(e.dtype)));
    }
  }
  return out;
}

/// The header (JSON padded to a multiple of 8 bytes) and the tensors in the order their bytes follow it; each tensor
/// a contiguous CPU copy. Refuses an undefined tensor, a dtype the format has no name for, and a name given twice.
inline std::pair<std::string, std::vector<at::Tensor>> encode(const TensorFile& file, const std::string& origin) {
  std::vector<std::pair<const detail::Dtype*, std::size_t>> order;
  std::set<std::string> names;
  for (std::size_t i = 0; i < file.tensors.size(); ++i) {
    const auto& [name, t] = file.tensors[i];
    if (!names.insert(name).second) throw CheckpointError("volt: " + origin + ": the tensor name \"" + name +
                                                          "\" is given twice; nothing was written.");
    if (!t.defined()) throw CheckpointError("volt: " + origin + ": \"" + name + "\" is an undefined tensor.");
    const detail::Dtype* d = detail::find(t.scalar_type());
    if (d == nullptr || t.is_sparse() || t.is_quantized()) {
      throw CheckpointError("volt: " + origin + ": \"" + name + "\" is a " + t.toString() +
                            " tensor, which safetensors cannot hold (dense tensors of " + detail::known_dtypes() +
                            "); nothing was written.");
    }
    order.emplace_back(d, i);
  }
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    if (a.first->order != b.first->order) return a.first->order > b.first->order;
    return file.tensors[a.second].first < file.tensors[b.second].first;
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [d, i] : order) {
    at::Tensor t = file.tensors[i].second.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = t.numel() * t.element_size();
    header[file.tensors[i].first] = {{"dtype", d->name}, {"shape", t.sizes().vec()}, {"data_offsets", {offset,
                                                                                                     offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  return {std::move(text), std::move(data)};
}

/// Writes `file` to `path` atomically, as volt's checkpoints (volt/checkpoint/files.hpp's write_atomic).
inline void write(const std::string& path, const TensorFile& file) {
  const auto [text, data] = encode(file, path);
  const uint64_t n = text.size();
  std::vector<std::pair<const char*, std::size_t>> pieces{{reinterpret_cast<const char*>(&n), 8},
                                                          {text.data(), text.size()}};
  for (const auto& t : data) pieces.emplace_back(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  checkpoint::write_atomic(path, pieces);
}

}  // namespace safetensors
}  // namespace volt
