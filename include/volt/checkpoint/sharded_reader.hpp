#pragma once
/// \file
/// Reading the sharded checkpoint form (volt/checkpoint/sharded.hpp, which includes this at its end, has the table of
/// its files): `ShardedReader` reads any box of any tensor whatever boxes the writing ranks held, and `read_sharded`,
/// through it, a folder as the full form's contents.

#include "volt/checkpoint/sharded.hpp"
#include "volt/checkpoint/box.hpp"
#include "volt/checkpoint/safetensors.hpp"
#include "volt/checkpoint/pytorch_optimizer.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace volt {
namespace checkpoint {

namespace detail {

/// The most runs of contiguous elements a box may have (a cut along the last dimension of a [2^26, n] weight).
inline constexpr int64_t kMaxRuns = int64_t{1} << 26;

[[noreturn]] inline void sharded_fail(const std::string& dir, const std::string& what) {
  throw CheckpointError("volt: the sharded checkpoint " + dir + " " + what);
}

/// `v` as an integer list (a shape, offsets, sizes), refused where the index holds anything else there.
inline std::vector<int64_t> ints_of(const nlohmann::json& v, const std::string& name, const std::string& dir) {
  std::vector<int64_t> out;
  const bool list = v.is_array() && std::all_of(v.begin(), v.end(), [](const nlohmann::json& e) {
    return e.is_number_integer();
  });
  if (!list) sharded_fail(dir, "gives " + name + " " + v.dump() + " where a list of integers belongs.");
  for (const auto& e : v) out.push_back(e.get<int64_t>());
  return out;
}
inline int64_t int_of(const nlohmann::json& v, const std::string& name, const std::string& dir) {
  if (!v.is_number_integer()) sharded_fail(dir, "gives " + name + " " + v.dump() + " where an integer belongs.");
  return v.get<int64_t>();
}

/// The elements of tensor `name`'s shape `shape`, refused where no tensor has that shape.
inline int64_t numel_of(const std::vector<int64_t>& shape, const std::string& name, const std::string& dir) {
  int64_t total = 1;
  for (const int64_t s : shape) {
    if (s < 0 || (s > 0 && total > std::numeric_limits<int64_t>::max() / s)) {
      sharded_fail(dir, "gives " + name + " the shape " + nlohmann::json(shape).dump() + ", which no tensor has.");
    }
    total *= s;
  }
  return total;
}
/// `b`, checked to be a box of tensor `name` (of shape `shape`): a view of as many elements, and every range inside it
/// and not empty; `shown` is how the message shows it.
inline Box inside(Box b, const std::vector<int64_t>& shape, const std::string& name, const std::string& dir,
                  const std::string& shown) {
  const int64_t total = numel_of(shape, name, dir);
  int64_t view = 1;
  bool ok = b.offsets.size() == b.view.size() && b.sizes.size() == b.view.size();
  for (std::size_t d = 0; ok && d < b.view.size(); ++d) {
    ok = b.view[d] > 0 && view <= std::numeric_limits<int64_t>::max() / b.view[d] && b.offsets[d] >= 0 &&
         b.sizes[d] > 0 && b.offsets[d] <= b.view[d] - b.sizes[d];
    view *= ok ? b.view[d] : 1;
  }
  if (!ok || view != total) {
    sharded_fail(dir, "gives " + name + " (shape " + nlohmann::json(shape).dump() + ") a box that is not inside it: " +
                          shown + ".");
  }
  int64_t runs = 1;  // runs_of's count: the sizes before the last dimension cut
  std::size_t m = b.view.empty() ? 0 : b.view.size() - 1;
  while (m > 0 && b.sizes[m] == b.view[m]) --m;
  for (std::size_t d = 0; d < m; ++d) runs = std::min<int64_t>(runs * b.sizes[d], kMaxRuns + 1);
  if (runs > kMaxRuns) {
    sharded_fail(dir, "gives " + name + " a box of more than " + std::to_string(kMaxRuns) + " separate runs of elements: " +
                          shown + ".");
  }
  return b;
}
/// Piece `p` of tensor `name` as the index gives it (format 2: a box; format 1: a flat range), checked.
inline Box box_of(const nlohmann::json& p, const std::vector<int64_t>& shape, const std::string& name,
                  const std::string& dir) {
  Box b = p.contains("sizes") ? Box{p.contains("view") ? ints_of(p.at("view"), name, dir) : shape,
                                    ints_of(p.at("offsets"), name, dir), ints_of(p.at("sizes"), name, dir)}
                              : Box::flat(numel_of(shape, name, dir), int_of(p.at("offset"), name, dir),
                                          int_of(p.at("numel"), name, dir));
  return inside(std::move(b), shape, name, dir, p.dump());
}

}  // namespace detail

/// A sharded checkpoint's folder, read a box at a time: the index read and checked when it opens (format, version,
/// checksum, and that each tensor's pieces tile it exactly), each rank file's header when a piece of it is first
/// needed (its size and CRC-32 checked against the index), and each piece's bytes only when a box asked for overlaps it
/// (checked against the CRC-32 the index gives them). So a rank that asks for its own boxes reads its pieces, the
/// headers of the files they are in, and the index; `bytes_read()` counts it. Format 1 folders, whose index gives each
/// file one CRC-32, are read a whole file at a time.
class ShardedReader {
 public:
  explicit ShardedReader(std::string dir) : dir_(std::move(dir)) {
    try {
      index_ = read_index();
      const nlohmann::json& files = index_.at("files");
      for (std::size_t r = 0; r < files.size(); ++r) {  // checked here: open() and piece() read them
        const nlohmann::json& f = files.at(r);
        const std::string want = detail::rank_file_name(static_cast<int>(r), static_cast<int>(files.size()));
        if (!f.at("file").is_string() || f.at("file").get<std::string>() != want || !f.at("bytes").is_number_unsigned() ||
            !(version_ == 1 ? f.at("crc32") : f.at("header_crc32")).is_number_unsigned()) {
          detail::sharded_fail(dir_, "lists rank file " + std::to_string(r) + " as " + f.dump() + "; volt writes " +
                                         want + " with its size and CRC-32.");
        }
      }
      files_.resize(files.size());
      for (const auto& [name, t] : index_.at("tensors").items()) add_tensor(name, t);
    } catch (const nlohmann::json::exception& e) {
      detail::sharded_fail(dir_, std::string("has an index.json that is not what volt writes (") + e.what() + ").");
    }
  }

