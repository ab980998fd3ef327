#pragma once
/// \file
/// What graph mode (`Graphed<...>`, volt/accelerators/graphed.hpp) keeps across a fit: the captured variants of
/// the training step, the static batch they read and the layout every batch must keep, and the log calls they make;
/// and the gradient clipping that reads nothing on the host.

#include "volt/batch.hpp"
#include "volt/context.hpp"

#include <ATen/ATen.h>
#include <torch/types.h>

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt::detail {

/// Clips gradients to a total 2-norm of `max_norm` with LibTorch's arithmetic (`clip_grad_norm_`: per-tensor norms,
/// the norm of their stack, the coefficient `max_norm / (norm + 1e-6)` clamped to 1), without reading the norm back.
inline void clip_grad_norm_on_device(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads, norms;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(g.data().norm(2.0));
  const at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2.0);
  const at::Tensor coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
  for (auto& g : grads) g.data().mul_(coef);
}

/// The tensors inside a batch, in the order `map_tensors` visits them.
template <class B>
std::vector<at::Tensor> tensors_of(const B& batch) {
  std::vector<at::Tensor> out;
  (void)map_tensors(batch, [&](const at::Tensor& t) {
    out.push_back(t);
    return t;
  });
  return out;
}

/// What a batch holds besides its tensors' values, as text: its numbers, enums and strings as they are, whether each
/// optional and tensor is there (`t` a tensor, `-` an undefined one, `none`), and its containers' sizes and keys in the
/// order `map_tensors` visits them. Graph mode replays the first batch's layout: tensors are copied in by that order,
/// everything else is the captured batch's. A type known only through a user's `BatchTraits` shows as `*`.
template <class T>
struct Layout {
  static void append(const T&, std::string& out) { out += '*'; }
};

template <class T>
void append_layout(const T& value, std::string& out) {
  Layout<std::remove_cvref_t<T>>::append(value, out);
}

/// `open`, the elements of a range (through `append` for each) separated by commas, `close`.
template <class R, class F>
void append_elements(const R& range, char open, char close, std::string& out, F&& append) {
  out += open;
  bool first = true;
  for (const auto& x : range) {
    if (!first) out += ", ";
    first = false;
    append(x);
  }
  out += close;
}

template <>
struct Layout<at::Tensor> {
  static void append(const at::Tensor& t, std::string& out) { out += t.defined() ? 't' : '-'; }
};
template <>
struct Layout<std::string> {
  static void append(const std::string& s, std::string& out) {
    out += '"';
    out += s;
    out += '"';
  }
};
template <class T>
  requires std::is_arithmetic_v<T> || std::is_enum_v<T>
struct Layout<T> {
  static void append(const T& v, std::string& out) {
    if constexpr (std::is_same_v<T, bool>) {
      out += v ? "true" : "false";
    } else if constexpr (std::is_enum_v<T>) {
      out += std::to_string(static_cast<std::underlying_type_t<T>>(v));
    } else {
      char text[64];
      const auto end = std::to_chars(text, text + sizeof text, v).ptr;  // shortest text that reads back as v
      out.append(text, end);
    }
  }
};
template <class D, class T>
struct Layout<torch::data::Example<D, T>> {
  static void append(const torch::data::Example<D, T>& e, std::string& out) {
    out += '{';
    append_layout(e.data, out);
    if constexpr (!std::is_same_v<T, torch::data::example::NoTarget>) {
      out += ", ";
      append_layout(e.target, out);
    }
    out += '}';
  }
};
template <class T, class A>
struct Layout<std::vector<T, A>> {
  static void append(const std::vector<T, A>& v, std::string& out) {
    append_elements(v, '[', ']', out, [&](const T& x) { append_layout(x, out); });
  }
};
template <class T, std::size_t N>
struct Layout<std::array<T, N>> {
  static void append(const std::array<T, N>& v, std::string& out) {
    append_elements(v, '[', ']', out, [&](const T& x) { append_layout(x, out); });
  }
};
template <class T, class U>
struct Layout<std::pair<T, U>> {
  static void append(const std::pair<T, U>& p, std::string& out) {
    out += '(';
    append_layout(p.first, out);
    out += ", ";
    append_layout(p.second, out);
    out += ')';
  }
};
template <class... Ts>
struct Layout<std::tuple<Ts...>> {
  static void append(const std::tuple<Ts...>& t, std::string& out) {
    out += '(';
    std::apply([&](const auto&... xs) {
      std::size_t i = 0;
      ((out += i++ ? ", " : "", append_layout(xs, out)), ...);
    }, t);
    out += ')';
  }
};
template <class T>
struct Layout<std::optional<T>> {
  static void append(const std::optional<T>& o, std::string& out) {
    if (o) {
      append_layout(*o, out);
    } else {
      out += "none";
    }
  }
};
/// A map's keys and values, in iteration order (an unordered map's depends on how it was built, and graph mode pairs
/// tensors by it, so a batch whose keys come in another order has another layout).
template <class M>
struct MapLayout {
  static void append(const M& m, std::string& out) {
    append_elements(m, '{', '}', out, [&](const auto& kv) {
      append_layout(kv.first, out);
      out += ": ";
      append_layout(kv.second, out);
    });
  }
};
template <class K, class V, class C, class A>
struct Layout<std::map<K, V, C, A>> : MapLayout<std::map<K, V, C, A>> {};
template <class K, class V, class H, class E, class A>
struct Layout<std::unordered_map<K, V, H, E, A>> : MapLayout<std::unordered_map<K, V, H, E, A>> {};

