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
/// | `index.json` | `format` (`"volt.sharded_checkpoint"`), `format_version` (1), `world_size`; `parameters`: the module's parameter names in its order; `files`: each rank's file, its `bytes` and `crc32`; `tensors`: by global name, its `shape`, `dtype` (safetensors' names) and `pieces`, each a `file` (index into `files`), `offset` and `numel` (the flat elements it holds); `optimizers`: per optimizer, `null` where its whole archive is in `meta.ckpt`, else its `family`, its groups' parameter names and each parameter's `step`; `checksum`: CRC-32 of the rest as JSON |
/// | `meta.ckpt` | a checkpoint file (volt/checkpoint.hpp's table) with everything else: `state_dict` holds the buffers, `optimizer_states` each optimizer's archive without per-parameter state (its groups and their options) |
/// | `rank-R-of-W.safetensors` | rank R's pieces, flat: `state_dict.<parameter>` and `optimizer_states.<i>.<parameter>.<field>` (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `momentum_buffer`) |
///
/// Atomic as a file is: every file goes into `<path>.tmp.<pid of rank zero>` and is flushed; rank zero writes the
/// index and `meta.ckpt` once every rank's file is there, then swaps the folder in (`replace_atomically`: whatever
/// `path` held, file or folder, is replaced in one step and deleted after). A job killed at any moment leaves `path`
/// as it was, or whole. `checkpoint::read` of such a folder checks the index, every file's size and CRC-32 and that
/// the pieces tile each tensor exactly, then assembles the full form's contents (the weights whole, each optimizer's
/// archive in the layout of an unsharded run), so that everything that reads a checkpoint reads either form.

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
#include <filesystem>
#include <fstream>
#include <functional>
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
inline constexpr int64_t kShardedFormatVersion = 1;
inline constexpr const char* kIndexName = "index.json";
inline constexpr const char* kMetaName = "meta.ckpt";

/// The flat elements [offset, offset + numel) of module parameter `param` that one rank writes.
struct Slice {
  std::size_t param = 0;
  int64_t offset = 0;
  int64_t numel = 0;
  at::Tensor value;           ///< those elements, flat
  at::Tensor holder;          ///< the tensor an optimizer files their state under
  int64_t holder_offset = 0;  ///< where they start in the holder's state, flattened
};

/// Rank `rank`'s part of parameter `j` (`p`) where every rank holds it whole: the `world` near-equal flat ranges'
/// `rank`-th, when it has elements.
inline std::optional<Slice> replicated_slice(std::size_t j, const at::Tensor& p, int rank, int world) {
  const int64_t per = (p.numel() + world - 1) / world;
  const int64_t offset = std::min<int64_t>(per * rank, p.numel());
  const int64_t numel = std::min<int64_t>(per, p.numel() - offset);
  if (numel <= 0) return std::nullopt;
  return Slice{j, offset, numel, p.detach().reshape(-1).narrow(0, offset, numel), p, offset};
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
};

/// Adds optimizer `i`'s state of each slice to `out` (fields by name, flat; the step by parameter).
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
      const at::Tensor piece = t[f].detach().reshape(-1).narrow(0, sl.holder_offset, sl.numel);
      const std::string key = "optimizer_states." + std::to_string(i) + "." + name + "." + Codec::names[f];
      out.file.tensors.emplace_back(key, piece);
      out.pieces.push_back({key, sl.param, sl.offset, sl.numel, dtype_name(piece)});
    }
  }
  out.steps.push_back(std::move(steps));
}

