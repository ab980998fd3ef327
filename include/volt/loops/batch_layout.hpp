#pragma once
/// \file
/// A batch's layout for graph mode (`Graphed<...>`, loops/graphed_step.hpp): its tensors in the order `map_tensors`
/// visits them, and what it holds besides its tensors' values, as text, which every replayed batch must keep.

#include "volt/batch.hpp"

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

}  // namespace volt::detail