template <class B>
std::string batch_layout(const B& batch) {
  std::string out;
  append_layout(batch, out);
  return out;
}

inline std::string shapes_text(const std::vector<at::Tensor>& tensors) {
  std::ostringstream s;
  for (std::size_t i = 0; i < tensors.size(); ++i) s << (i ? ", " : "") << tensors[i].sizes();
  return s.str();
}

/// The graph state of a fit, whatever its batch type (the Trainer holds it through this base).
struct GraphedStepsBase {
  virtual ~GraphedStepsBase() = default;
};

/// Graph mode's state for graph type `G` and batch type `B`. A step is one of four variants, by whether it starts
/// an accumulation window (zeroes the gradients) and whether it ends one (steps the optimizer): index
/// `2 * starts + steps`. Each is captured the first time it is needed, all from one memory pool.
template <class G, class B>
struct GraphedSteps final : GraphedStepsBase {
  /// Runs the warm-up steps; its stream is the one captures use.
  G warm;
  std::array<G, 4> graphs;
  std::array<bool, 4> captured{};
  /// What `ctx.log` recorded in each variant's `training_step`.
  std::array<LogRecorder, 4> logs;
  /// Each variant's loss (its output, rewritten by every replay).
  std::array<at::Tensor, 4> loss;
  /// The batch the graphs read, on the device; its tensors in the order the loader's batches visit theirs; and the
  /// layout every replayed batch must have (`batch_layout`).
  std::optional<B> inputs;
  std::vector<at::Tensor> input_tensors;
  std::string layout;
  /// Eager batches run before the first capture.
  int64_t warm_batches = 0;

  static constexpr int variant(bool starts, bool steps) { return (starts ? 2 : 0) + (steps ? 1 : 0); }

  /// The graph a new capture shares memory with: one captured before, or the warm-up's (same stream, new pool).
  const G* shared() const {
    for (std::size_t v = 0; v < graphs.size(); ++v) {
      if (captured[v]) return &graphs[v];
    }
    return &warm;
  }

  /// Why `batch` cannot be copied into the static batch (empty when it can, and before there is one): another
  /// layout (`batch_layout`), or tensors of other shapes.
  std::string mismatch(const B& batch) const {
    if (!inputs) return {};
    const std::string given_layout = batch_layout(batch);
    if (given_layout != layout) {
      return "is laid out as " + given_layout + " but the step was captured for " + layout + " (t: a tensor; what is "
             "not a tensor is replayed as captured, and tensors are copied in by their place)";
    }
    const std::vector<at::Tensor> given = tensors_of(batch);
    for (std::size_t i = 0; i < given.size(); ++i) {
      if (given[i].sizes() != input_tensors[i].sizes()) {
        return "has tensors of shapes [" + shapes_text(given) + "] but the step was captured for [" +
               shapes_text(input_tensors) + "]";
      }
    }
    return {};
  }

  /// Copies `batch` into the static batch. The first time, makes the static batch from it, each tensor through
  /// `prepare` (to the device and dtype a step sees) and cloned, and keeps the static tensors in the order `batch`'s
  /// are visited, the order later batches' tensors are copied in (the static batch's own order may differ: a rebuilt
  /// unordered map iterates in another order).
  template <class Prepare>
  void copy_in(const B& batch, Prepare&& prepare) {
    if (!inputs) {
      layout = batch_layout(batch);
      inputs.emplace(map_tensors(batch, [&](const at::Tensor& t) {
        at::Tensor copy = prepare(t).clone();
        input_tensors.push_back(copy);
        return copy;
      }));
      return;
    }
    const std::vector<at::Tensor> given = tensors_of(batch);
    for (std::size_t i = 0; i < given.size(); ++i) input_tensors[i].copy_(given[i], /*non_blocking=*/true);
  }
};

}  // namespace volt::detail
