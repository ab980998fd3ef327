#pragma once
/// \file
/// JSON written as block-style YAML, the form of Lightning's `hparams.yaml`: mappings as `key: value` lines, lists as
/// `- item` lines, strings double-quoted (their JSON escapes are YAML's), numbers as YAML 1.1 readers (PyYAML's
/// `safe_load`) read them back: a floating point value always has a point (`1.0e-05`, which `1e-05` would not be).

#include "volt/config/values.hpp"

#include <cctype>
#include <string>

namespace volt::config {

namespace detail {

inline std::string yaml_scalar(const Json& j) {
  if (j.is_number_float()) {
    std::string s = j.dump();
    const std::size_t e = s.find_first_of("eE");
    if (s.find('.') == std::string::npos) s.insert(e == std::string::npos ? s.size() : e, ".0");
    return s;
  }
  return j.dump();  // strings quoted, integers, true, false, null
}

inline std::string yaml_key(const std::string& k) {
  static const char* const reserved[] = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"};
  bool plain = !k.empty() && (std::isalpha(static_cast<unsigned char>(k[0])) || k[0] == '_');
  for (char c : k) plain = plain && (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '/');
  std::string lower;
  for (char c : k) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* r : reserved) plain = plain && lower != r;
  return plain ? k : Json(k).dump();
}

inline bool yaml_block(const Json& j) { return (j.is_object() || j.is_array()) && !j.empty(); }

inline void yaml_write(const Json& j, int indent, std::string& out) {
  const std::string pad(static_cast<std::size_t>(indent), ' ');
  if (j.is_object()) {
    for (const auto& [k, v] : j.items()) {
      out += pad + yaml_key(k) + ":";
      if (yaml_block(v)) {
        out += "\n";
        yaml_write(v, indent + 2, out);
      } else {
        out += " " + (v.is_object() ? std::string("{}") : v.is_array() ? std::string("[]") : yaml_scalar(v)) + "\n";
      }
    }
  } else {
    for (const Json& v : j) {
      if (yaml_block(v)) {
        out += pad + "-\n";
        yaml_write(v, indent + 2, out);
      } else {
        out += pad + "- " + (v.is_object() ? std::string("{}") : v.is_array() ? std::string("[]") : yaml_scalar(v)) +
               "\n";
      }
    }
  }
}

}  // namespace detail

/// `j` (an object) as a YAML document.
inline std::string to_yaml(const Json& j) {
  std::string out;
  if (!detail::yaml_block(j)) return (j.is_object() ? std::string("{}") : detail::yaml_scalar(j)) + "\n";
  detail::yaml_write(j, 0, out);
  return out;
}

}  // namespace volt::config