  const nlohmann::json& index() const { return index_; }
  const std::string& dir() const { return dir_; }
  uint64_t bytes_read() const { return bytes_read_; }
  /// The tensors the index names (`state_dict.<parameter>`, `optimizer_states.<i>.<parameter>.<field>`).
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, t] : tensors_) out.push_back(name);
    return out;
  }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const std::vector<int64_t>& shape(const std::string& name) const { return tensor(name).shape; }

  /// Box `box` of tensor `name` (a CPU tensor of the box's sizes and the file's dtype), from the pieces it overlaps.
  at::Tensor read(const std::string& name, const Box& box) {
    try {
      return read_box(name, box);
    } catch (const nlohmann::json::exception& e) {
      detail::sharded_fail(dir_, std::string("has an index.json that is not what volt writes (") + e.what() + ").");
    }
  }

 private:
  at::Tensor read_box(const std::string& name, const Box& box) {
    const Tensor& t = tensor(name);
    const std::string shown =
        nlohmann::json({{"view", box.view}, {"offsets", box.offsets}, {"sizes", box.sizes}}).dump();
    if (detail::numel_of(t.shape, name, dir_) == 0) {  // no pieces: only all of it, of no elements, can be asked
      if (box != Box::whole(t.shape)) detail::inside(box, t.shape, name, dir_, shown);
      return at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
    }
    const std::vector<detail::Run> runs = detail::runs_of(detail::inside(box, t.shape, name, dir_, shown));
    at::Tensor out = at::empty(box.sizes, at::TensorOptions().dtype(t.dtype));
    int64_t filled = 0;
    for (const Piece& p : t.pieces) {
      if (!detail::share(runs, p.runs)) continue;  // its bytes are not read
      const at::Tensor bytes = piece(name, p, t);
      filled += detail::copy_shared(runs, static_cast<char*>(out.data_ptr()), p.runs,
                                    static_cast<const char*>(bytes.data_ptr()), out.element_size());
    }
    if (filled != box.numel()) detail::sharded_fail(dir_, "holds " + std::to_string(filled) + " of the " +
                                                              std::to_string(box.numel()) + " elements asked of " + name + ".");
    return out;
  }

  struct Piece {
    std::size_t file = 0;
    Box box;
    int64_t crc = -1;  ///< format 1: none (the file's)
    std::vector<detail::Run> runs;
  };
  struct Tensor {
    std::vector<int64_t> shape;
    at::ScalarType dtype = at::kFloat;
    std::vector<Piece> pieces;
  };
  struct File {
    std::unique_ptr<safetensors::Reader> reader;  ///< format 2
    std::map<std::string, at::Tensor> whole;      ///< format 1: every tensor of the file, read at once
    bool open = false;
  };

  const Tensor& tensor(const std::string& name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) detail::sharded_fail(dir_, "holds no tensor " + name + ".");
    return it->second;
  }
  nlohmann::json read_index();
  void add_tensor(const std::string& name, const nlohmann::json& t);
  File& open(std::size_t r);
  at::Tensor piece(const std::string& name, const Piece& p, const Tensor& t);

  std::string dir_;
  nlohmann::json index_;
  int64_t version_ = 0;
  std::map<std::string, Tensor> tensors_;
  std::vector<File> files_;
  uint64_t bytes_read_ = 0;
};

