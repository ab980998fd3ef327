#pragma once
/// \file
/// How weights change layout on their way between files and modules: name patterns with `*`, rename rules, per-tensor
/// transforms, and Hugging Face's folder of weights (one `model.safetensors`, or shards and their
/// `model.safetensors.index.json`). The calls users make are in volt/weights.hpp.

#include "volt/checkpoint/files.hpp"
#include "volt/checkpoint/safetensors.hpp"
#include "volt/errors.hpp"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace volt {

/// A change made to each tensor whose name matches `name` (a pattern: `*` stands for a run of characters without a
/// '.', `h.*.attn.c_attn.weight`; the whole name must match). `apply` returns the new tensor (a view is fine);
/// `what` names it in messages. The `volt::transform` functions make the usual ones.
struct WeightTransform {
  using Fn = std::function<at::Tensor(const at::Tensor&)>;
  std::string name;
  Fn apply;
  std::string what = "a transform";
};

/// The usual transforms, for `WeightTransform::apply` (`{"h.*.mlp.c_fc.weight", volt::transform::transpose()}`).
namespace transform {
/// Dimensions `a` and `b` swapped: GPT-2's `Conv1D` weights (`[in, out]`) to a `Linear`'s (`[out, in]`), and back.
inline WeightTransform::Fn transpose(int64_t a = 0, int64_t b = 1) {
  return [a, b](const at::Tensor& t) { return t.transpose(a, b); };
}
/// Dimensions in the order `dims` gives.
inline WeightTransform::Fn permute(std::vector<int64_t> dims) {
  return [dims = std::move(dims)](const at::Tensor& t) { return t.permute(dims); };
}
/// The elements in a new shape (one -1 is inferred), in C order.
inline WeightTransform::Fn reshape(std::vector<int64_t> shape) {
  return [shape = std::move(shape)](const at::Tensor& t) { return t.reshape(shape); };
}
/// The elements converted to `dtype`.
inline WeightTransform::Fn cast(at::ScalarType dtype) {
  return [dtype](const at::Tensor& t) { return t.to(dtype); };
}
/// Each step applied to the result of the one before: Llama's rotary layout is
/// `chain(reshape({heads, 2, d / heads / 2, d}), transpose(1, 2), reshape({d, d}))`.
template <class... Steps>
WeightTransform::Fn chain(Steps... steps) {
  return [... steps = std::move(steps)](const at::Tensor& t) {
    at::Tensor out = t;
    ((out = steps(out)), ...);
    return out;
  };
}
}  // namespace transform

