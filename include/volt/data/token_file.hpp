#pragma once
/// \file
/// Language-model data as it is kept on disk: a flat file of token ids, memory-mapped, never read whole.
///
/// - `volt::data::TokenFile`: a NumPy `.npy` file (a 1-D array of uint8, uint16, int32, uint32 or int64, C order,
///   little-endian: its header says which) or a raw file of ids of one type (nanoGPT's `train.bin`: uint16). The file
///   is mapped read-only; a window reads its few pages, so a 10 GB file costs the pages its windows touch.
/// - `volt::data::TokenLoader`: windows of `block_size + 1` tokens as nanoGPT's `get_batch` cuts them, a batch an
///   `Example{x, y}` of `[batch_size, block_size]` int64 ids, `y` being `x` shifted by one token. A `StatefulLoader`
///   (data/stateful.hpp): an exact position in checkpoints (a resumed fit reads the batches the uninterrupted one
///   would), sharding across ranks, worker threads.
///
/// | `Options::windows` | an epoch's windows | across ranks |
/// |---|---|---|
/// | `Windows::tiled` (default) | the file cut into `(tokens - 1) / block_size` windows one after another, window `i` starting at token `i * block_size`; in a seeded random order each epoch when `loader.shuffle` | each window to one rank: ranks' windows are disjoint |
/// | `Windows::random` | nanoGPT's draw: `windows_per_epoch` windows (0: as many as tiled), each starting at a token drawn uniformly from `[0, tokens - block_size)` by the generator of (seed, epoch, window number), so a resume draws the same | each rank draws its own windows; they may overlap, as nanoGPT's ranks' do |

#include "volt/data/stateful.hpp"
#include "volt/detail/mapped_file.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace volt::data {

/// The type of the ids in a token file.
enum class TokenType { uint8, uint16, int32, uint32, int64 };

inline const char* to_string(TokenType t) {
  switch (t) {
    case TokenType::uint8: return "uint8";
    case TokenType::uint16: return "uint16";
    case TokenType::int32: return "int32";
    case TokenType::uint32: return "uint32";
    case TokenType::int64: return "int64";
  }
  return "?";
}

inline int64_t byte_size(TokenType t) {
  switch (t) {
    case TokenType::uint8: return 1;
    case TokenType::uint16: return 2;
    case TokenType::int32:
    case TokenType::uint32: return 4;
    case TokenType::int64: return 8;
  }
  return 1;
}

namespace detail {

/// The value of `key` in a `.npy` header's dictionary (`{'descr': '<u2', 'fortran_order': False, 'shape': (9,), }`),
/// as written: `'<u2'`, `False`, `(9,)`; empty when absent.
inline std::string npy_field(std::string_view header, std::string_view key) {
  const std::string quoted = "'" + std::string(key) + "'";
  const auto at = header.find(quoted);
  if (at == std::string_view::npos) return {};
  auto p = header.find(':', at + quoted.size());
  if (p == std::string_view::npos) return {};
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  const char close = header[p] == '(' ? ')' : header[p] == '\'' ? '\'' : ',';
  const auto end = header.find(close, header[p] == '\'' || header[p] == '(' ? p + 1 : p);
  if (end == std::string_view::npos) return {};
  return std::string(header.substr(p, end - p + (close == ',' ? 0 : 1)));
}

}  // namespace detail

/// A memory-mapped file of token ids (see the file's comment). Copies share the mapping.
class TokenFile {
 public:
  /// `path`: a `.npy` file (its header gives the type), or raw ids of `raw_type`.
  explicit TokenFile(const std::filesystem::path& path, TokenType raw_type = TokenType::uint16) : path_(path) {
    try {
      map_ = std::make_shared<const ::volt::detail::MappedFile>(path);
    } catch (const ::volt::detail::MapError& e) {
      fail(e.what());
    }
    std::size_t offset = 0;
    if (path.extension() == ".npy") {
      offset = read_npy_header();
    } else {
      type_ = raw_type;
      if (map_->bytes() % static_cast<std::size_t>(byte_size(type_)) != 0) {
        fail(std::to_string(map_->bytes()) + " bytes is not a whole number of " + to_string(type_) + " ids (" +
                   std::to_string(byte_size(type_)) + " bytes each); give its type (nanoGPT's .bin files hold uint16)");
      }
      size_ = static_cast<int64_t>(map_->bytes()) / byte_size(type_);
    }
    data_ = map_->data() + offset;
  }

