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
/// \endcode
///
/// | option of `load_weights` | meaning |
/// |---|---|
/// | `rename` | prefix rewrites `{from, to}` tried in order on each name in the file; the first `from` that begins the name is replaced by `to` (`{"", "backbone."}` puts every name under `backbone.`); a name no rule matches is kept |
/// | `skip` | names (after renaming) that begin with one of these prefixes are left out, and not counted as unexpected |
/// | `strict` | `true` (the default, as PyTorch's `load_state_dict`): every parameter and buffer of the module gets a value and every tensor of the file a place, else an error naming the missing and the unexpected; `false`: what matches is loaded and the rest is returned |
///
/// Shapes must match in every case (an error names each difference); a dtype is converted to the module's
/// (`Tensor::copy_`), and the module's device is kept. Everything is checked before anything is copied: on any error
/// the module is unchanged. The file's format is told by its first bytes (a zip archive: a volt checkpoint, whose
/// `state_dict` is read; else safetensors, volt/checkpoint/safetensors.hpp).

#include "volt/checkpoint.hpp"
#include "volt/errors.hpp"
#include "volt/checkpoint/safetensors.hpp"

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
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

/// The tensors of a weights file: a volt checkpoint's `state_dict`, or a safetensors file's tensors and metadata.
inline TensorFile read_weights(const std::string& path) {
  char magic[4] = {};
  std::ifstream(path, std::ios::binary).read(magic, 4);
  if (std::string_view(magic, 4) != std::string_view("PK\x03\x04", 4)) return safetensors::read(path);
  TensorFile f;
  const auto view = checkpoint::View::read(path).sub(checkpoint::keys::state_dict);
  f.tensors = checkpoint::named_tensors(view);
  return f;
}

/// Loads `file`'s tensors into `module` as `options` say (`origin` names the weights in messages).
inline LoadedWeights load_weights(torch::nn::Module& module, const TensorFile& file,
                                  const LoadWeightsOptions& options, const std::string& origin) {
  checkpoint::NamedTensors named;
  for (const auto& [name, t] : file.tensors) {
    std::string k = name;
    for (const auto& [from, to] : options.rename) {
      if (k.rfind(from, 0) == 0) {
        k = to + k.substr(from.size());
        break;
      }
    }
    const bool skipped =
        std::any_of(options.skip.begin(), options.skip.end(), [&](const std::string& p) { return k.rfind(p, 0) == 0; });
    if (!skipped) named.emplace_back(std::move(k), t);
  }
  std::map<std::string, int> twice;
  for (const auto& [k, t] : named) {
    if (++twice[k] == 2) {
      throw CheckpointError("volt: renaming the weights in " + origin + " gives two tensors the name " + k +
                            "; nothing was loaded.");
    }
  }
  auto m = checkpoint::match_weights(module, named, options.strict, origin);
  torch::NoGradGuard no_grad;
  for (auto& [mine, theirs] : m.copies) mine.copy_(theirs);
  return {std::move(m.loaded), std::move(m.missing), std::move(m.unexpected)};
}

/// Loads the weights in `path` (a safetensors file or a volt checkpoint) into `module` as `options` say.
inline LoadedWeights load_weights(torch::nn::Module& module, const std::string& path,
                                  const LoadWeightsOptions& options = {}) {
  return load_weights(module, read_weights(path), options, path);
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
