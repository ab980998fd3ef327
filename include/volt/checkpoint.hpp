#pragma once
/// \file
/// Checkpoint files: one file per checkpoint, in the zip format of PyTorch's `torch.save` (written with
/// `torch::pickle_save`), so Python reads it with `torch.load(path)` (the full form; the sharded form, a folder of each
/// rank's pieces that `read` gives as these same contents, is volt/checkpoint/sharded.hpp):
///
/// | key | contents |
/// |---|---|
/// | `format`, `format_version` | `"volt.checkpoint"`, 1 |
/// | `epoch`, `global_step` | the epoch and the optimizer steps at the save, at the top level as Lightning's (also in weights-only checkpoints) |
/// | `volt_version`, `torch_version` | the versions that wrote it |
/// | `state_dict` | the module's parameters and buffers by dotted name, as `nn.Module.state_dict()`; CPU tensors |
/// | `optimizer_states` | per optimizer (in configure_optimizers' order): Adam's, AdamW's and SGD's as PyTorch's `optimizer.state_dict()` (`state` by parameter index, `param_groups`; volt/checkpoint/pytorch_optimizer.hpp), any other's LibTorch archive as a uint8 tensor |
/// | `lr_schedulers` | per scheduler, `{"step_count": n, "optimizer": index of its optimizer}` |
/// | `precision` | the precision's state (Fp16Mixed: the loss scaler's `scale`, `_growth_tracker`, ...) |
/// | `loops` | `epoch`, `global_step`, `batch_in_epoch`, `total_batch_idx`, `epoch_finished`, `val_pending`, `should_stop`, `world_size`, `optimizer_steps` (each optimizer's steps), `batches_that_stepped`, `time_elapsed`, `batch_stepped` |
/// | `loaders` | `{"train": position}` (data/concept.hpp's LoaderState) when the training loader keeps one |
/// | `metrics` | every rank's running metric sums of the training epoch (a list per rank, in rank order), so epoch values stay whole across a resume on any number of ranks |
/// | `rng` | `cpu` (and `cuda`): every rank's generator state, in rank order |
/// | `callbacks` | each stateful callback's state, by its `state_key` |
/// | `hyper_parameters` | what `Trainer::save_hyperparameters` was given, with the module's own (also in weights-only checkpoints; absent when none) |
/// | `checksum` | CRC-32 (zlib) of everything above: a flipped byte is an error, not a silently wrong weight |
///
/// Writes are atomic: the bytes go to `<path>.tmp.<pid>` in the same folder, are flushed to the disk
/// (fsync), and the file is renamed over `path`; a process killed while writing leaves the previous file
/// whole. Reads check everything before anything is loaded: a missing, empty, truncated, corrupt or foreign
/// file is a `CheckpointError` that names the file and what is wrong.
///
/// This file is the format and its generic pieces (checked read, weights, optimizer archives, generators); the
/// byte-level pieces under them (the checksum, bounded zip reads, pickle length checks) are volt/checkpoint/bytes.hpp,
/// the atomic writes volt/checkpoint/files.hpp, the safetensors format volt/checkpoint/safetensors.hpp, the sharded
/// form volt/checkpoint/sharded.hpp, and saving
/// (stamping, serialising, the asynchronous writer, the safetensors file beside a checkpoint)
/// volt/checkpoint/writer.hpp. What a fit writes into it and reads back to
/// resume, each entry's writer next to its reader, is volt/connectors/checkpoint_connector.hpp.

#include "volt/checkpoint/bytes.hpp"
#include "volt/checkpoint/files.hpp"
#include "volt/detail/optimizer_family.hpp"
#include "volt/version.hpp"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/csrc/api/include/torch/version.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/serialize.h>  // torch::pickle_save / pickle_load
#include <torch/types.h>
#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <typeinfo>
#include <vector>

