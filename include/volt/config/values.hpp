#pragma once
/// \file
/// One option's value in a configuration: how it reads from a flag's text (`--trainer.max_epochs=5`) and from a JSON
/// file, how it prints (so that a printed configuration reads back to the same value), and what it allows (for
/// `--help` and for the error that refuses anything else). `Value<T>` is defined for bool, integers, floating point
/// numbers, strings, `std::optional`, `std::vector`, `std::chrono` durations, `volt::Limit` and enumerations that name
/// their values with `volt_enum_names` (found by argument-dependent lookup):
/// \code
///   enum class Strategy { single, ddp };
///   constexpr auto volt_enum_names(Strategy) {
///     using P = std::pair<Strategy, std::string_view>;
///     return std::array{P{Strategy::single, "single"}, P{Strategy::ddp, "ddp"}};
///   }
/// \endcode
/// `from_text` and `from_json` answer `std::nullopt` for a value they do not take; the caller names the option.

#include "volt/options.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

/// JSON whose objects keep their keys in the order they were given (a printed configuration lists options in the
/// order their structs declare them).
using Json = nlohmann::ordered_json;

namespace config {

template <class T>
struct Value;

/// An enumeration whose values have names (`volt_enum_names(E)` returns pairs of value and name).
template <class E>
concept NamedEnum = std::is_enum_v<E> && requires(E e) {
  { volt_enum_names(e)[0].second } -> std::convertible_to<std::string_view>;
};

/// A type a configuration option may have.
template <class T>
concept OptionValue = requires(std::string_view text, const Json& j, const T& v) {
  { Value<T>::from_text(text) } -> std::same_as<std::optional<T>>;
  { Value<T>::from_json(j) } -> std::same_as<std::optional<T>>;
  { Value<T>::to_json(v) } -> std::same_as<Json>;
  { Value<T>::allowed() } -> std::convertible_to<std::string>;
};

template <>
struct Value<bool> {
  static std::string allowed() { return "true or false"; }
  static std::optional<bool> from_text(std::string_view t) {
    if (t == "true" || t == "1") return true;
    if (t == "false" || t == "0") return false;
    return std::nullopt;
  }
  static std::optional<bool> from_json(const Json& j) {
    if (j.is_boolean()) return j.get<bool>();
    return std::nullopt;
  }
  static Json to_json(bool v) { return v; }
};

template <class I>
  requires(std::integral<I> && !std::same_as<I, bool> && !std::same_as<I, char>)
struct Value<I> {
  static std::string allowed() {
    if constexpr (std::is_unsigned_v<I>) return "an integer from 0 to " + std::to_string(std::numeric_limits<I>::max());
    return "an integer";
  }
  static std::optional<I> from_text(std::string_view t) {
    I v{};
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (ec != std::errc() || end != t.data() + t.size()) return std::nullopt;
    return v;
  }
  static std::optional<I> from_json(const Json& j) {
    if (j.is_number_unsigned()) {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<I>::max())) return std::nullopt;
      return static_cast<I>(u);
    }
    if (j.is_number_integer()) {
      const auto s = j.get<int64_t>();
      if constexpr (std::is_unsigned_v<I>) {
        return std::nullopt;  // negative (non-negative ones are number_unsigned)
      } else {
        if (s < static_cast<int64_t>(std::numeric_limits<I>::min()) ||
            s > static_cast<int64_t>(std::numeric_limits<I>::max())) {
          return std::nullopt;
        }
        return static_cast<I>(s);
      }
    }
    return std::nullopt;
  }
  static Json to_json(I v) { return v; }
};

template <std::floating_point F>
struct Value<F> {
  static std::string allowed() { return "a number"; }
  static std::optional<F> from_text(std::string_view t) {
    const std::string s(t);  // std::from_chars for doubles needs GCC 11; strtod reads the same forms
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || end != s.c_str() + s.size()) return std::nullopt;
    return static_cast<F>(v);
  }
  static std::optional<F> from_json(const Json& j) {
    if (j.is_number()) return j.get<F>();
    return std::nullopt;
  }
  static Json to_json(F v) { return v; }
};

