#pragma once
/// \file
/// A configurable struct: a plain options struct with a table of its fields, in declaration order, each with what it
/// means (for `--help`), found by argument-dependent lookup:
/// \code
///   struct ModelOptions {
///     int64_t width = 128;
///     double lr = 1e-3;
///   };
///   constexpr auto volt_fields(const ModelOptions*) {
///     return volt::fields({{"width", "hidden units per layer"}, {"lr", "AdamW's learning rate"}});
///   }
/// \endcode
/// The table is checked against the struct at compile time: a field the table leaves out (a field added to the struct
/// later) is a compile error that names it (with GCC; elsewhere the error gives the table's length against the
/// struct's). A field whose own type is configurable (`TrainerOptions::signals`) is a nested section
/// (`trainer.signals.enabled`); every other field's type must have a `config::Value` (volt/config/values.hpp).
///
/// The walks below are what volt/config.hpp's `Config` does with a section: print it as JSON, apply a JSON object or
/// one flag to it, and list its options for `--help`. Their errors are one line that names the option, what was
/// given and what is allowed.

#include "volt/config/reflect.hpp"
#include "volt/config/values.hpp"
#include "volt/errors.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

/// One field of a configurable struct: its name as declared, and what it means.
struct FieldDoc {
  std::string_view name;
  std::string_view doc;
  /// What a flag without a value means for an option that is not a bool (`fast_dev_run`'s "1", as Lightning's
  /// `fast_dev_run=True`); empty: such a flag is refused. A bool's bare flag is always true.
  std::string_view bare = {};
};

/// A configurable struct's table: `volt::fields({{"width", "..."}, {"lr", "..."}})`.
template <std::size_t N>
constexpr std::array<FieldDoc, N> fields(const FieldDoc (&list)[N]) {
  std::array<FieldDoc, N> out{};
  for (std::size_t i = 0; i < N; ++i) out[i] = list[i];
  return out;
}

namespace config {

/// A plain options struct with a table of its fields (`volt_fields(const T*)`).
template <class T>
concept Configurable = std::is_aggregate_v<T> && std::is_class_v<T> && requires(const T* p) {
  { volt_fields(p) };
};

namespace detail {

template <class T>
inline constexpr auto docs_of = volt_fields(static_cast<const T*>(nullptr));

template <class...>
inline constexpr bool always_false = false;

/// Instantiated, with the struct and the field's name as its arguments, when the table leaves a field out.
template <class Struct, FixedString Field>
struct field_missing_from_table {
  static_assert(always_false<Struct>,
                "volt: a field of this options struct is not at its place in the struct's configuration table "
                "(volt_fields): the struct and the field's name are the template arguments of "
                "field_missing_from_table above. Add {\"<field>\", \"<what it means>\"} to the table, in the order the "
                "struct declares its fields.");
  static constexpr bool value = false;
};

/// Instantiated when the table names more fields than the struct has (the first extra entry's name).
template <class Struct, FixedString Entry>
struct table_entry_without_field {
  static_assert(always_false<Struct>,
                "volt: an entry of this options struct's configuration table (volt_fields) names no field of the "
                "struct: the struct and the entry are the template arguments of table_entry_without_field above. "
                "Remove the entry, or declare the field.");
  static constexpr bool value = false;
};

template <class T, std::size_t... I>
consteval std::size_t first_unlisted(std::index_sequence<I...>) {
  constexpr auto& docs = docs_of<T>;
  std::size_t out = static_cast<std::size_t>(-1);
  ((out == static_cast<std::size_t>(-1) &&
            (I >= docs.size() || (names_known && docs[std::min(I, docs.size() - 1)].name != field_name<T, I>()))
        ? static_cast<void>(out = I)
        : static_cast<void>(0)),
   ...);
  return out;
}

/// True when T's table lists every field of T at its place; otherwise a compile error naming the first that is not.
template <class T>
consteval bool table_matches() {
  constexpr std::size_t n = field_count<T>();
  constexpr auto& docs = docs_of<T>;
  constexpr std::size_t bad = first_unlisted<T>(std::make_index_sequence<n>{});
  if constexpr (bad != static_cast<std::size_t>(-1)) {
    constexpr std::string_view name = names_known ? field_name<T, bad>() : std::string_view("(unnamed: see the count)");
    return field_missing_from_table<T, FixedString<name.size()>(name)>::value;
  } else if constexpr (docs.size() > n) {
    return table_entry_without_field<T, FixedString<docs[n].name.size()>(docs[n].name)>::value;
  } else {
    return true;
  }
}

template <class T>
inline constexpr bool checked = table_matches<T>();

/// Calls `f(doc, field)` for every field of `object` (a T or a const T), in declaration order.
/// (A table that does not match its struct is the one compile error `checked` gives; nothing more is said.)
template <class T, class Object, class F>
void for_each_field(Object& object, F&& f) {
  if constexpr (checked<T>) {
    auto refs = tie(object);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (f(docs_of<T>[I], std::get<I>(refs)), ...);
    }(std::make_index_sequence<std::tuple_size_v<decltype(refs)>>{});
  }
}

inline std::string join(const std::string& prefix, std::string_view name) {
  return prefix.empty() ? std::string(name) : prefix + "." + std::string(name);
}

}  // namespace detail