namespace volt {
namespace checkpoint {

inline constexpr const char* kFormat = "volt.checkpoint";
inline constexpr int64_t kFormatVersion = 1;

/// The entries of a full checkpoint (the table above says what each holds).
namespace keys {
inline constexpr const char* state_dict = "state_dict";
inline constexpr const char* optimizer_states = "optimizer_states";
inline constexpr const char* lr_schedulers = "lr_schedulers";
inline constexpr const char* precision = "precision";
inline constexpr const char* loops = "loops";
inline constexpr const char* loaders = "loaders";
inline constexpr const char* metrics = "metrics";
inline constexpr const char* rng = "rng";
inline constexpr const char* callbacks = "callbacks";
inline constexpr const char* accumulated_grads = "accumulated_grads";
inline constexpr const char* hyper_parameters = "hyper_parameters";
inline constexpr const char* epoch = "epoch";
inline constexpr const char* global_step = "global_step";
}  // namespace keys

using Dict = c10::impl::GenericDict;

inline Dict make_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }

inline Dict decode(const std::vector<char>& bytes, const std::string& path);
inline Dict read_sharded(const std::string& dir);  // volt/checkpoint/sharded.hpp
inline void optimizers_from_pytorch(Dict& contents, const std::string& path);  // volt/checkpoint/pytorch_optimizer.hpp

/// Reads and checks a checkpoint: a `CheckpointError` names the file and the fault (missing, empty, not a
/// torch zip archive or cut short, not a volt checkpoint, a newer format, a checksum mismatch). A sharded checkpoint's
/// folder is read as the full form's contents (volt/checkpoint/sharded.hpp).
inline Dict read(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    if (std::filesystem::exists(std::filesystem::path(path) / "index.json", ec)) return read_sharded(path);
    throw CheckpointError("volt: " + path + " is a folder and not a sharded checkpoint (no index.json); give the "
                          "checkpoint file inside it.");
  }
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw CheckpointError("volt: no checkpoint at " + path + " (cannot open it: " + std::strerror(errno) + ").");
  std::vector<char> bytes(static_cast<std::size_t>(std::max<std::streamoff>(in.tellg(), 0)));
  in.seekg(0);
  if (!in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))) {
    throw CheckpointError("volt: reading the checkpoint " + path + " failed: " + std::strerror(errno));
  }
  return decode(bytes, path);
}

/// Checks a checkpoint's bytes as `read` does once it has them (`path` names them in messages).
inline Dict decode(const std::vector<char>& bytes, const std::string& path) {
  if (bytes.empty()) throw CheckpointError("volt: the checkpoint " + path + " is empty (0 bytes).");
  c10::IValue value;
  try {
    value = detail::unpickle(bytes);
  } catch (const std::exception& e) {
    throw CheckpointError("volt: " + path + " (" + std::to_string(bytes.size()) +
                          " bytes) is not a readable checkpoint: it is cut short or is not a torch.save archive (" +
                          detail::first_line(e.what()) + ").");
  }
  if (!value.isGenericDict()) {
    throw CheckpointError("volt: " + path + " is a torch.save file holding a " + value.tagKind() +
                          ", not a volt checkpoint.");
  }
  Dict d = value.toGenericDict();
  if (!d.contains("format") || !d.at("format").isString() || d.at("format").toStringRef() != kFormat) {
    std::ostringstream keys;
    int shown = 0;
    for (const auto& e : d) {
      if (shown++ == 8) {
        keys << " ...";
        break;
      }
      keys << " " << (e.key().isString() ? e.key().toStringRef() : e.key().tagKind());
    }
    throw CheckpointError("volt: " + path + " is a torch.save file but not a volt checkpoint (no \"format\": \"" +
                          kFormat + "\"; its keys:" + keys.str() + ").");
  }
  const int64_t version = d.contains("format_version") && d.at("format_version").isInt() ? d.at("format_version").toInt() : -1;
  if (version < 1 || version > kFormatVersion) {
    throw CheckpointError("volt: " + path + " has checkpoint format version " + std::to_string(version) +
                          "; this volt (" + version_string + ") reads versions 1 to " + std::to_string(kFormatVersion) + ".");
  }
  if (!d.contains("checksum") || !d.at("checksum").isInt()) {
    throw CheckpointError("volt: " + path + " has no checksum; it was not written by volt's checkpoint::save.");
  }
  const auto stored = static_cast<uint32_t>(d.at("checksum").toInt());
  Dict rest = d.copy();
  (void)rest.erase("checksum");
  const uint32_t computed = detail::checksum(rest, 0);
  if (stored != computed) {
    std::ostringstream s;
    s << "volt: " << path << " is corrupt: its contents do not match its checksum (stored " << stored
      << ", computed " << computed << ").";
    throw CheckpointError(s.str());
  }
  optimizers_from_pytorch(d, path);  // PyTorch's optimizer state_dicts back as LibTorch archives (pytorch_optimizer.hpp)
  return d;
}

/// A checkpoint read and checked as a file (`read`, `decode`), or one dictionary inside it, with the file it came
/// from. Every reader of a resume (the module's weights, the loops, the optimizers, the loader, the metrics, the
/// generators, the callbacks) asks its view for entries, and the view's errors name the file: nothing passes the
/// path along.
class View {
 public:
  View(Dict d, std::string path) : d_(std::move(d)), path_(std::move(path)) {}
  /// The checkpoint at `path`, read and checked.
  static View read(const std::string& path) { return View(checkpoint::read(path), path); }