namespace detail {

/// Matches `pattern` against the start of `name` (all of `name` unless `prefix`); each `*` matches a run of characters
/// without '.', its text appended to `stars`. Returns the length matched, or npos.
inline std::size_t match_pattern(std::string_view pattern, std::string_view name, bool prefix,
                                 std::vector<std::string>& stars) {
  if (pattern.empty()) return prefix || name.empty() ? 0 : std::string_view::npos;
  if (pattern.front() == '*') {
    for (std::size_t n = 0;; ++n) {  // the shortest run first
      stars.emplace_back(name.substr(0, n));
      const std::size_t rest = match_pattern(pattern.substr(1), name.substr(n), prefix, stars);
      if (rest != std::string_view::npos) return n + rest;
      stars.pop_back();
      if (n == name.size() || name[n] == '.') return std::string_view::npos;
    }
  }
  if (name.empty() || pattern.front() != name.front()) return std::string_view::npos;
  const std::size_t rest = match_pattern(pattern.substr(1), name.substr(1), prefix, stars);
  return rest == std::string_view::npos ? rest : rest + 1;
}

inline bool matches(std::string_view pattern, std::string_view name) {
  std::vector<std::string> stars;
  return match_pattern(pattern, name, /*prefix=*/false, stars) != std::string_view::npos;
}

/// Whether one of `patterns` begins `name` (a prefix, `*` as in match_pattern).
inline bool begins_with_any(const std::vector<std::string>& patterns, const std::string& name) {
  std::vector<std::string> stars;
  for (const std::string& p : patterns) {
    if (match_pattern(p, name, /*prefix=*/true, stars) != std::string_view::npos) return true;
  }
  return false;
}

/// `name` after the first rule whose `from` begins it: that beginning replaced by `to`, each `*` of `to` by the text
/// the same `*` of `from` matched; unchanged when no rule does.
inline std::string renamed(const std::string& name, const std::vector<std::pair<std::string, std::string>>& rules) {
  for (const auto& [from, to] : rules) {
    std::vector<std::string> stars;
    const std::size_t n = match_pattern(from, name, /*prefix=*/true, stars);
    if (n == std::string_view::npos) continue;
    std::string out;
    std::size_t star = 0;
    for (char c : to) {
      if (c == '*') {
        out += stars.at(star++);
      } else {
        out += c;
      }
    }
    return out + name.substr(n);
  }
  return name;
}

/// Refuses two tensors of one name (`what`: how the names came to be, `nothing`: what is then not done).
inline void check_unique(const std::vector<std::pair<std::string, at::Tensor>>& named, const std::string& what,
                         const std::string& nothing) {
  std::set<std::string> seen;
  for (const auto& [k, t] : named) {
    if (!seen.insert(k).second) {
      throw CheckpointError("volt: " + what + " gives two tensors the name " + k + "; " + nothing + ".");
    }
  }
}

/// Refuses rules whose `to` has more `*` than their `from` (`who`: the call, for the message).
inline void check_rules(const std::vector<std::pair<std::string, std::string>>& rules, const std::string& who) {
  for (const auto& [from, to] : rules) {
    const auto stars = [](const std::string& s) { return std::count(s.begin(), s.end(), '*'); };
    if (stars(to) > stars(from)) {
      throw std::invalid_argument("volt: " + who + " rename rule {\"" + from + "\", \"" + to +
                                  "\"} has more '*' in what it writes than in what it matches; each '*' of the second "
                                  "takes the text of the same '*' of the first.");
    }
  }
}

/// The tensors with every transform whose pattern matches their name applied, in order. A transform that fails, or
/// one that matches no tensor, is a CheckpointError naming it (`origin`: the weights, for messages).
inline std::vector<std::pair<std::string, at::Tensor>> transformed(
    std::vector<std::pair<std::string, at::Tensor>> tensors, const std::vector<WeightTransform>& transforms,
    const std::string& origin, const std::string& nothing = "nothing was loaded") {
  std::vector<int64_t> used(transforms.size(), 0);
  for (auto& [name, t] : tensors) {
    for (std::size_t i = 0; i < transforms.size(); ++i) {
      const WeightTransform& tr = transforms[i];
      if (!matches(tr.name, name)) continue;
      ++used[i];
      if (!tr.apply) {
        throw std::invalid_argument("volt: the transform for \"" + tr.name + "\" has no function (apply).");
      }
      try {
        t = tr.apply(t);
      } catch (const std::exception& e) {
        std::ostringstream shape;
        shape << t.sizes();
        throw CheckpointError("volt: " + tr.what + " for \"" + tr.name + "\" failed on " + name + " " + shape.str() +
                              " of " + origin + ": " + std::string(e.what()).substr(0, 300) + "; " + nothing + ".");
      }
    }
  }
  for (std::size_t i = 0; i < transforms.size(); ++i) {
    if (used[i] > 0) continue;
    std::string some;
    for (std::size_t k = 0; k < std::min<std::size_t>(3, tensors.size()); ++k) {
      some += (k ? ", " : "") + tensors[k].first;
    }
    throw CheckpointError("volt: " + transforms[i].what + " for \"" + transforms[i].name + "\" matches no tensor of " +
                          origin + " (its names look like " + some + "); " + nothing + ".");
  }
  return tensors;
}

}  // namespace detail

// ---- Hugging Face's folder of weights ------------------------------------------------------------------------------

