#pragma once
/// \file
/// How volt looks inside a batch: moving it to a device, converting its floating tensors for a "true"
/// precision, and finding its size for weighted epoch means. Lightning's `apply_to_collection`, typed.
///
/// Understood out of the box: `torch::Tensor`, `torch::data::Example<T, U>`, `std::vector`, `std::array`,
/// `std::pair`, `std::tuple`, `std::optional`, `std::map`/`std::unordered_map` values, and any arithmetic or
/// string leaf (left as is).
///
/// Any other batch type works as it is where volt need not look inside it: `Fp32`, `Bf16Mixed` or `Bf16True`
/// on the `CPU` (nothing to move, nothing to cast). volt must look inside a batch to move it to a `GPU` or to cast
/// it for `Fp64True`/`Bf16True` (a compile error says so), and `ctx.log` must find its size for an epoch mean
/// unless you give `.batch_size` (a run-time error says so). For those, specialise `volt::BatchTraits`:
/// \code
///   struct Pair { torch::Tensor x, y; };
///   template <> struct volt::BatchTraits<Pair> {
///     template <class F> static Pair map(const Pair& b, F&& f) { return {f(b.x), f(b.y)}; }
///   };
/// \endcode

#include <torch/data/example.h>
#include <torch/types.h>

#include <array>
#include <concepts>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt {

/// Customisation point: `static B map(const B&, F&& f)` returns a copy of the batch with `f` applied to every
/// tensor in it. Specialise it for batch types volt does not know.
template <class B>
struct BatchTraits;

namespace detail {
template <class>
inline constexpr bool dependent_false = false;
/// A callable the mapping concept probes with: tensor in, tensor out.
struct TensorIdentity {
  torch::Tensor operator()(const torch::Tensor& t) const { return t; }
};
}  // namespace detail

/// A batch volt can look inside: a tensor, a leaf it leaves alone, or a type whose `BatchTraits` can map
/// every tensor in it (the built-in traits require this of their elements, so `std::vector<Unknown>` is not).
template <class B>
concept MappableBatch =
    std::is_same_v<B, torch::Tensor> || std::is_arithmetic_v<B> || std::is_enum_v<B> || std::is_same_v<B, std::string> ||
    requires(const B& b, detail::TensorIdentity f) {
      { BatchTraits<B>::map(b, f) } -> std::convertible_to<B>;
    };

/// Applies `f(const torch::Tensor&) -> torch::Tensor` to every tensor inside `batch`, returning a batch of
/// the same type.
template <class B, class F>
B map_tensors(const B& batch, F&& f) {
  using T = std::remove_cvref_t<B>;
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    return batch.defined() ? f(batch) : batch;
  } else if constexpr (std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, std::string>) {
    return batch;
  } else if constexpr (MappableBatch<T>) {
    return BatchTraits<T>::map(batch, f);
  } else {
    static_assert(detail::dependent_false<T>,
                  "volt: this batch type is unknown to volt, so it cannot be moved to a device or converted. "
                  "Specialise volt::BatchTraits<YourBatch> with a static map(batch, f) (see volt/batch.hpp).");
    return batch;
  }
}

template <class Data, class Target>
struct BatchTraits<torch::data::Example<Data, Target>> {
  template <class F>
    requires MappableBatch<Data> && MappableBatch<Target>
  static torch::data::Example<Data, Target> map(const torch::data::Example<Data, Target>& b, F&& f) {
    return {map_tensors(b.data, f), map_tensors(b.target, f)};
  }
};

template <class Data>
struct BatchTraits<torch::data::Example<Data, torch::data::example::NoTarget>> {
  template <class F>
    requires MappableBatch<Data>
  static torch::data::Example<Data, torch::data::example::NoTarget> map(
      const torch::data::Example<Data, torch::data::example::NoTarget>& b, F&& f) {
    return {map_tensors(b.data, f)};
  }
};

template <class T, class A>
struct BatchTraits<std::vector<T, A>> {
  template <class F>
    requires MappableBatch<T>
  static std::vector<T, A> map(const std::vector<T, A>& b, F&& f) {
    std::vector<T, A> out;
    out.reserve(b.size());
    for (const auto& x : b) out.push_back(map_tensors(x, f));
    return out;
  }
};

template <class T, std::size_t N>
struct BatchTraits<std::array<T, N>> {
  template <class F>
    requires MappableBatch<T>
  static std::array<T, N> map(const std::array<T, N>& b, F&& f) {
    std::array<T, N> out;
    for (std::size_t i = 0; i < N; ++i) out[i] = map_tensors(b[i], f);
    return out;
  }
};

template <class T, class U>
struct BatchTraits<std::pair<T, U>> {
  template <class F>
    requires MappableBatch<T> && MappableBatch<U>
  static std::pair<T, U> map(const std::pair<T, U>& b, F&& f) {
    return {map_tensors(b.first, f), map_tensors(b.second, f)};
  }
};

template <class... Ts>
struct BatchTraits<std::tuple<Ts...>> {
  template <class F>
    requires (MappableBatch<Ts> && ...)
  static std::tuple<Ts...> map(const std::tuple<Ts...>& b, F&& f) {
    return std::apply([&](const auto&... xs) { return std::tuple<Ts...>{map_tensors(xs, f)...}; }, b);
  }
};

template <class T>
struct BatchTraits<std::optional<T>> {
  template <class F>
    requires MappableBatch<T>
  static std::optional<T> map(const std::optional<T>& b, F&& f) {
    return b ? std::optional<T>{map_tensors(*b, f)} : std::nullopt;
  }
};

template <class K, class V, class C, class A>
struct BatchTraits<std::map<K, V, C, A>> {
  template <class F>
    requires MappableBatch<V>
  static std::map<K, V, C, A> map(const std::map<K, V, C, A>& b, F&& f) {
    std::map<K, V, C, A> out;
    for (const auto& [k, v] : b) out.emplace(k, map_tensors(v, f));
    return out;
  }
};

template <class K, class V, class H, class E, class A>
struct BatchTraits<std::unordered_map<K, V, H, E, A>> {
  template <class F>
    requires MappableBatch<V>
  static std::unordered_map<K, V, H, E, A> map(const std::unordered_map<K, V, H, E, A>& b, F&& f) {
    std::unordered_map<K, V, H, E, A> out;
    for (const auto& [k, v] : b) out.emplace(k, map_tensors(v, f));
    return out;
  }
};

/// The batch size Lightning would infer: the first dimension of the first tensor found (0 for none).
template <class B>
int64_t infer_batch_size(const B& batch) {
  int64_t size = -1;
  (void)map_tensors(batch, [&](const torch::Tensor& t) {
    if (size < 0) size = t.dim() == 0 ? 1 : t.size(0);
    return t;
  });
  return size < 0 ? 0 : size;
}

/// Moves every tensor of the batch to `device` (non-blocking where the source is pinned).
template <class B>
B batch_to_device(const B& batch, const torch::Device& device) {
  return map_tensors(batch, [&](const torch::Tensor& t) { return t.to(device, /*non_blocking=*/true); });
}

/// Casts every floating-point tensor of the batch to `dtype`; integer tensors (labels, indices) stay.
template <class B>
B batch_to_floating_dtype(const B& batch, torch::Dtype dtype) {
  return map_tensors(batch, [&](const torch::Tensor& t) { return t.is_floating_point() ? t.to(dtype) : t; });
}

}  // namespace volt