  const std::string& path() const { return path_; }
  const Dict& dict() const { return d_; }
  bool has(const std::string& key) const { return d_.contains(key); }
  /// A required entry (missing: an error naming the file).
  c10::IValue at(const std::string& key) const {
    if (!has(key)) fail(" has no \"" + key + "\" entry.");
    return d_.at(key);
  }
  int64_t integer(const std::string& key) const { return at(key).toInt(); }
  bool flag(const std::string& key) const { return at(key).toBool(); }
  /// A required dictionary entry, or a dictionary taken from a list in it, as a view of the same file.
  View sub(const std::string& key) const { return of(at(key)); }
  View of(const c10::IValue& dict) const { return View(dict.toGenericDict(), path_); }
  /// This dictionary as numbers by name (a precision's or a callback's state).
  std::map<std::string, double> numbers() const {
    std::map<std::string, double> out;
    for (const auto& e : d_) {
      if (!e.value().isDouble() && !e.value().isInt()) fail(": \"" + e.key().toStringRef() + "\" should be a number.");
      out.emplace(e.key().toStringRef(),
                  e.value().isDouble() ? e.value().toDouble() : static_cast<double>(e.value().toInt()));
    }
    return out;
  }
  /// Throws a CheckpointError: "volt: <path>" followed by `what`.
  [[noreturn]] void fail(const std::string& what) const { throw CheckpointError("volt: " + path_ + what); }

 private:
  Dict d_;
  std::string path_;
};

// ---- pieces --------------------------------------------------------------------------------------------

/// The state a checkpoint file holds for the callback with key `key`, if any (ModelCheckpoint finds its
/// best checkpoint in its newest file this way).
inline std::optional<Dict> saved_callback_state(const std::string& path, const std::string& key) {
  std::error_code ec;  // a sharded checkpoint's callbacks are in its meta.ckpt: its pieces are not read
  const Dict d = read(std::filesystem::is_directory(path, ec) ? path + "/meta.ckpt" : path);
  if (!d.contains(keys::callbacks)) return std::nullopt;
  const auto states = d.at(keys::callbacks).toGenericDict();
  if (!states.contains(key)) return std::nullopt;
  return states.at(key).toGenericDict();
}

/// The module's parameters and buffers by dotted name (CPU tensors), as PyTorch's `state_dict()`.
/// `on_device`: the tensors where they are (an asynchronous save copies them into host memory itself).
inline c10::Dict<std::string, at::Tensor> module_state(const torch::nn::Module& module, bool on_device = false) {
  c10::Dict<std::string, at::Tensor> out;
  auto take = [&](const at::Tensor& t) { return on_device ? t.detach() : t.detach().cpu(); };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out.insert(p.key(), take(p.value()));
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.insert(b.key(), take(b.value()));
  }
  return out;
}

/// Named tensors as a weights file holds them, in the file's order.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Where each of a file's tensors goes in a module (its parameters and buffers, by dotted name), and what is left.
struct WeightsMatch {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  ///< the module's tensor, the file's
  std::vector<std::string> loaded, missing, unexpected;   ///< module names given a value; module names without
                                                          ///< one; file names the module does not have
};

namespace detail {
/// `n <what>: a, b, c, ...`: the count and the first three names, for one line however many differ.
inline std::string first_names(const std::vector<std::string>& names, const std::string& what) {
  std::string out = std::to_string(names.size()) + " " + what + " (";
  for (std::size_t i = 0; i < names.size() && i < 3; ++i) out += (i > 0 ? ", " : "") + names[i];
  return out + (names.size() > 3 ? ", ...)" : ")");
}

/// The rename rule that turns the most of the file's unmatched names into missing module names (the file's part
/// before a common tail for the module's part before it, cut at a '.'), as a hint; empty when none turns one.
inline std::string rename_hint(const std::vector<std::string>& file, const std::vector<std::string>& module) {
  const std::set<std::string> wanted(module.begin(), module.end());
  std::string best_from, best_to;
  std::size_t best = 0;
  for (std::size_t i = 0; i < file.size() && i < 64; ++i) {
    for (std::size_t j = 0; j < module.size() && j < 64; ++j) {
      const std::string& a = file[i];
      const std::string& b = module[j];
      std::size_t tail = 0;  // the common ending, from just after a '.'
      while (tail < a.size() && tail < b.size() && a[a.size() - 1 - tail] == b[b.size() - 1 - tail]) ++tail;
      std::size_t cut = a.size() - tail;
      while (cut > 0 && cut < a.size() && a[cut - 1] != '.') ++cut;
      if (cut >= a.size()) continue;
      const std::string from = a.substr(0, cut), to = b.substr(0, b.size() - (a.size() - cut));
      std::size_t turned = 0;
      for (const std::string& f : file) turned += f.rfind(from, 0) == 0 && wanted.count(to + f.substr(from.size()));
      if (turned > best) std::tie(best, best_from, best_to) = std::tie(turned, from, to);
    }
  }
  if (best == 0) return "";
  return "Renaming \"" + best_from + "\" to \"" + best_to + "\" would match " + std::to_string(best) + " of them: " +
         "LoadWeightsOptions{.rename = {{\"" + best_from + "\", \"" + best_to + "\"}}}.";
}
}  // namespace detail

