#pragma once
/// \file
/// The sharded checkpoint form, part of volt/checkpoint.hpp (writer.hpp includes it at its end): a folder in place of
/// the file, written by every rank at once, each its own pieces of the parameters and of the optimizers' state, and
/// read by any world size and any data-parallel layout (as PyTorch's distributed checkpoints, and Lightning's
/// `state_dict_type="sharded"`). A strategy picks it (`DataParallel::set_state_dict_type`); the Trainer's
/// `save_checkpoint` then writes it wherever it would write a file, ModelCheckpoint's files included.
///
/// | file | contents |
/// |---|---|
/// | `index.json` | `format` (`"volt.sharded_checkpoint"`), `format_version` (2), `world_size`; `parameters`: the module's parameter names in its order; `files`: each rank's file, its `bytes` and `header_crc32` (of its safetensors header); `tensors`: by global name, its `shape`, `dtype` (safetensors' names) and `pieces`, each a `file` (index into `files`), a box (`offsets` and `sizes` along each dimension of the tensor, or of its `view` where one is given: `[numel]` for a range of its flat elements) and the `crc32` of its bytes; `optimizers`: per optimizer, `null` where its whole archive is in `meta.ckpt`, else its `family`, its groups' parameter names and each parameter's `step`; `checksum`: CRC-32 of the rest as JSON |
/// | `meta.ckpt` | a checkpoint file (volt/checkpoint.hpp's table) with everything else: `state_dict` holds the buffers, `optimizer_states` each optimizer's archive without per-parameter state (its groups and their options) |
/// | `rank-R-of-W.safetensors` | rank R's pieces, each of its box's sizes: `state_dict.<parameter>` and `optimizer_states.<i>.<parameter>.<field>` (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `momentum_buffer`) |
///
/// Atomic as a file is: every file goes into `<path>.tmp.<pid of rank zero>` and is flushed; rank zero writes the
/// index and `meta.ckpt` once every rank's file is there, then swaps the folder in (`replace_atomically`: whatever
/// `path` held, file or folder, is replaced in one step and deleted after). A job killed at any moment leaves `path`
/// as it was, or whole. `ShardedReader` reads such a folder a box at a time (any box of any tensor, whatever boxes the
/// writer's ranks held, as PyTorch's distributed checkpoints read their chunks): the index checked (its checksum, and
/// that the pieces tile each tensor exactly), and only the pieces the boxes asked for overlap read, each checked
/// against its CRC-32. `checkpoint::read` of a folder asks for every tensor whole and assembles the full form's
/// contents (the weights whole, each optimizer's archive in the layout of an unsharded run), so that everything that
/// reads a checkpoint reads either form. Format 1 (flat ranges, `offset` and `numel`; a CRC-32 per file) is read too.

#include "volt/checkpoint.hpp"
#include "volt/checkpoint/safetensors.hpp"
#include "volt/checkpoint/writer.hpp"
#include "volt/checkpoint/optimizer_state.hpp"
#include "volt/checkpoint/pytorch_optimizer.hpp"

#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace volt {

/// How a data-parallel strategy writes checkpoints (Lightning's `state_dict_type`): `full`, one file from rank zero
/// (FSDP gathers it unit by unit); `sharded`, a folder of every rank's pieces written at once
/// (volt/checkpoint/sharded.hpp).
enum class StateDictType { full, sharded };

namespace checkpoint {

// volt/checkpoint/pytorch_optimizer.hpp (included above): declared here too, for a unit in which that header comes
// first and so is only defined after this one.
inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& family,
                                                               std::vector<torch::optim::OptimizerParamGroup> groups,
                                                               const std::string& path);

inline constexpr const char* kShardedFormat = "volt.sharded_checkpoint";
inline constexpr int64_t kShardedFormatVersion = 2;
inline constexpr const char* kIndexName = "index.json";
inline constexpr const char* kMetaName = "meta.ckpt";