/// The index of the folder, checked: format, version and checksum.
inline nlohmann::json ShardedReader::read_index() {
  const std::string path = (std::filesystem::path(dir_) / kIndexName).string();
  std::ifstream in(path, std::ios::binary);
  if (!in) detail::sharded_fail(dir_, "has no readable " + std::string(kIndexName) + ".");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  bytes_read_ += text.size();
  nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!index.is_object()) {
    detail::sharded_fail(dir_, "has an index.json that is not a JSON object (" + std::to_string(text.size()) + " bytes).");
  }
  if (index.value("format", std::string()) != kShardedFormat) {
    detail::sharded_fail(dir_, std::string("has an index.json whose \"format\" is not \"") + kShardedFormat + "\".");
  }
  version_ = index.value("format_version", int64_t{-1});
  if (version_ < 1 || version_ > kShardedFormatVersion) {
    detail::sharded_fail(dir_, "has format version " + std::to_string(version_) + "; this volt (" + version_string +
                                   ") reads version 1 to " + std::to_string(kShardedFormatVersion) + ".");
  }
  const int64_t stored = index.value("checksum", int64_t{-1});
  index.erase("checksum");
  if (stored != static_cast<int64_t>(::volt::checkpoint::detail::crc(0, index.dump()))) {
    detail::sharded_fail(dir_, "has an index.json that does not match its checksum (it was changed after it was written).");
  }
  return index;
}