/// Matches `named` to the module's parameters and buffers by name. Throws, naming every difference and what the
/// weights are (`origin`), when shapes differ, and when `strict` and a name is missing or unexpected, or when not
/// one of the file's tensors has a place in the module (a non-strict load that would load nothing). The message gives
/// the counts, the first few names and, where one fits, the rename rule that would match them.
inline WeightsMatch match_weights(const torch::nn::Module& module, const NamedTensors& named, bool strict,
                                  const std::string& origin) {
  std::map<std::string, at::Tensor> mine;
  for (const auto& p : module.named_parameters(true)) mine.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers(true)) {
    if (b.value().defined()) mine.emplace(b.key(), b.value());
  }
  WeightsMatch m;
  std::vector<std::string> shapes;  // "name (file [a, b], module [c, d])"
  std::set<std::string> seen;
  for (const auto& [k, t] : named) {
    seen.insert(k);
    auto it = mine.find(k);
    if (it == mine.end()) {
      m.unexpected.push_back(k);
    } else if (t.sizes() != it->second.sizes()) {
      std::ostringstream shape;
      shape << k << " (file " << t.sizes() << ", module " << it->second.sizes() << ")";
      shapes.push_back(shape.str());
    } else {
      m.copies.emplace_back(it->second, t);
      m.loaded.push_back(k);
    }
  }
  for (const auto& [k, v] : mine) {
    if (!seen.count(k)) m.missing.push_back(k);
  }
  const bool none_fit = m.loaded.empty() && !named.empty() && !mine.empty();  // not strict either: surely a mistake
  if (!shapes.empty() || ((strict || none_fit) && (!m.missing.empty() || !m.unexpected.empty()))) {
    std::string msg = "volt: the weights in " + origin + " do not fit this module:";
    if (!m.missing.empty()) msg += " " + detail::first_names(m.missing, "of the module's names missing") + ";";
    if (!m.unexpected.empty()) msg += " " + detail::first_names(m.unexpected, "of the file's not in the module") + ";";
    if (!shapes.empty()) msg += " " + detail::first_names(shapes, "tensors of other shapes") + ";";
    msg += " nothing was loaded.";
    if (const std::string hint = detail::rename_hint(m.unexpected, m.missing); !hint.empty()) msg += " " + hint;
    if (none_fit && !strict) msg += " (Not one tensor matched, so the non-strict load refused too.)";
    throw CheckpointError(msg);
  }
  return m;
}

/// The tensors of a checkpoint's `state_dict` entry (a value that is not a tensor is refused).
inline NamedTensors named_tensors(const View& view) {
  NamedTensors out;
  for (const auto& e : view.dict()) {
    if (!e.value().isTensor()) {
      throw CheckpointError("volt: the weights in " + view.path() + " do not fit this module: " +
                            e.key().toStringRef() + " is a " + e.value().tagKind() + ", not a tensor; nothing was "
                            "loaded.");
    }
    out.emplace_back(e.key().toStringRef(), e.value().toTensor());
  }
  return out;
}

/// Throws unless the weights `view` holds have exactly the module's names with the same shapes (names every
/// difference).
inline void check_module_state(const torch::nn::Module& module, const View& view) {
  match_weights(module, named_tensors(view), /*strict=*/true, view.path());
}

/// Copies `state` into the module (checked first with check_module_state).
inline void load_module_state(torch::nn::Module& module, const Dict& state) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters(true)) p.value().copy_(state.at(p.key()).toTensor());
  for (auto& b : module.named_buffers(true)) {
    if (b.value().defined()) b.value().copy_(state.at(b.key()).toTensor());
  }
}