/// A box of a tensor: along each dimension of the tensor viewed as `view` (its own shape; `{numel}` for a range of its
/// flattened elements; any shape of as many elements, such as a fused weight's `{3, d, d}`), the elements from
/// `offsets[d]` to `offsets[d] + sizes[d]`. PyTorch's distributed checkpoints call it a chunk (offsets and sizes); the
/// view lets a range of flat buckets' elements, which crosses rows, be one too.
struct Box {
  std::vector<int64_t> view, offsets, sizes;
  int64_t numel() const {
    int64_t n = 1;
    for (const int64_t s : sizes) n *= s;
    return n;
  }
  /// Elements [offset, offset + numel) of a tensor of `total` elements, flattened.
  static Box flat(int64_t total, int64_t offset, int64_t numel) { return {{total}, {offset}, {numel}}; }
  /// All of a tensor of shape `shape`.
  static Box whole(const std::vector<int64_t>& shape) { return {shape, std::vector<int64_t>(shape.size(), 0), shape}; }
  bool operator==(const Box&) const = default;
};

/// The part of module parameter `param` that one rank writes.
struct Slice {
  std::size_t param = 0;
  Box box;
  at::Tensor value;           ///< those elements (any shape of `box.numel()` elements)
  at::Tensor holder;          ///< the tensor an optimizer files their state under
  int64_t holder_offset = 0;  ///< where they start in the holder's state, flattened (the box's elements follow in order)
};

/// Rank `rank`'s part of parameter `j` (`p`) where every rank holds it whole: the `world` near-equal flat ranges'
/// `rank`-th, when it has elements.
inline std::optional<Slice> replicated_slice(std::size_t j, const at::Tensor& p, int rank, int world) {
  const int64_t per = (p.numel() + world - 1) / world;
  const int64_t offset = std::min<int64_t>(per * rank, p.numel());
  const int64_t numel = std::min<int64_t>(per, p.numel() - offset);
  if (numel <= 0) return std::nullopt;
  return Slice{j, Box::flat(p.numel(), offset, numel), p.detach().reshape(-1).narrow(0, offset, numel), p, offset};
}
inline std::vector<Slice> replicated_slices(const std::vector<at::Tensor>& params, int rank, int world) {
  std::vector<Slice> out;
  for (std::size_t j = 0; j < params.size(); ++j) {
    if (auto s = replicated_slice(j, params[j], rank, world)) out.push_back(std::move(*s));
  }
  return out;
}

namespace detail {

/// Elements [start, start + length) of a tensor, flattened, found at `local` in a box's own (row-major) order.
struct Run {
  int64_t start = 0, length = 0, local = 0;
  int64_t end() const { return start + length; }
};
/// A box as the runs of the tensor's flat elements it holds, in order (one for a flat range or rows cut whole).
inline std::vector<Run> runs_of(const Box& b) {
  const std::size_t d = b.view.size();
  if (d == 0) return {{0, 1, 0}};
  if (b.numel() == 0) return {};
  std::vector<int64_t> stride(d, 1);
  for (std::size_t i = d - 1; i-- > 0;) stride[i] = stride[i + 1] * b.view[i + 1];
  std::size_t m = d - 1;  // the dimension a run is cut along: those after it are whole
  while (m > 0 && b.sizes[m] == b.view[m]) --m;
  const int64_t length = b.sizes[m] * stride[m];
  std::vector<int64_t> at(m, 0);
  std::vector<Run> out;
  for (int64_t local = 0;; local += length) {
    int64_t start = b.offsets[m] * stride[m];
    for (std::size_t i = 0; i < m; ++i) start += (b.offsets[i] + at[i]) * stride[i];
    out.push_back({start, length, local});
    std::size_t i = m;
    while (i > 0 && ++at[i - 1] == b.sizes[i - 1]) at[--i] = 0;
    if (i == 0) return out;
  }
}
/// Calls `each(a_run, b_run, lo, hi)` for every stretch [lo, hi) of flat elements that runs `a` and `b` (each in
/// order) both hold.
template <class F>
void for_shared(const std::vector<Run>& a, const std::vector<Run>& b, F&& each) {
  for (std::size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    const int64_t lo = std::max(a[i].start, b[j].start), hi = std::min(a[i].end(), b[j].end());
    if (lo < hi) each(a[i], b[j], lo, hi);
    a[i].end() < b[j].end() ? ++i : ++j;
  }
}
/// Whether two boxes' runs share an element.
inline bool share(const std::vector<Run>& a, const std::vector<Run>& b) {
  bool shared = false;
  for_shared(a, b, [&](const Run&, const Run&, int64_t, int64_t) { shared = true; });
  return shared;
}
/// Copies into `to` (box `tb`'s elements in order, `element` bytes each) those of `from` (`fb`'s) that both boxes
/// hold; returns how many.
inline int64_t copy_shared(const std::vector<Run>& tb, char* to, const std::vector<Run>& fb, const char* from,
                           std::size_t element) {
  int64_t copied = 0;
  for_shared(tb, fb, [&](const Run& t, const Run& f, int64_t lo, int64_t hi) {
    std::memcpy(to + (t.local + lo - t.start) * element, from + (f.local + lo - f.start) * element,
                static_cast<std::size_t>(hi - lo) * element);
    copied += hi - lo;
  });
  return copied;
}

}  // namespace detail