  /// Number of tokens.
  int64_t size() const { return size_; }
  TokenType type() const { return type_; }
  const std::filesystem::path& path() const { return path_; }

  /// Tokens `[start, start + length)` into `out`, as int64.
  void read(int64_t start, int64_t length, int64_t* out) const {
    if (start < 0 || length < 0 || start + length > size_) {
      throw std::out_of_range("volt: token file " + path_.string() + ": tokens [" + std::to_string(start) + ", " +
                              std::to_string(start + length) + ") asked of " + std::to_string(size_));
    }
    switch (type_) {
      case TokenType::uint8: return copy<uint8_t>(start, length, out);
      case TokenType::uint16: return copy<uint16_t>(start, length, out);
      case TokenType::int32: return copy<int32_t>(start, length, out);
      case TokenType::uint32: return copy<uint32_t>(start, length, out);
      case TokenType::int64: return copy<int64_t>(start, length, out);
    }
  }
  /// Tokens `[start, start + length)` as an int64 tensor.
  torch::Tensor read(int64_t start, int64_t length) const {
    torch::Tensor out = torch::empty({length}, torch::kInt64);
    read(start, length, out.data_ptr<int64_t>());
    return out;
  }

 private:
  template <class T>
  void copy(int64_t start, int64_t length, int64_t* out) const {
    const unsigned char* p = data_ + start * static_cast<int64_t>(sizeof(T));
    for (int64_t i = 0; i < length; ++i) {
      T v;
      std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));  // .npy data need not be aligned
      out[i] = static_cast<int64_t>(v);
    }
  }

  /// Reads a `.npy` header (format 1, 2 or 3); returns where the data start.
  std::size_t read_npy_header() {
    const unsigned char* b = map_->data();
    const std::size_t n = map_->bytes();
    if (n < 10 || std::memcmp(b, "\x93NUMPY", 6) != 0) fail("not a .npy file (no \\x93NUMPY magic)");
    const int major = b[6];
    const std::size_t fixed = major == 1 ? 10 : 12;
    if (major < 1 || major > 3 || n < fixed) fail(".npy format " + std::to_string(major) + " is not known (1-3 are)");
    const std::size_t header_len = major == 1 ? (b[8] | (b[9] << 8))
                                              : (b[8] | (b[9] << 8) | (b[10] << 16) | (std::size_t(b[11]) << 24));
    if (fixed + header_len > n) fail("the .npy header runs past the end of the file");
    const std::string_view header(reinterpret_cast<const char*>(b + fixed), header_len);
    const std::string descr = detail::npy_field(header, "descr");
    const std::string order = detail::npy_field(header, "fortran_order");
    const std::string shape = detail::npy_field(header, "shape");
    static constexpr std::pair<const char*, TokenType> known[] = {
        {"'|u1'", TokenType::uint8}, {"'<u2'", TokenType::uint16}, {"'<i4'", TokenType::int32},
        {"'<u4'", TokenType::uint32}, {"'<i8'", TokenType::int64}};
    bool found = false;
    for (const auto& [name, type] : known) {
      if (descr == name) {
        type_ = type;
        found = true;
      }
    }
    if (!found) {
      fail("its ids are " + (descr.empty() ? std::string("of no stated type") : descr) +
                 "; token files hold '|u1', '<u2', '<i4', '<u4' or '<i8' (little-endian integers)");
    }
    if (order != "False") fail("its array is in Fortran order; save a C-ordered one");
    // A 1-D shape is "(N,)".
    if (shape.size() < 4 || shape.front() != '(' || shape.substr(shape.size() - 2) != ",)" ||
        shape.find(',') != shape.size() - 2) {
      fail("its shape is " + shape + "; a token file is one flat array, shape (N,)");
    }
    size_ = std::stoll(shape.substr(1, shape.size() - 3));
    const std::size_t data_bytes = static_cast<std::size_t>(size_ * byte_size(type_));
    if (fixed + header_len + data_bytes != n) {
      fail("its header says " + std::to_string(size_) + " ids (" + std::to_string(data_bytes) + " bytes), and " +
                 std::to_string(n - fixed - header_len) + " bytes follow it");
    }
    return fixed + header_len;
  }

  [[noreturn]] void fail(const std::string& why) const {
    throw std::invalid_argument("volt: token file " + path_.string() + ": " + why);
  }

  std::shared_ptr<const ::volt::detail::MappedFile> map_;
  std::filesystem::path path_;
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
  TokenType type_ = TokenType::uint16;
};