template <>
struct Value<std::string> {
  static std::string allowed() { return "a string"; }
  static std::optional<std::string> from_text(std::string_view t) { return std::string(t); }
  static std::optional<std::string> from_json(const Json& j) {
    if (j.is_string()) return j.get<std::string>();
    return std::nullopt;
  }
  static Json to_json(const std::string& v) { return v; }
};

template <OptionValue T>
struct Value<std::optional<T>> {
  // Built with append and emplace rather than `+` and a returned temporary: GCC 12 at -O2 warns falsely on those
  // (-Warray-bounds, -Wmaybe-uninitialized) in every program that includes volt.
  static std::string allowed() {
    std::string out = Value<T>::allowed();
    out.append(", or null (unset)");
    return out;
  }
  static std::optional<std::optional<T>> from_text(std::string_view t) {
    if (t == "null" || t == "none") return unset();
    if (auto v = Value<T>::from_text(t)) return std::optional<T>(std::move(*v));
    return std::nullopt;
  }
  static std::optional<std::optional<T>> from_json(const Json& j) {
    if (j.is_null()) return unset();
    if (auto v = Value<T>::from_json(j)) return std::optional<T>(std::move(*v));
    return std::nullopt;
  }
  static std::optional<std::optional<T>> unset() {
    std::optional<std::optional<T>> out;
    out.emplace();
    return out;
  }
  static Json to_json(const std::optional<T>& v) { return v ? Value<T>::to_json(*v) : Json(nullptr); }
};

template <OptionValue T>
struct Value<std::vector<T>> {
  static std::string allowed() {
    std::string out = "a list of ";
    out.append(Value<T>::allowed()).append(" (JSON [a, b], or a, b in a flag)");
    return out;
  }
  static std::optional<std::vector<T>> from_text(std::string_view t) {
    if (!t.empty() && t.front() == '[') {
      const Json j = Json::parse(t, nullptr, /*allow_exceptions=*/false);
      return j.is_discarded() ? std::nullopt : from_json(j);
    }
    std::vector<T> out;
    while (!t.empty()) {
      const std::size_t comma = t.find(',');
      std::string_view item = t.substr(0, comma);
      while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
      while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
      auto v = Value<T>::from_text(item);
      if (!v) return std::nullopt;
      out.push_back(std::move(*v));
      t = comma == std::string_view::npos ? std::string_view() : t.substr(comma + 1);
    }
    return out;
  }
  static std::optional<std::vector<T>> from_json(const Json& j) {
    if (!j.is_array()) return std::nullopt;
    std::vector<T> out;
    for (const Json& e : j) {
      auto v = Value<T>::from_json(e);
      if (!v) return std::nullopt;
      out.push_back(std::move(*v));
    }
    return out;
  }
  static Json to_json(const std::vector<T>& v) {
    Json out = Json::array();
    for (const T& e : v) out.push_back(Value<T>::to_json(e));
    return out;
  }
};

/// A batch limit: an integer is a number of batches, a number with a point or an exponent a fraction (as in C++ and
/// Lightning: `5` and `0.25`).
template <>
struct Value<Limit> {
  static std::string allowed() { return "an integer number of batches, or a fraction such as 0.25"; }
  static std::optional<Limit> from_text(std::string_view t) {
    if (t.find_first_of(".eE") == std::string_view::npos) {
      if (auto n = Value<int64_t>::from_text(t)) return Limit(*n);
      return std::nullopt;
    }
    if (auto f = Value<double>::from_text(t)) return Limit(*f);
    return std::nullopt;
  }
  static std::optional<Limit> from_json(const Json& j) {
    if (j.is_number_integer()) return Limit(j.get<int64_t>());
    if (j.is_number_float()) return Limit(j.get<double>());
    return std::nullopt;
  }
  static Json to_json(const Limit& v) { return v.is_fraction() ? Json(v.fraction()) : Json(v.count()); }
};