namespace hf {

inline constexpr const char* kSingle = "model.safetensors";
inline constexpr const char* kIndex = "model.safetensors.index.json";

/// Reads `path`'s weights: a folder holding `model.safetensors.index.json` (its shards, each mapped) or
/// `model.safetensors`, or an index file itself. Every name the index lists must be in the shard it names.
inline TensorFile read_folder(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  fs::path index = path;
  if (fs::is_directory(path)) {
    if (fs::exists(path / kSingle) && !fs::exists(path / kIndex)) return safetensors::map((path / kSingle).string());
    index = path / kIndex;
    if (!fs::exists(index)) {
      throw CheckpointError("volt: " + path.string() + " holds neither " + kSingle + " nor " + kIndex +
                            ": a Hugging Face model folder has one of them.");
    }
  }
  std::ifstream in(index);
  if (!in) throw CheckpointError("volt: cannot open " + index.string());
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const std::exception& e) {
    throw CheckpointError("volt: " + index.string() + " is not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    throw CheckpointError("volt: " + index.string() + " has no \"weight_map\" object (name: shard file), as "
                          "save_pretrained writes.");
  }
  TensorFile out;
  std::map<std::string, std::map<std::string, at::Tensor>> shards;  // file: its tensors by name
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw CheckpointError("volt: " + index.string() + " names no file for \"" + name + "\".");
    const std::string f = file.get<std::string>();
    if (f.find('/') != std::string::npos || f == "..") {
      throw CheckpointError("volt: " + index.string() + " names the shard \"" + f + "\"; shards are files beside it.");
    }
    auto [it, fresh] = shards.try_emplace(f);
    if (fresh) {
      const fs::path shard = index.parent_path() / f;
      if (!fs::exists(shard)) {
        throw CheckpointError("volt: " + index.string() + " names the shard " + f + ", which is not beside it.");
      }
      TensorFile part = safetensors::map(shard.string());
      for (auto& [k, t] : part.tensors) it->second.emplace(k, t);
      if (out.metadata.empty()) out.metadata = part.metadata;
    }
    const auto found = it->second.find(name);
    if (found == it->second.end()) {
      throw CheckpointError("volt: " + index.string() + " puts \"" + name + "\" in " + f +
                            ", which has no such tensor.");
    }
    out.tensors.emplace_back(name, found->second);
  }
  return out;
}

/// The tensors' indices in shards of at most `max_bytes` each, in order (a tensor larger than that alone), as
/// save_pretrained splits; one shard when `max_bytes` is 0.
inline std::vector<std::vector<std::size_t>> split(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                                   int64_t max_bytes) {
  std::vector<std::vector<std::size_t>> shards(1);
  int64_t in_last = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const int64_t bytes = tensors[i].second.numel() * tensors[i].second.element_size();
    if (max_bytes > 0 && in_last + bytes > max_bytes && !shards.back().empty()) {
      shards.emplace_back();
      in_last = 0;
    }
    shards.back().push_back(i);
    in_last += bytes;
  }
  return shards;
}

/// Writes `file` into the folder `dir` as save_pretrained lays weights out: `model.safetensors`, or with `max_bytes`
/// set and more than that to write, `model-00001-of-0000N.safetensors` and the index (`metadata.total_size`,
/// `weight_map`). Each file is written atomically, the index last; files of an earlier save that this one did not write
/// (other shards, a single file or an index) are then removed, so the folder never mixes two saves' weights.
inline void write_folder(const std::filesystem::path& dir, const TensorFile& file, int64_t max_bytes) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const auto shards = split(file.tensors, max_bytes);
  std::set<std::string> written;
  if (shards.size() == 1) {
    safetensors::write((dir / kSingle).string(), file);
    written.insert(kSingle);
  } else {
    nlohmann::ordered_json index;
    int64_t total = 0;
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    for (std::size_t k = 0; k < shards.size(); ++k) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      TensorFile part{.tensors = {}, .metadata = file.metadata};
      for (std::size_t i : shards[k]) {
        part.tensors.push_back(file.tensors[i]);
        total += file.tensors[i].second.numel() * file.tensors[i].second.element_size();
        map[file.tensors[i].first] = name;
      }
      safetensors::write((dir / name).string(), part);
      written.insert(name);
    }
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = map;
    const std::string text = index.dump(2) + "\n";
    checkpoint::write_atomic((dir / kIndex).string(), {{text.data(), text.size()}});
    written.insert(kIndex);
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    const bool ours = n == kSingle || n == kIndex || (n.rfind("model-", 0) == 0 && n.ends_with(".safetensors"));
    if (ours && !written.count(n)) fs::remove(e.path());
  }
}

}  // namespace hf
}  // namespace volt