/// How a TokenLoader cuts an epoch's windows (see the file's comment).
enum class Windows { tiled, random };

/// Windows of a token file as nanoGPT's batches (see the file's comment).
class TokenLoader : public StatefulLoader<TokenLoader> {
 public:
  struct Options {
    /// Tokens in `x` (and in `y`) of each window.
    int64_t block_size = 256;
    Windows windows = Windows::tiled;
    /// `Windows::random`: windows drawn an epoch; 0: as many as tiled cuts.
    int64_t windows_per_epoch = 0;
    /// Batch size, shuffling of tiled windows, seed, workers (LoaderOptions).
    LoaderOptions loader = {};
  };

  TokenLoader(TokenFile tokens, Options options)
      : StatefulLoader(options.loader), tokens_(std::move(tokens)), options_(options) {
    const auto where = "volt: TokenLoader over " + tokens_.path().string() + ": ";
    if (options_.block_size < 1) {
      throw std::invalid_argument(where + "block_size=" + std::to_string(options_.block_size) +
                                  " is not allowed: give a number >= 1.");
    }
    if (tokens_.size() < options_.block_size + 1) {
      throw std::invalid_argument(where + "it holds " + std::to_string(tokens_.size()) + " tokens, fewer than one "
                                  "window of block_size + 1 = " + std::to_string(options_.block_size + 1) + ".");
    }
    if (options_.windows_per_epoch < 0) {
      throw std::invalid_argument(where + "windows_per_epoch=" + std::to_string(options_.windows_per_epoch) +
                                  " is not allowed: give 0 (as many as tiled windows) or more.");
    }
  }

  const TokenFile& tokens() const { return tokens_; }
  int64_t block_size() const { return options_.block_size; }

  /// The first token of window `index` of `epoch` (its `x`).
  int64_t window_start(int64_t index, const FetchContext& ctx) const {
    if (options_.windows == Windows::tiled) return index * options_.block_size;
    at::Generator g = ctx.generator(index);
    const auto draw = g.get<at::CPUGeneratorImpl>()->random64();
    return static_cast<int64_t>(draw % static_cast<uint64_t>(tokens_.size() - options_.block_size));
  }

  // ---- what StatefulLoader asks ----
  int64_t num_items() const {
    const int64_t tiled = (tokens_.size() - 1) / options_.block_size;
    return options_.windows == Windows::random && options_.windows_per_epoch > 0 ? options_.windows_per_epoch : tiled;
  }
  torch::data::Example<> fetch(const torch::Tensor& indices, const FetchContext& ctx) const {
    const int64_t b = indices.numel(), t = options_.block_size;
    torch::Tensor rows = torch::empty({b, t + 1}, torch::kInt64);
    const auto idx = indices.contiguous();
    const int64_t* index = idx.data_ptr<int64_t>();
    for (int64_t r = 0; r < b; ++r) tokens_.read(window_start(index[r], ctx), t + 1, rows[r].data_ptr<int64_t>());
    return {rows.slice(1, 0, t).contiguous(), rows.slice(1, 1).contiguous()};
  }

 private:
  TokenFile tokens_;
  Options options_;
};

}  // namespace volt::data