/// Tensor `name` of the index, its pieces checked to tile it exactly (no gap, no overlap).
inline void ShardedReader::add_tensor(const std::string& name, const nlohmann::json& t) {
  Tensor out;
  out.shape = detail::ints_of(t.at("shape"), name, dir_);
  const auto* dtype = t.at("dtype").is_null() ? nullptr : safetensors::detail::find(t.at("dtype").get<std::string>());
  if (dtype == nullptr && !t.at("pieces").empty()) detail::sharded_fail(dir_, "names an unknown dtype for " + name + ".");
  out.dtype = dtype == nullptr ? at::kFloat : dtype->type;
  std::vector<detail::Run> all;
  for (const auto& p : t.at("pieces")) {
    const int64_t file = detail::int_of(p.at("file"), name, dir_);
    if (file < 0 || static_cast<std::size_t>(file) >= files_.size()) {
      detail::sharded_fail(dir_, "puts a piece of " + name + " in a file it does not list.");
    }
    const bool crc = p.contains("crc32") && p.at("crc32").is_number_unsigned();
    if (version_ >= 2 && !crc) detail::sharded_fail(dir_, "gives a piece of " + name + " no CRC-32.");
    Piece piece{static_cast<std::size_t>(file), detail::box_of(p, out.shape, name, dir_),
                crc ? static_cast<int64_t>(p.at("crc32").get<uint32_t>()) : int64_t{-1}, {}};
    piece.runs = detail::runs_of(piece.box);
    all.insert(all.end(), piece.runs.begin(), piece.runs.end());
    out.pieces.push_back(std::move(piece));
  }
  std::sort(all.begin(), all.end(), [](const detail::Run& a, const detail::Run& b) { return a.start < b.start; });
  int64_t covered = 0;
  for (const detail::Run& r : all) {
    if (r.start != covered) {
      detail::sharded_fail(dir_, "does not hold all of " + name + ": its pieces leave a gap or overlap at element " +
                                     std::to_string(std::min(r.start, covered)) + ".");
    }
    covered += r.length;
  }
  const int64_t numel = detail::numel_of(out.shape, name, dir_);
  if (covered != numel) {
    detail::sharded_fail(dir_, "holds " + std::to_string(covered) + " of the " + std::to_string(numel) +
                                   " elements of " + name + ".");
  }
  tensors_.emplace(name, std::move(out));
}

/// Rank file `r`, opened once: its size and header (format 2) or its whole bytes (format 1) checked against the index.
inline ShardedReader::File& ShardedReader::open(std::size_t r) {
  File& f = files_.at(r);
  if (f.open) return f;
  const nlohmann::json& entry = index_.at("files").at(r);
  const std::string file = entry.at("file").get<std::string>();
  const std::string path = (std::filesystem::path(dir_) / file).string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    detail::sharded_fail(dir_, "is missing " + file + " (rank " + std::to_string(r) + "'s pieces).");
  }
  auto damaged = [&](uint64_t size, const std::string& what) {
    detail::sharded_fail(dir_, "has a damaged " + file + " (" + std::to_string(size) + " bytes; the index says " +
                                   entry.at("bytes").dump() + " and " + what + ").");
  };
  if (version_ == 1) {
    std::ifstream in(path, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bytes_read_ += bytes.size();
    if (bytes.size() != entry.at("bytes").get<std::size_t>() ||
        ::volt::checkpoint::detail::crc(0, bytes.data(), bytes.size()) != entry.at("crc32").get<uint32_t>()) {
      damaged(bytes.size(), "another CRC-32");
    }
    for (auto& [name, t] : safetensors::decode(bytes.data(), bytes.size(), path).tensors) f.whole.emplace(name, t);
  } else {
    try {
      f.reader = std::make_unique<safetensors::Reader>(path);
    } catch (const CheckpointError& e) {
      damaged(std::filesystem::file_size(path, ec), std::string("its header does not read: ") + e.what());
    }
    bytes_read_ += f.reader->bytes_read();
    if (f.reader->size() != entry.at("bytes").get<uint64_t>() ||
        ::volt::checkpoint::detail::crc(0, f.reader->header_text()) != entry.at("header_crc32").get<uint32_t>()) {
      damaged(f.reader->size(), "another CRC-32 of its header");
    }
  }
  f.open = true;
  return f;
}

/// Piece `p` of tensor `name`, its elements in its box's order, read (format 2) and checked against its CRC-32.
inline at::Tensor ShardedReader::piece(const std::string& name, const Piece& p, const Tensor& t) {
  File& f = open(p.file);
  const std::string file = index_.at("files").at(p.file).at("file").get<std::string>();
  auto missing = [&] {
    detail::sharded_fail(dir_, "has no piece of " + name + " of " + std::to_string(p.box.numel()) + " elements in " +
                                   file + ", where its index puts one.");
  };
  at::Tensor out;
  if (version_ == 1) {
    const auto it = f.whole.find(name);
    if (it == f.whole.end()) missing();
    out = it->second;
  } else {
    const safetensors::Entry* e = f.reader->find(name);
    if (e == nullptr) missing();
    const uint64_t before = f.reader->bytes_read();
    out = f.reader->read(*e);
    bytes_read_ += f.reader->bytes_read() - before;
    if (::volt::checkpoint::detail::crc(0, out.data_ptr(), out.numel() * out.element_size()) != static_cast<uint32_t>(p.crc)) {
      detail::sharded_fail(dir_, "has a damaged " + file + " (the bytes of " + name +
                                     " do not match the CRC-32 the index gives them).");
    }
  }
  if (out.numel() != p.box.numel() || out.scalar_type() != t.dtype) missing();
  return out.contiguous();
}

