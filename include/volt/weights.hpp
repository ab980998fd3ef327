#pragma once
/// \file
/// Weights that travel: a module's parameters and buffers written as safetensors, and weights loaded into a module,
/// or into part of one, from a safetensors file or a volt checkpoint, for fine-tuning or inference.
/// \code
///   volt::save_safetensors(*model, "model.safetensors");   // Python: model.load_state_dict(load_file(path))
///   auto r = volt::load_weights(*fresh, "model.safetensors", {.skip = {"head."}, .strict = false});
///   // r.loaded: the backbone's names; r.missing: the new head's; r.unexpected: none (skipped ones are not listed)
///   volt::load_weights(*model->backbone, "pretrained.safetensors", {.rename = {{"model.encoder.", ""}}});
///   volt::freeze(*model->backbone);                         // fine-tune the head only (volt::BackboneFinetuning)
///   volt::save_weights(*model, "exported", {.max_shard_bytes = 5'000'000'000});  // as save_pretrained lays them out
/// \endcode
///
/// | option of `load_weights` | meaning |
/// |---|---|
/// | `rename` | prefix rewrites `{from, to}` tried in order on each name in the file; the first `from` that begins the name is replaced by `to` (`{"", "backbone."}` puts every name under `backbone.`); a `*` stands for a run of characters without '.', and each `*` of `to` writes what the same `*` of `from` matched (`{"transformer.h.*.attn.c_attn.", "net.blocks.*.attn.qkv."}`); a name no rule matches is kept |
/// | `skip` | names (after renaming) that begin with one of these (a `*` as above: `transformer.h.*.attn.bias`) are left out, and not counted as unexpected |
/// | `strict` | `true` (the default, as PyTorch's `load_state_dict`): every parameter and buffer of the module gets a value and every tensor of the file a place, else an error naming the missing and the unexpected; `false`: what matches is loaded and the rest is returned |
/// | `keep` | the module's names that begin with one of these need not be in the file: they keep their values (a buffer the other side computes instead of storing, such as an attention mask) |
/// | `transforms` | `{name, apply, what}` (volt/weights/layout.hpp): each tensor whose name in the file matches `name` (`*` as above, the whole name) goes through `apply` before renaming, in the order given: `volt::transform::transpose()` (GPT-2's `Conv1D` weights), `permute`, `reshape`, `cast`, `chain` of them; one that matches nothing is an error |
///
/// Where the weights are: a safetensors file, a volt checkpoint, or a Hugging Face model folder (`model.safetensors`,
/// or shards and `model.safetensors.index.json`; the index file itself will do). Safetensors files are mapped, not
/// read: a tensor's pages are read as it is copied into the module, so loading needs no second copy of the weights in
/// memory. `save_weights` writes such a folder, renaming and transforming the module's names and tensors the same way
/// (the transforms match the module's names), in shards of at most `max_shard_bytes` when given.
///
/// Shapes must match in every case (an error names each difference); a dtype is converted to the module's
/// (`Tensor::copy_`), and the module's device is kept. Everything is checked before anything is copied: on any error
/// the module is unchanged. The file's format is told by its first bytes (a zip archive: a volt checkpoint, whose
/// `state_dict` is read; else safetensors, volt/checkpoint/safetensors.hpp).