/// The module's buffers by dotted name, on the CPU: the `state_dict` of a sharded checkpoint's `meta.ckpt`.
inline c10::Dict<std::string, at::Tensor> buffer_state(const torch::nn::Module& module) {
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.insert(b.key(), b.value().detach().cpu());
  }
  return out;
}

/// Whether `path` is a sharded checkpoint's folder.
inline bool is_sharded(const std::filesystem::path& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) && std::filesystem::exists(path / kIndexName, ec);
}
/// Whether a folder entry is a checkpoint of either form (a file, or a sharded checkpoint's folder).
inline bool is_checkpoint_entry(const std::filesystem::directory_entry& e) {
  std::error_code ec;
  return e.is_regular_file(ec) || is_sharded(e.path());
}

/// An optimizer of a sharded save: `optimizer` null where its state is not elementwise (its whole archive then goes
/// into `meta.ckpt`); `groups`: its groups' parameters, as indices of the module's, in the layout of an unsharded run.
struct ShardedOptimizer {
  torch::optim::Optimizer* optimizer = nullptr;
  std::vector<std::vector<std::size_t>> groups;
};

/// What each rank hands a sharded save.
struct ShardedSave {
  std::vector<std::string> names;              ///< the module's parameters' dotted names (Slice::param's order)
  std::vector<std::vector<int64_t>> shapes;    ///< and their shapes
  std::vector<Slice> slices;                   ///< this rank's
  std::vector<ShardedOptimizer> optimizers;    ///< in configure_optimizers' order
  Dict meta = make_dict();                     ///< rank zero: everything else (the full form's other entries)
  int rank = 0;
  int world = 1;
  /// Every rank's bytes in rank order, on every rank (the strategy's `host_all_gather`).
  std::function<std::vector<std::string>(const std::string&)> all_gather;
};

/// `optimizer`'s archive with its groups' options and no per-parameter state, its groups holding `groups` (the layout
/// of an unsharded run).
inline at::Tensor optimizer_skeleton(const torch::optim::Optimizer& optimizer,
                                     const std::vector<std::vector<at::Tensor>>& groups) {
  std::vector<torch::optim::OptimizerParamGroup> pg;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    pg.emplace_back(groups[g], optimizer.param_groups().at(g).options().clone());
  }
  return optimizer_state(*make_optimizer(::volt::detail::optimizer_family_name(optimizer), std::move(pg), "a save"));
}

