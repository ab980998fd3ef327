#pragma once
/// \file
/// A fit's hyper-parameters, as Lightning's `save_hyperparameters` keeps them: the JSON object a program gives the
/// Trainer (`Trainer::save_hyperparameters(config.json())`, volt/config.hpp), with the module's own at its top level
/// when the module declares them (`hyper_parameters()`, returning a `volt::Json` object or a configurable struct). A
/// checkpoint holds them under `hyper_parameters` as plain Python values (dictionaries, lists, strings, numbers,
/// booleans, None), which `torch.load(path, weights_only=True)` reads; loggers write them as `hparams.yaml` beside
/// their files.

#include "volt/config/table.hpp"
#include "volt/config/values.hpp"
#include "volt/errors.hpp"

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/List.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace volt::detail {

/// The hyper-parameters given to the Trainer, and those in effect in the running (or last) run (with the module's).
struct HyperParameters {
  Json given = Json::object();
  Json effective = Json::object();
};

/// The module's own hyper-parameters (an empty object when it declares none).
template <class M>
Json module_hyper_parameters(const M& module) {
  if constexpr (requires { module.hyper_parameters(); }) {
    using R = std::remove_cvref_t<decltype(module.hyper_parameters())>;
    if constexpr (config::Configurable<R>) {
      return config::to_json(module.hyper_parameters());
    } else {
      static_assert(std::is_convertible_v<R, Json>, "volt: a module's hyper_parameters() returns a volt::Json object "
                                                    "or a configurable struct (one with volt_fields).");
      Json j = module.hyper_parameters();
      if (!j.is_object()) throw ConfigError("volt: the module's hyper_parameters() gave " + config::shown(j) + " (" +
                                            config::kind_of(j) + "); give a JSON object of names and values.");
      return j;
    }
  } else {
    return Json::object();
  }
}

/// `given` with the module's hyper-parameters added at the top level; a name in both is an error that names it.
template <class M>
Json effective_hyper_parameters(const Json& given, const M& module) {
  Json out = given;
  const Json own = module_hyper_parameters(module);  // kept alive: items() refers to it
  for (const auto& [k, v] : own.items()) {
    if (out.contains(k)) {
      throw ConfigError("volt: the hyper-parameter \"" + k + "\" is both in the module's hyper_parameters() and in "
                        "what save_hyperparameters was given; rename one of them.");
    }
    out[k] = v;
  }
  return out;
}

/// JSON as a checkpoint's value: objects as dictionaries of strings, arrays as lists, null as None. An unsigned
/// integer above int64's range (a checkpoint's integers are int64) is kept as its decimal text.
inline c10::IValue to_ivalue(const Json& j) {
  if (j.is_object()) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [k, v] : j.items()) d.insert(k, to_ivalue(v));
    return d;
  }
  if (j.is_array()) {
    c10::impl::GenericList l(c10::AnyType::get());
    for (const Json& v : j) l.push_back(to_ivalue(v));
    return l;
  }
  if (j.is_string()) return j.get<std::string>();
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_unsigned()) {
    const auto u = j.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::to_string(u);
    return static_cast<int64_t>(u);
  }
  if (j.is_number_integer()) return j.get<int64_t>();
  if (j.is_number()) return j.get<double>();
  return c10::IValue();
}

}  // namespace volt::detail