namespace detail {

/// Optimizer `i`'s archive in the layout of an unsharded run: its skeleton loaded into an optimizer of its family over
/// stand-ins for the parameters, each parameter's state put back whole, archived again.
inline at::Tensor assemble_optimizer(const nlohmann::json& o, std::size_t i, const at::Tensor& skeleton,
                                     ShardedReader& reader) {
  const std::string& dir = reader.dir();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<std::pair<std::string, at::Tensor>> stand_ins;
  for (const auto& g : o.at("groups")) {
    std::vector<at::Tensor> params;
    for (const auto& name : g) {
      params.push_back(torch::empty({0}));
      stand_ins.emplace_back(name.get<std::string>(), params.back());
    }
    groups.emplace_back(std::move(params));
  }
  auto optimizer = make_optimizer(o.at("family").get<std::string>(), std::move(groups), dir);
  load_optimizer_state(*optimizer, skeleton, dir);
  ::volt::detail::with_state_codec(*optimizer, [&](auto codec) {
    using Codec = decltype(codec);
    for (const auto& [name, stand_in] : stand_ins) {
      if (!o.at("steps").contains(name)) continue;  // no state yet
      std::vector<at::Tensor> fields(Codec::fields);
      for (std::size_t f = 0; f < Codec::fields; ++f) {
        const std::string key = "optimizer_states." + std::to_string(i) + "." + name + "." + Codec::names[f];
        if (reader.contains(key)) fields[f] = reader.read(key, Box::whole(reader.shape(key)));
      }
      ::volt::detail::put_state(*optimizer, stand_in, Codec::make(fields, o.at("steps").at(name).template get<int64_t>()));
    }
  });
  return optimizer_state(*optimizer);
}

}  // namespace detail

/// Reads the sharded checkpoint in `dir` (checked) as the full form's contents.
inline Dict read_sharded(const std::string& dir) {
  try {
    ShardedReader reader(dir);
    const nlohmann::json& index = reader.index();
    Dict d = read((std::filesystem::path(dir) / kMetaName).string());
    Dict weights = make_dict();  // the parameters, then what meta.ckpt holds (the buffers)
    const std::string prefix = std::string(keys::state_dict) + ".";
    const Dict meta_weights = d.at(keys::state_dict).toGenericDict();
    for (const auto& name : index.at("parameters")) {  // in the module's order
      const std::string n = name.get<std::string>();
      if (!reader.contains(prefix + n)) detail::sharded_fail(dir, "lists the parameter " + n + " but holds no tensor for it.");
      if (!meta_weights.contains(n)) weights.insert(n, reader.read(prefix + n, Box::whole(reader.shape(prefix + n))));
    }
    for (const auto& e : meta_weights) weights.insert(e.key(), e.value());
    d.insert_or_assign(keys::state_dict, weights);
    if (d.contains(keys::optimizer_states)) {
      c10::impl::GenericList archives = d.at(keys::optimizer_states).toList();
      for (std::size_t i = 0; i < archives.size(); ++i) {
        const nlohmann::json& o = index.at("optimizers").at(i);
        if (!o.is_null()) archives.set(i, detail::assemble_optimizer(o, i, archives.get(i).toTensor(), reader));
      }
    }
    return d;
  } catch (const nlohmann::json::exception& e) {
    detail::sharded_fail(dir, std::string("has an index.json that is not what volt writes (") + e.what() + ").");
  }
}
}  // namespace checkpoint
}  // namespace volt