/// The LibTorch optimizer class whose state `optimizer` keeps (detail/optimizer_family.hpp).
inline std::string optimizer_kind(const torch::optim::Optimizer& optimizer) {
  return ::volt::detail::optimizer_family_name(optimizer);
}

/// An optimizer's LibTorch archive (its state and its parameter groups' options) as bytes in a uint8 tensor.
/// LibTorch's optimizer archives do not bring the groups' options (learning rates, ...) back on load, so
/// they travel alongside, under "volt_param_group_options"; the optimizer's kind under "volt_optimizer".
inline at::Tensor optimizer_state(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  archive.write("volt_optimizer", c10::IValue(optimizer_kind(optimizer)));
  torch::serialize::OutputArchive groups;
  for (std::size_t i = 0; i < optimizer.param_groups().size(); ++i) {
    torch::serialize::OutputArchive g;
    optimizer.param_groups()[i].options().serialize(g);
    groups.write(std::to_string(i), g);
  }
  archive.write("volt_param_group_options", groups);
  std::ostringstream s;
  archive.save_to(s);
  const std::string bytes = s.str();
  return torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())}, torch::kUInt8).clone();
}

/// Loads an optimizer archive; on any failure the optimizer keeps its previous state.
inline void load_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& bytes, const std::string& path) {
  const at::Tensor backup = optimizer_state(optimizer);
  auto load = [&](const at::Tensor& b) {
    const at::Tensor c = b.contiguous();
    torch::serialize::InputArchive archive;
    c10::optional<torch::Device> device;  // the state goes where the parameters are
    if (!optimizer.param_groups().empty() && !optimizer.param_groups()[0].params().empty()) {
      device = optimizer.param_groups()[0].params()[0].device();
    }
    archive.load_from(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel()), device);
    c10::IValue kind;  // absent from files written before it was recorded
    if (archive.try_read("volt_optimizer", kind) && kind.isString() && kind.toStringRef() != optimizer_kind(optimizer)) {
      const std::string saved = kind.toStringRef();
      throw CheckpointError("volt: " + path + " holds the state of a " + saved + ", and a checkpoint of " + saved +
                            " cannot resume " + optimizer_kind(optimizer) + ": return a " + saved +
                            " from configure_optimizers to resume it, or start a new fit from its weights alone "
                            "(volt::load_weights). Nothing was loaded.");
    }
    optimizer.load(archive);
    torch::serialize::InputArchive groups;
    if (archive.try_read("volt_param_group_options", groups)) {
      for (std::size_t i = 0; i < optimizer.param_groups().size(); ++i) {
        torch::serialize::InputArchive g;
        groups.read(std::to_string(i), g);
        optimizer.param_groups()[i].options().serialize(g);
      }
    }
  };
  try {
    load(bytes);
  } catch (const CheckpointError&) {
    throw;  // another optimizer's kind: refused before anything was loaded
  } catch (const std::exception& e) {
    load(backup);
    throw CheckpointError("volt: the optimizer state in " + path + " does not fit this optimizer (" +
                          detail::first_line(e.what()) + "); nothing was loaded.");
  }
}

inline Dict from_map(const std::map<std::string, double>& m) {
  Dict d = make_dict();
  for (const auto& [k, v] : m) d.insert(k, v);
  return d;
}

/// The default generators of this process: CPU, then every CUDA device (when there are any).
inline std::vector<at::Generator> default_generators() {
  std::vector<at::Generator> out{at::globalContext().defaultGenerator(c10::DeviceType::CPU)};
  if (at::globalContext().hasCUDA()) {
    const int n = static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
    for (int i = 0; i < n; ++i) {
      out.push_back(at::globalContext().defaultGenerator(
          c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(i))));
    }
  }
  return out;
}

/// Their states, in that order.
inline std::vector<at::Tensor> rng_states() {
  std::vector<at::Tensor> out;
  for (auto& g : default_generators()) {
    std::lock_guard<std::mutex> lock(g.mutex());
    out.push_back(g.get_state());
  }
  return out;
}
/// Sets them from states in that order (as many as both sides have).
inline void set_rng_states(const std::vector<at::Tensor>& states) {
  auto generators = default_generators();
  for (std::size_t i = 0; i < std::min(states.size(), generators.size()); ++i) {
    std::lock_guard<std::mutex> lock(generators[i].mutex());
    generators[i].set_state(states[i]);
  }
}

}  // namespace checkpoint
}  // namespace volt

#include "volt/checkpoint/pytorch_optimizer.hpp"  // the optimizers' state as PyTorch's in the file
#include "volt/checkpoint/writer.hpp"             // saving: checkpoint::save, AsyncWriter, SaveOptions