template <NamedEnum E>
struct Value<E> {
  static std::string allowed() {
    std::string s;
    for (const auto& [value, name] : volt_enum_names(E{})) s += (s.empty() ? "one of " : ", ") + std::string(name);
    return s;
  }
  static std::optional<E> from_text(std::string_view t) {
    for (const auto& [value, name] : volt_enum_names(E{})) {
      if (name == t) return value;
    }
    return std::nullopt;
  }
  static std::optional<E> from_json(const Json& j) {
    if (!j.is_string()) return std::nullopt;
    return from_text(j.get_ref<const std::string&>());
  }
  static Json to_json(E v) {
    for (const auto& [value, name] : volt_enum_names(E{})) {
      if (value == v) return std::string(name);
    }
    return static_cast<std::underlying_type_t<E>>(v);  // a value without a name prints as its number
  }
};

/// A duration: a whole number with its unit (`500ms`, `30s`, `90min`, `12h`, `2d`), several added (`1h30min`), or
/// Lightning's `DD:HH:MM:SS`. A bare number has no unit and is refused. Printed in the largest unit that is exact.
template <class Rep, class Period>
struct Value<std::chrono::duration<Rep, Period>> {
  using D = std::chrono::duration<Rep, Period>;
  static std::string allowed() {
    return "a duration such as \"500ms\", \"30s\", \"90min\", \"12h\", \"1h30min\" or \"DD:HH:MM:SS\"";
  }
  static std::optional<D> from_text(std::string_view t) {
    using namespace std::chrono;
    if (std::count(t.begin(), t.end(), ':') == 3) return from_clock(t);
    milliseconds total{0};
    if (t.empty()) return std::nullopt;
    while (!t.empty()) {
      int64_t n = 0;
      const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), n);
      if (ec != std::errc() || end == t.data() + t.size()) return std::nullopt;
      t.remove_prefix(static_cast<std::size_t>(end - t.data()));
      const std::size_t unit_end = std::min(t.find_first_of("0123456789"), t.size());
      const std::string_view unit = t.substr(0, unit_end);
      t.remove_prefix(unit_end);
      if (unit == "ms") total += milliseconds(n);
      else if (unit == "s") total += seconds(n);
      else if (unit == "min") total += minutes(n);
      else if (unit == "h") total += hours(n);
      else if (unit == "d") total += hours(24 * n);
      else return std::nullopt;
    }
    return std::chrono::duration_cast<D>(total);
  }
  static std::optional<D> from_json(const Json& j) {
    if (!j.is_string()) return std::nullopt;
    return from_text(j.get_ref<const std::string&>());
  }
  static Json to_json(const D& v) {
    using namespace std::chrono;
    const auto ms = duration_cast<milliseconds>(v).count();
    const std::pair<int64_t, const char*> units[] = {{86400000, "d"}, {3600000, "h"}, {60000, "min"}, {1000, "s"}};
    for (const auto& [size, name] : units) {
      if (ms != 0 && ms % size == 0) return std::to_string(ms / size) + name;
    }
    return std::to_string(ms) + "ms";
  }

 private:
  static std::optional<D> from_clock(std::string_view t) {
    int64_t parts[4] = {};
    for (int64_t& p : parts) {
      const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), p);
      if (ec != std::errc() || p < 0) return std::nullopt;
      t.remove_prefix(static_cast<std::size_t>(end - t.data()));
      if (!t.empty() && t.front() == ':') t.remove_prefix(1);
    }
    if (!t.empty()) return std::nullopt;
    using namespace std::chrono;
    return duration_cast<D>(hours(24 * parts[0] + parts[1]) + minutes(parts[2]) + seconds(parts[3]));
  }
};

/// A value as a short quoted text for messages: a JSON value as JSON (strings quoted), a flag's text quoted.
inline std::string shown(const Json& j) {
  std::string s = j.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

/// The JSON type of a value, for "not 5 (a number)" in messages.
inline std::string kind_of(const Json& j) {
  if (j.is_null()) return "null";
  if (j.is_boolean()) return "a boolean";
  if (j.is_number_integer()) return "an integer";
  if (j.is_number()) return "a number";
  if (j.is_string()) return "a string";
  if (j.is_array()) return "a list";
  return "an object";
}

}  // namespace config
}  // namespace volt