/// Where a value came from, for messages: a flag (`--trainer.max_epochs=abc`) or a file (`run.json`).
struct Source {
  std::string where;
  bool flag = false;
  /// A flag without a value (`--trainer.deterministic`): true for an option that takes true or false.
  bool bare = false;
};

/// The option most like `key` among `keys`: one whose last part is the same (`max_epochs` for
/// `trainer.max_epochs`), else one whose last part has it as a whole word (`trainer.max_epochs` for `epochs`), else
/// the nearest in edits when at most a third of its letters differ; empty when none is.
inline std::string suggest(const std::string& key, const std::vector<std::string>& keys) {
  const auto last = [](const std::string& k) { return k.substr(k.rfind('.') + 1); };
  for (const std::string& k : keys) {
    if (last(k) == last(key)) return k;
  }
  const std::string word = last(key);
  for (const std::string& k : keys) {  // `word` bounded by the name's ends or underscores
    const std::string name = last(k);
    for (auto at = name.find(word); !word.empty() && at != std::string::npos; at = name.find(word, at + 1)) {
      const std::size_t end = at + word.size();
      if ((at == 0 || name[at - 1] == '_') && (end == name.size() || name[end] == '_')) return k;
    }
  }
  const auto distance = [](const std::string& a, const std::string& b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diagonal = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        const std::size_t above = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diagonal = above;
      }
    }
    return row[b.size()];
  };
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(2, key.size() / 3) + 1;
  for (const std::string& k : keys) {
    const std::size_t d = distance(k, key);
    if (d < best_distance) {
      best = k;
      best_distance = d;
    }
  }
  return best;
}

[[noreturn]] inline void unknown_option(const Source& from, const std::string& key,
                                        const std::vector<std::string>& keys) {
  const std::string near = suggest(key, keys);
  throw ConfigError("volt: " + from.where + ": unknown option \"" + key + "\"" +
                    (near.empty() ? "" : "; did you mean \"" + near + "\"?") + " (--help lists every option)");
}

/// The section's values as a JSON object (nested sections as objects).
template <Configurable T>
Json to_json(const T& object) {
  Json out = Json::object();
  detail::for_each_field<T>(object, [&](const FieldDoc& doc, const auto& field) {
    using F = std::remove_cvref_t<decltype(field)>;
    if constexpr (Configurable<F>) {
      out[std::string(doc.name)] = to_json(field);
    } else {
      out[std::string(doc.name)] = Value<F>::to_json(field);
    }
  });
  return out;
}

/// Every option's full name under `prefix`, in order (for suggestions).
template <Configurable T>
void list_keys(const std::string& prefix, std::vector<std::string>& out) {
  const T defaults{};
  detail::for_each_field<T>(defaults, [&](const FieldDoc& doc, const auto& field) {
    using F = std::remove_cvref_t<decltype(field)>;
    if constexpr (Configurable<F>) {
      list_keys<F>(detail::join(prefix, doc.name), out);
    } else {
      out.push_back(detail::join(prefix, doc.name));
    }
  });
}