namespace detail {

/// The safetensors name of `t`'s dtype.
inline std::string dtype_name(const at::Tensor& t) {
  const safetensors::detail::Dtype* d = safetensors::detail::find(t.scalar_type());
  if (d == nullptr) throw CheckpointError(std::string("volt: a sharded checkpoint cannot hold a tensor of ") +
                                          c10::toString(t.scalar_type()) + ".");
  return d->name;
}

inline std::string rank_file_name(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

/// This rank's pieces and its optimizers' steps, as `write_rank_file` adds them.
struct RankPieces {
  TensorFile file{.tensors = {}, .metadata = {{"format", "pt"}}};
  nlohmann::json pieces = nlohmann::json::array();
  nlohmann::json steps = nlohmann::json::array();

  /// Adds `value` (box `box` of parameter `param`, or of its state) under `key`, with its bytes' CRC-32.
  void add(const std::string& key, std::size_t param, const Box& box, const at::Tensor& value) {
    const at::Tensor t = value.detach().to(at::kCPU).contiguous().view(box.sizes);
    const uint32_t crc = ::volt::checkpoint::detail::crc(0, static_cast<const char*>(t.data_ptr()),
                                                         t.numel() * t.element_size());
    file.tensors.emplace_back(key, t);
    pieces.push_back({{"key", key}, {"param", param}, {"view", box.view}, {"offsets", box.offsets},
                      {"sizes", box.sizes}, {"dtype", dtype_name(t)}, {"crc32", crc}});
  }
};

/// Adds optimizer `i`'s state of each slice to `out` (fields by name, in the slice's box; the step by parameter).
template <class Codec>
void add_optimizer_pieces(const ShardedSave& s, std::size_t i, RankPieces& out) {
  using State = typename Codec::State;
  nlohmann::json steps = nlohmann::json::object();
  for (const Slice& sl : s.slices) {
    const auto* state = ::volt::detail::find_state(*s.optimizers[i].optimizer, sl.holder);
    if (state == nullptr) continue;
    const auto& typed = static_cast<const State&>(*state);
    const std::string& name = s.names[sl.param];
    steps[name] = Codec::step(typed);
    const auto t = Codec::tensors(typed);
    for (std::size_t f = 0; f < t.size(); ++f) {
      if (!t[f].defined()) continue;
      out.add("optimizer_states." + std::to_string(i) + "." + name + "." + Codec::names[f], sl.param, sl.box,
              t[f].detach().reshape(-1).narrow(0, sl.holder_offset, sl.box.numel()));
    }
  }
  out.steps.push_back(std::move(steps));
}

/// Writes this rank's file into `folder` (atomically, flushed); returns what the index needs of it.
inline nlohmann::json write_rank_file(const std::string& folder, const ShardedSave& s) {
  RankPieces out;
  for (const Slice& sl : s.slices) out.add(std::string(keys::state_dict) + "." + s.names[sl.param], sl.param, sl.box, sl.value);
  for (std::size_t i = 0; i < s.optimizers.size(); ++i) {
    if (s.optimizers[i].optimizer == nullptr) {
      out.steps.push_back(nullptr);
      continue;
    }
    ::volt::detail::with_state_codec(*s.optimizers[i].optimizer,
                                     [&](auto codec) { add_optimizer_pieces<decltype(codec)>(s, i, out); });
  }
  const std::string path = (std::filesystem::path(folder) / rank_file_name(s.rank, s.world)).string();
  const auto [text, data] = safetensors::encode(out.file, path);
  const uint64_t n = text.size();
  std::vector<std::pair<const char*, std::size_t>> bytes{{reinterpret_cast<const char*>(&n), 8}, {text.data(), n}};
  std::size_t total = 8 + n;
  for (const auto& t : data) {
    bytes.emplace_back(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
    total += bytes.back().second;
  }
  write_atomic(path, bytes);
  return {{"bytes", total}, {"header_crc32", ::volt::checkpoint::detail::crc(0, text)},
          {"pieces", std::move(out.pieces)}, {"steps", std::move(out.steps)}};
}

/// Rank zero: the index, from every rank's description (`write_rank_file`'s, in rank order).
inline nlohmann::json make_index(const ShardedSave& s, const std::vector<std::string>& described) {
  nlohmann::json files = nlohmann::json::array(), tensors = nlohmann::json::object();
  std::vector<nlohmann::json> steps(s.optimizers.size(), nlohmann::json::object());
  for (std::size_t j = 0; j < s.names.size(); ++j) {  // every parameter, also one of no elements (no pieces)
    tensors[std::string(keys::state_dict) + "." + s.names[j]] = {{"shape", s.shapes[j]}, {"dtype", nullptr},
                                                                 {"pieces", nlohmann::json::array()}};
  }
  for (std::size_t r = 0; r < described.size(); ++r) {
    const nlohmann::json d = nlohmann::json::parse(described[r]);
    files.push_back({{"file", rank_file_name(static_cast<int>(r), s.world)}, {"bytes", d.at("bytes")},
                     {"header_crc32", d.at("header_crc32")}});
    for (const auto& p : d.at("pieces")) {
      nlohmann::json& t = tensors[p.at("key").get<std::string>()];
      t["shape"] = s.shapes.at(p.at("param").get<std::size_t>());
      t["dtype"] = p.at("dtype");
      nlohmann::json piece = {{"file", r}, {"offsets", p.at("offsets")}, {"sizes", p.at("sizes")}, {"crc32", p.at("crc32")}};
      if (p.at("view") != t["shape"]) piece["view"] = p.at("view");
      t["pieces"].push_back(std::move(piece));
    }
    for (std::size_t i = 0; i < steps.size(); ++i) {
      if (!d.at("steps").at(i).is_null()) steps[i].update(d.at("steps").at(i));
    }
  }
  nlohmann::json optimizers = nlohmann::json::array();
  for (std::size_t i = 0; i < s.optimizers.size(); ++i) {
    if (s.optimizers[i].optimizer == nullptr) {
      optimizers.push_back(nullptr);
      continue;
    }
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& g : s.optimizers[i].groups) {
      nlohmann::json names = nlohmann::json::array();
      for (std::size_t j : g) names.push_back(s.names.at(j));
      groups.push_back(std::move(names));
    }
    optimizers.push_back({{"family", ::volt::detail::optimizer_family_name(*s.optimizers[i].optimizer)},
                          {"groups", std::move(groups)}, {"steps", std::move(steps[i])}});
  }
  nlohmann::json index = {{"format", kShardedFormat}, {"format_version", kShardedFormatVersion},
                          {"world_size", s.world},    {"files", std::move(files)},  {"parameters", s.names},
                          {"tensors", std::move(tensors)}, {"optimizers", std::move(optimizers)}};
  index["checksum"] = ::volt::checkpoint::detail::crc(0, index.dump());
  return index;
}

}  // namespace detail

/// Collective (`s.all_gather`): writes a sharded checkpoint to each of `paths`, every rank its own file at once, rank
/// zero the index and `meta.ckpt` (stamped as `save` stamps a file) once all are in place, then each folder swapped in.
/// Further paths get the same files as hard links (copies where the file system has none).
inline void save_sharded(const std::vector<std::string>& paths, const ShardedSave& s) {
  namespace fs = std::filesystem;
  const std::string pid = s.all_gather(std::to_string(::getpid())).front();  // rank zero's names the temporaries
  auto temporary = [&](const std::string& p) { return p + ".tmp." + pid; };
  std::error_code ec;
  if (s.rank == 0) {
    for (const auto& p : paths) fs::remove_all(temporary(p), ec);  // a save of this process that failed
    fs::create_directories(temporary(paths.front()), ec);
    if (ec) throw CheckpointError("volt: cannot create " + temporary(paths.front()) + ": " + ec.message());
    ::volt::checkpoint::detail::after_file_op(paths.front());
  }
  s.all_gather(std::string());  // the folder is there, empty
  const std::vector<std::string> described = s.all_gather(detail::write_rank_file(temporary(paths.front()), s).dump());
  if (s.rank == 0) {
    const fs::path first = temporary(paths.front());
    save((first / kMetaName).string(), s.meta);
    const std::string index = detail::make_index(s, described).dump(1);
    write_atomic((first / kIndexName).string(), index.data(), index.size());
    for (std::size_t k = 1; k < paths.size(); ++k) {
      const fs::path other = temporary(paths[k]);
      fs::create_directories(other, ec);
      for (const auto& e : fs::directory_iterator(first)) {
        fs::create_hard_link(e.path(), other / e.path().filename(), ec);
        if (ec) fs::copy_file(e.path(), other / e.path().filename(), fs::copy_options::overwrite_existing);
        ::volt::checkpoint::detail::after_file_op(paths[k]);
      }
      ::volt::checkpoint::detail::fsync_dir(other);
    }
    for (const auto& p : paths) replace_atomically(temporary(p), p);
  }
  s.all_gather(std::string());  // every folder in place
}

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
