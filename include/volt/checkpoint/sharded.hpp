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
/// as it was, or whole. `ShardedReader` (volt/checkpoint/sharded_reader.hpp) reads such a folder a box at a time
/// (volt/checkpoint/box.hpp: any box of any tensor, whatever boxes the writer's ranks held, as PyTorch's distributed
/// checkpoints read their chunks): the index checked (its checksum, and that the pieces tile each tensor exactly), and
/// only the pieces the boxes asked for overlap read, each checked against its CRC-32. `checkpoint::read` of a folder
/// asks for every tensor whole and assembles the full form's contents (the weights whole, each optimizer's archive in
/// the layout of an unsharded run), so that everything that
/// reads a checkpoint reads either form. Format 1 (flat ranges, `offset` and `numel`; a CRC-32 per file) is read too.

#include "volt/checkpoint.hpp"
#include "volt/checkpoint/safetensors.hpp"
#include "volt/checkpoint/writer.hpp"
#include "volt/checkpoint/box.hpp"
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

}  // namespace checkpoint
}  // namespace volt

#include "volt/checkpoint/sharded_reader.hpp"  // ShardedReader, read_sharded