/// Writes this rank's file into `folder` (atomically, flushed); returns what the index needs of it.
inline nlohmann::json write_rank_file(const std::string& folder, const ShardedSave& s) {
  RankPieces out;
  for (const Slice& sl : s.slices) {
    const std::string key = std::string(keys::state_dict) + "." + s.names[sl.param];
    out.file.tensors.emplace_back(key, sl.value);
    out.pieces.push_back({key, sl.param, sl.offset, sl.numel, dtype_name(sl.value)});
  }
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
  for (const auto& t : data) bytes.emplace_back(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  uint32_t crc = 0;
  std::size_t total = 0;
  for (const auto& [p, size] : bytes) {
    crc = ::volt::checkpoint::detail::crc(crc, p, size);
    total += size;
  }
  write_atomic(path, bytes);
  return {{"bytes", total}, {"crc32", crc}, {"pieces", std::move(out.pieces)}, {"steps", std::move(out.steps)}};
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
                     {"crc32", d.at("crc32")}});
    for (const auto& p : d.at("pieces")) {
      nlohmann::json& t = tensors[p.at(0).get<std::string>()];
      t["shape"] = s.shapes.at(p.at(1).get<std::size_t>());
      t["dtype"] = p.at(4);
      t["pieces"].push_back({{"file", r}, {"offset", p.at(2)}, {"numel", p.at(3)}});
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

[[noreturn]] inline void sharded_fail(const std::string& dir, const std::string& what) {
  throw CheckpointError("volt: the sharded checkpoint " + dir + " " + what);
}

/// The index of the sharded checkpoint in `dir`, checked: format, version and checksum.
inline nlohmann::json read_index(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kIndexName).string();
  std::ifstream in(path, std::ios::binary);
  if (!in) sharded_fail(dir, "has no readable " + std::string(kIndexName) + ".");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!index.is_object()) sharded_fail(dir, "has an index.json that is not a JSON object (" + std::to_string(text.size()) + " bytes).");
  if (index.value("format", std::string()) != kShardedFormat) {
    sharded_fail(dir, std::string("has an index.json whose \"format\" is not \"") + kShardedFormat + "\".");
  }
  const int64_t version = index.value("format_version", int64_t{-1});
  if (version < 1 || version > kShardedFormatVersion) {
    sharded_fail(dir, "has format version " + std::to_string(version) + "; this volt (" + version_string +
                          ") reads version 1 to " + std::to_string(kShardedFormatVersion) + ".");
  }
  const int64_t stored = index.value("checksum", int64_t{-1});
  index.erase("checksum");
  if (stored != static_cast<int64_t>(::volt::checkpoint::detail::crc(0, index.dump()))) {
    sharded_fail(dir, "has an index.json that does not match its checksum (it was changed after it was written).");
  }
  return index;
}

/// Every tensor of the index allocated whole, and which pieces each file holds; refuses pieces that do not tile
/// their tensor exactly.
struct Assembly {
  std::map<std::string, at::Tensor> whole;
  std::vector<std::vector<std::tuple<std::string, int64_t, int64_t>>> by_file;  // name, offset, numel
};
inline Assembly plan_assembly(const nlohmann::json& index, const std::string& dir) {
  Assembly a;
  a.by_file.resize(index.at("files").size());
  for (const auto& [name, t] : index.at("tensors").items()) {
    const auto shape = t.at("shape").get<std::vector<int64_t>>();
    const auto* dtype = t.at("dtype").is_null() ? nullptr : safetensors::detail::find(t.at("dtype").get<std::string>());
    if (dtype == nullptr && !t.at("pieces").empty()) sharded_fail(dir, "names an unknown dtype for " + name + ".");
    at::Tensor whole = torch::empty(shape, dtype == nullptr ? at::kFloat : dtype->type);
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const auto& p : t.at("pieces")) {
      const auto file = p.at("file").get<std::size_t>();
      const auto offset = p.at("offset").get<int64_t>(), numel = p.at("numel").get<int64_t>();
      if (file >= a.by_file.size()) sharded_fail(dir, "puts a piece of " + name + " in a file it does not list.");
      a.by_file[file].emplace_back(name, offset, numel);
      ranges.emplace_back(offset, numel);
    }
    std::sort(ranges.begin(), ranges.end());
    int64_t covered = 0;
    for (const auto& [offset, numel] : ranges) {
      if (offset != covered || numel <= 0) {
        sharded_fail(dir, "does not hold all of " + name + ": its pieces leave a gap or overlap at element " +
                              std::to_string(std::min(offset, covered)) + ".");
      }
      covered += numel;
    }
    if (covered != whole.numel()) {
      sharded_fail(dir, "holds " + std::to_string(covered) + " of the " + std::to_string(whole.numel()) +
                            " elements of " + name + ".");
    }
    a.whole.emplace(name, std::move(whole));
  }
  return a;
}