/// One line per option under `prefix` for `--help`: `--key  (what it takes; default: value)  what it means`.
template <Configurable T>
void describe(const T& object, const std::string& prefix, std::vector<std::string>& out) {
  detail::for_each_field<T>(object, [&](const FieldDoc& doc, const auto& field) {
    using F = std::remove_cvref_t<decltype(field)>;
    const std::string key = detail::join(prefix, doc.name);
    if constexpr (Configurable<F>) {
      describe(field, key, out);
    } else {
      out.push_back("  --" + key + "  (" + Value<F>::allowed() + "; default: " + Value<F>::to_json(field).dump() +
                    ")\n      " + std::string(doc.doc));
    }
  });
}

/// Sets the option `key` (dotted, relative to the section; `full_key` is its name in messages) in `object` from a
/// flag's text, or from JSON when `json` is given. Returns false when no option has that name (the caller says so).
template <Configurable T>
bool set(T& object, std::string_view key, const std::string& full_key, const std::string* text, const Json* json,
         const Source& from);

/// Applies a JSON object to `object`: every key must name an option of it (nested sections take objects).
template <Configurable T>
void apply(T& object, const Json& j, const std::string& prefix, const Source& from,
           const std::vector<std::string>& all_keys) {
  if (!j.is_object()) {
    throw ConfigError("volt: " + from.where + ": \"" + prefix + "\" takes an object of options ({\"name\": value, "
                      "...}); got " + shown(j) + " (" + kind_of(j) + ").");
  }
  for (auto it = j.begin(); it != j.end(); ++it) {  // (not a structured binding: Clang 14 cannot capture one)
    const std::string& key = it.key();
    const Json& value = it.value();
    const std::string full = detail::join(prefix, key);
    bool found = false;
    detail::for_each_field<T>(object, [&](const FieldDoc& doc, auto& field) {
      using F = std::remove_cvref_t<decltype(field)>;
      if (found || doc.name != key) return;
      found = true;
      if constexpr (Configurable<F>) {
        apply(field, value, full, from, all_keys);
      } else {
        set(object, key, full, nullptr, &value, from);
      }
    });
    if (!found) unknown_option(from, full, all_keys);
  }
}

template <Configurable T>
bool set(T& object, std::string_view key, const std::string& full_key, const std::string* text, const Json* json,
         const Source& from) {
  const std::size_t dot = key.find('.');
  const std::string_view head = key.substr(0, dot);
  bool found = false;
  detail::for_each_field<T>(object, [&](const FieldDoc& doc, auto& field) {
    using F = std::remove_cvref_t<decltype(field)>;
    if (found || doc.name != head) return;
    if constexpr (Configurable<F>) {
      if (dot == std::string_view::npos) {
        throw ConfigError("volt: " + from.where + ": " + full_key + " is a group of options; give them one by one (--" +
                          full_key + ".<name>=<value>, --help lists them), or as an object in a configuration file.");
      }
      found = set(field, key.substr(dot + 1), full_key, text, json, from);
    } else {
      if (dot != std::string_view::npos) return;
      found = true;
      std::string bare_text;
      const std::string* given = text;
      if (from.bare) {
        if constexpr (std::is_same_v<F, bool> || std::is_same_v<F, std::optional<bool>>) {
          field = true;
          return;
        } else if (!doc.bare.empty()) {
          bare_text = std::string(doc.bare);
          given = &bare_text;
        } else {
          throw ConfigError("volt: " + from.where + ": " + full_key + " needs a value (--" + full_key +
                            "=<value>): it takes " + Value<F>::allowed() + ".");
        }
      }
      std::optional<F> v = json != nullptr ? Value<F>::from_json(*json) : Value<F>::from_text(*given);
      if (!v) {
        const std::string got = json != nullptr ? shown(*json) + " (" + kind_of(*json) + ")" : "\"" + *given + "\"";
        throw ConfigError("volt: " + from.where + ": " + full_key + " takes " + Value<F>::allowed() + "; got " + got +
                          ".");
      }
      field = std::move(*v);
    }
  });
  return found;
}

}  // namespace config
}  // namespace volt