#include "volt/checkpoint.hpp"
#include "volt/errors.hpp"
#include "volt/checkpoint/safetensors.hpp"
#include "volt/weights/layout.hpp"

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <type_traits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace volt {

/// How `load_weights` places a file's tensors in a module (table above).
struct LoadWeightsOptions {
  std::vector<std::pair<std::string, std::string>> rename{};
  std::vector<std::string> skip{};
  bool strict = true;
  std::vector<WeightTransform> transforms{};
  std::vector<std::string> keep{};
};

/// How `save_weights` writes a module's weights (the file's comment).
struct SaveWeightsOptions {
  /// Rules from the module's names to the file's, as LoadWeightsOptions::rename.
  std::vector<std::pair<std::string, std::string>> rename{};
  /// Applied to the tensors whose module names match, before renaming.
  std::vector<WeightTransform> transforms{};
  /// Module names (prefixes, `*` as in rename) left out: a head that shares the embedding's weights, a buffer the
  /// other side computes.
  std::vector<std::string> skip{};
  /// The files' `__metadata__`; `"format": "pt"` unless it says otherwise.
  std::map<std::string, std::string> metadata{};
  /// Shards of at most this many bytes (a larger tensor alone), as save_pretrained's max_shard_size; 0: one file.
  int64_t max_shard_bytes = 0;
};

/// What `load_weights` did: the module's names it gave values, the module's names the file had nothing for, the
/// file's names (after renaming, not skipped) the module has no place for.
struct LoadedWeights {
  std::vector<std::string> loaded, missing, unexpected;
};

/// A module's parameters and buffers by dotted name (as PyTorch's `state_dict()`), CPU tensors, with metadata.
inline TensorFile module_weights(const torch::nn::Module& module, std::map<std::string, std::string> metadata = {}) {
  TensorFile f{.tensors = {}, .metadata = std::move(metadata)};
  for (const auto& e : checkpoint::module_state(module)) f.tensors.emplace_back(e.key(), e.value());
  return f;
}

/// Writes the module's parameters and buffers to `path` as safetensors, atomically. The metadata holds
/// `"format": "pt"` (what Hugging Face's loaders look for) unless `metadata` says otherwise.
inline void save_safetensors(const torch::nn::Module& module, const std::string& path,
                             std::map<std::string, std::string> metadata = {}) {
  metadata.emplace("format", "pt");
  safetensors::write(path, module_weights(module, std::move(metadata)));
}

/// The tensors of a weights file: a volt checkpoint's `state_dict`, a safetensors file's tensors and metadata (mapped:
/// the tensors are the file's pages, read when touched, and copied for this process where written), or a Hugging Face
/// model folder's (or its index's).
inline TensorFile read_weights(const std::string& path) {
  if (std::filesystem::is_directory(path) || path.ends_with(".index.json")) return hf::read_folder(path);
  char magic[4] = {};
  std::ifstream(path, std::ios::binary).read(magic, 4);
  if (std::string_view(magic, 4) != std::string_view("PK\x03\x04", 4)) return safetensors::map(path);
  TensorFile f;
  const auto view = checkpoint::View::read(path).sub(checkpoint::keys::state_dict);
  f.tensors = checkpoint::named_tensors(view);
  return f;
}

/// Loads `file`'s tensors into `module` as `options` say (`origin` names the weights in messages).
inline LoadedWeights load_weights(torch::nn::Module& module, const TensorFile& file,
                                  const LoadWeightsOptions& options, const std::string& origin) {
  detail::check_rules(options.rename, "load_weights");
  checkpoint::NamedTensors named;
  for (auto& [name, t] : detail::transformed(file.tensors, options.transforms, origin)) {
    std::string k = detail::renamed(name, options.rename);
    if (!detail::begins_with_any(options.skip, k)) named.emplace_back(std::move(k), std::move(t));
  }
  std::set<std::string> kept;  // the module's own values stand in for what the file need not have
  if (!options.keep.empty()) {
    std::set<std::string> given;
    for (const auto& [k, t] : named) given.insert(k);
    const auto stand_in = [&](const std::string& name, const at::Tensor& value) {
      if (value.defined() && !given.count(name) && detail::begins_with_any(options.keep, name)) {
        named.emplace_back(name, value);
        kept.insert(name);
      }
    };
    for (const auto& p : module.named_parameters(true)) stand_in(p.key(), p.value());
    for (const auto& b : module.named_buffers(true)) stand_in(b.key(), b.value());
  }
  detail::check_unique(named, "renaming the weights in " + origin, "nothing was loaded");
  auto m = checkpoint::match_weights(module, named, options.strict, origin);
  torch::NoGradGuard no_grad;
  for (auto& [mine, theirs] : m.copies) {
    if (!mine.is_same(theirs)) mine.copy_(theirs);
  }
  std::erase_if(m.loaded, [&](const std::string& name) { return kept.count(name) > 0; });
  return {std::move(m.loaded), std::move(m.missing), std::move(m.unexpected)};
}

/// Loads the weights in `path` (a safetensors file or a volt checkpoint) into `module` as `options` say.
inline LoadedWeights load_weights(torch::nn::Module& module, const std::string& path,
                                  const LoadWeightsOptions& options = {}) {
  return load_weights(module, read_weights(path), options, path);
}

/// Writes `module`'s parameters and buffers into the folder `dir` as a Hugging Face model folder (`model.safetensors`,
/// or shards and their index), renamed and transformed as `options` say, each file atomically; an earlier save's files
/// that this one does not replace are removed. What `from_pretrained` reads beside the weights (`config.json`) is the
/// model's to write.
inline void save_weights(const torch::nn::Module& module, const std::string& dir, SaveWeightsOptions options = {}) {
  detail::check_rules(options.rename, "save_weights");
  std::vector<std::pair<std::string, at::Tensor>> kept;
  for (const auto& e : checkpoint::module_state(module)) {
    if (!detail::begins_with_any(options.skip, e.key())) kept.emplace_back(e.key(), e.value());
  }
  options.metadata.emplace("format", "pt");
  TensorFile file{.tensors = {}, .metadata = std::move(options.metadata)};
  auto transformed = detail::transformed(std::move(kept), options.transforms, "the module", "nothing was written");
  for (auto& [name, t] : transformed) {
    file.tensors.emplace_back(detail::renamed(name, options.rename), std::move(t));
  }
  detail::check_unique(file.tensors, "save_weights' renaming", "nothing was written");
  hf::write_folder(dir, file, options.max_shard_bytes);
}

/// How `freeze` treats batch normalization (Lightning's `BaseFinetuning.freeze(train_bn=...)`).
struct FreezeOptions {
  bool train_bn = true;  ///< batch norms inside stay trainable; `false`: frozen too, their statistics kept
};

namespace detail {

/// Calls `f` with `m` as its batch-norm type when it is one; returns whether it was.
template <class F>
bool as_batch_norm(torch::nn::Module& m, F&& f) {
  if (auto* b = m.as<torch::nn::BatchNorm1dImpl>()) return f(*b), true;
  if (auto* b = m.as<torch::nn::BatchNorm2dImpl>()) return f(*b), true;
  if (auto* b = m.as<torch::nn::BatchNorm3dImpl>()) return f(*b), true;
  return false;
}

/// `m` and every module below it.
template <class F>
void each_module(torch::nn::Module& m, F&& f) {
  f(m);
  for (const auto& child : m.modules(/*include_self=*/false)) f(*child);
}

/// The momentum each batch norm frozen with `.train_bn = false` had, until `unfreeze` gives it back (a module that
/// no longer exists drops out: its weak pointer expires).
struct FrozenNorms {
  using Momentum = std::remove_cvref_t<decltype(std::declval<torch::nn::BatchNormOptions&>().momentum())>;
  std::mutex mutex;
  std::vector<std::pair<std::weak_ptr<torch::nn::Module>, Momentum>> momenta;
  static FrozenNorms& get() {
    static FrozenNorms f;
    return f;
  }
};

}  // namespace detail

/// Stops gradients for every parameter of `module` (requires_grad off), so optimizers leave them alone. Batch norms
/// stay trainable unless `.train_bn = false`; then they are frozen too and keep their running statistics: they
/// normalize a training batch by its own statistics and update nothing (momentum 0 until `unfreeze`), and in
/// evaluation use the kept statistics, as a frozen batch norm under Lightning's `BaseFinetuning`.
inline void freeze(torch::nn::Module& module, FreezeOptions options = {}) {
  detail::each_module(module, [&](torch::nn::Module& m) {
    const bool bn = detail::as_batch_norm(m, [&](auto& b) {
      if (options.train_bn || !b.running_mean.defined()) return;
      auto& frozen = detail::FrozenNorms::get();
      std::lock_guard<std::mutex> lock(frozen.mutex);
      std::erase_if(frozen.momenta, [&](const auto& e) { return e.first.expired() || e.first.lock().get() == &m; });
      frozen.momenta.emplace_back(m.weak_from_this(), b.options.momentum());
      b.options.momentum(0.0);
    });
    if (bn && options.train_bn) return;
    for (auto& p : m.parameters(/*recurse=*/false)) p.set_requires_grad(false);
  });
}

/// Lets gradients flow to every parameter of `module` again; batch norms frozen with `.train_bn = false` get their
/// momentum back and update their statistics again.
inline void unfreeze(torch::nn::Module& module) {
  detail::each_module(module, [](torch::nn::Module& m) {
    for (auto& p : m.parameters(/*recurse=*/false)) p.set_requires_grad(true);
    detail::as_batch_norm(m, [&](auto& b) {
      auto& frozen = detail::FrozenNorms::get();
      std::lock_guard<std::mutex> lock(frozen.mutex);
      for (const auto& [who, momentum] : frozen.momenta) {
        if (who.lock().get() == &m) b.options.momentum(momentum);
      }
      std::erase_if(frozen.momenta, [&](const auto& e) { return e.first.expired() || e.first.lock().get() == &m; });
    });
  });
}

}  // namespace volt