/// Reads rank file `r` (checked against the index's size and CRC-32) and copies its pieces into place.
inline void fill_from_file(const nlohmann::json& index, std::size_t r, Assembly& a, const std::string& dir) {
  const nlohmann::json& f = index.at("files").at(r);
  const std::string path = (std::filesystem::path(dir) / f.at("file").get<std::string>()).string();
  std::ifstream in(path, std::ios::binary);
  if (!in) sharded_fail(dir, "is missing " + f.at("file").get<std::string>() + " (rank " + std::to_string(r) + "'s pieces).");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() != f.at("bytes").get<std::size_t>() ||
      ::volt::checkpoint::detail::crc(0, bytes.data(), bytes.size()) != f.at("crc32").get<uint32_t>()) {
    sharded_fail(dir, "has a damaged " + f.at("file").get<std::string>() + " (" + std::to_string(bytes.size()) +
                          " bytes; the index says " + f.at("bytes").dump() + " and another CRC-32).");
  }
  const TensorFile file = safetensors::decode(bytes.data(), bytes.size(), path);
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : file.tensors) by_name.emplace(name, &t);
  for (const auto& [name, offset, numel] : a.by_file[r]) {
    const auto it = by_name.find(name);
    if (it == by_name.end() || it->second->numel() != numel || it->second->scalar_type() != a.whole[name].scalar_type()) {
      sharded_fail(dir, "has no piece of " + name + " of " + std::to_string(numel) + " elements in " +
                            f.at("file").get<std::string>() + ", where its index puts one.");
    }
    a.whole[name].view(-1).narrow(0, offset, numel).copy_(it->second->reshape(-1));
  }
}

/// Optimizer `i`'s archive in the layout of an unsharded run: its skeleton loaded into an optimizer of its family over
/// stand-ins for the parameters, each parameter's state put back whole, archived again.
inline at::Tensor assemble_optimizer(const nlohmann::json& o, std::size_t i, const at::Tensor& skeleton, Assembly& a,
                                     const std::string& dir) {
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
        const auto it = a.whole.find("optimizer_states." + std::to_string(i) + "." + name + "." + Codec::names[f]);
        if (it != a.whole.end()) fields[f] = it->second;
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
    const nlohmann::json index = detail::read_index(dir);
    Dict d = read((std::filesystem::path(dir) / kMetaName).string());
    detail::Assembly a = detail::plan_assembly(index, dir);
    for (std::size_t r = 0; r < a.by_file.size(); ++r) detail::fill_from_file(index, r, a, dir);
    Dict weights = make_dict();  // the parameters, then what meta.ckpt holds (the buffers)
    const std::string prefix = std::string(keys::state_dict) + ".";
    const Dict meta_weights = d.at(keys::state_dict).toGenericDict();
    for (const auto& name : index.at("parameters")) {  // in the module's order
      const std::string n = name.get<std::string>();
      const auto it = a.whole.find(prefix + n);
      if (it == a.whole.end()) detail::sharded_fail(dir, "lists the parameter " + n + " but holds no tensor for it.");
      if (!meta_weights.contains(n)) weights.insert(n, it->second);
    }
    for (const auto& e : meta_weights) weights.insert(e.key(), e.value());
    d.insert_or_assign(keys::state_dict, weights);
    if (d.contains(keys::optimizer_states)) {
      c10::impl::GenericList archives = d.at(keys::optimizer_states).toList();
      for (std::size_t i = 0; i < archives.size(); ++i) {
        const nlohmann::json& o = index.at("optimizers").at(i);
        if (!o.is_null()) archives.set(i, detail::assemble_optimizer(o, i, archives.get(i).toTensor(), a, dir));
      }
    }
    return d;
  } catch (const nlohmann::json::exception& e) {
    detail::sharded_fail(dir, std::string("has an index.json that is not what volt writes (") + e.what() + ").");
  }
}

}  // namespace checkpoint
}  // namespace volt
