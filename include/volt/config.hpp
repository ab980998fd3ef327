#pragma once
/// \file
/// A training program's configuration from files and flags, as LightningCLI gives a Lightning program: the Trainer's
/// options, the loader's and the program's own, each a plain struct with a table of its fields
/// (volt/config/table.hpp), grouped in named sections.
/// \code
///   volt::TrainerOptions trainer{.max_epochs = 5};   // the program's defaults
///   ModelOptions model;                              // a struct of the program's, with volt_fields
///   volt::Config config("gpt", "Trains a small GPT on a text file.");
///   config.add("trainer", trainer).add("model", model);
///   if (!config.parse(argc, argv)) return 0;         // --help or --print_config printed
///   // trainer and model now hold the effective values
/// \endcode
/// Flags: `--trainer.max_epochs=5` (or `--trainer.max_epochs 5`; a bare `--trainer.deterministic` is true),
/// `--config run.json` (a JSON object of sections, `{"trainer": {"max_epochs": 5}}`; `//` comments allowed),
/// `--print_config` (prints the effective configuration as JSON, which `--config` reads back to the same options, and
/// ends), `--help` (every option with what it takes, its default and what it means). Files and flags apply in the
/// order given, so a later one wins. An unknown option, a value of the wrong type, or a `TrainerOptions` value that
/// `validate_options` refuses is a `ConfigError` of one line that names the option, the value and what is allowed.
///
/// **Choosing the Trainer's type.** Which Trainer runs stays a compile-time choice; a configuration picks among those
/// the program compiled, through an enumeration in the program's own section:
/// \code
///   enum class Strategy { single, ddp };
///   constexpr auto volt_enum_names(Strategy) { ... }   // {single, "single"}, {ddp, "ddp"}
///   switch (run.strategy) {                              // --run.strategy=ddp
///     case Strategy::single: return train<volt::Trainer<volt::SingleDevice, volt::Fp32>>(trainer, model);
///     case Strategy::ddp: return train<volt::Trainer<volt::DDP<>, volt::Fp32>>(trainer, model);
///   }
/// \endcode
/// `json()` is the effective configuration, which `Trainer::save_hyperparameters` keeps in checkpoints and beside the
/// logs.

#include "volt/config/table.hpp"
#include "volt/config/trainer_options.hpp"
#include "volt/config/values.hpp"
#include "volt/errors.hpp"
#include "volt/options.hpp"

#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace volt {

class Config {
 public:
  /// `program` and `about` head `--help`.
  explicit Config(std::string program = "", std::string about = "")
      : program_(std::move(program)), about_(std::move(about)) {}

  /// Adds the section `name` over `options`: its current values are the defaults, and parsing writes into it (keep
  /// it alive as long as this Config).
  template <config::Configurable T>
  Config& add(std::string name, T& options) {
    if (name.empty() || name.find_first_of(".= ") != std::string::npos) {
      throw ConfigError("volt: a configuration section is named \"" + name + "\": give a name without '.', '=' or "
                        "spaces (\"trainer\", \"model\").");
    }
    for (const Section& s : sections_) {
      if (s.name == name) throw ConfigError("volt: the configuration has two sections named \"" + name + "\".");
    }
    Section s;
    s.name = name;
    s.to_json = [&options] { return config::to_json(options); };
    s.apply = [&options, name](const Json& j, const config::Source& from, const std::vector<std::string>& keys) {
      config::apply(options, j, name, from, keys);
    };
    s.set = [&options, name](std::string_view key, const std::string* text, const config::Source& from) {
      return config::set(options, key, name + "." + std::string(key), text, nullptr, from);
    };
    s.describe = [&options, name](std::vector<std::string>& out) { config::describe(options, name, out); };
    s.keys = [name](std::vector<std::string>& out) { config::list_keys<T>(name, out); };
    if constexpr (std::is_same_v<T, TrainerOptions>) s.validate = [&options] { validate_options(options); };
    sections_.push_back(std::move(s));
    return *this;
  }

  /// Reads `argv` (flags and `--config` files, in order). Returns false when `--help` or `--print_config` printed
  /// to `out` and the program should end (with status 0); throws `ConfigError` for anything it cannot take.
  bool parse(int argc, const char* const* argv, std::ostream& out = std::cout) {
    if (argc > 0 && program_.empty()) program_ = std::filesystem::path(argv[0]).filename().string();
    bool print = false;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        out << help();
        return false;
      }
      if (arg == "--print_config") {
        print = true;
        continue;
      }
      if (arg.size() < 3 || arg.rfind("--", 0) != 0) {
        throw ConfigError("volt: unexpected argument \"" + arg + "\": options are flags, --<section>.<option>=<value> "
                          "(--help lists them).");
      }
      const std::size_t eq = arg.find('=');
      const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      std::optional<std::string> value;
      std::string shown = arg;
      if (eq != std::string::npos) {
        value = arg.substr(eq + 1);
      } else if (i + 1 < argc && std::string_view(argv[i + 1]).rfind("--", 0) != 0) {
        value = argv[++i];
        shown += " " + *value;
      }
      if (name == "config") {
        if (!value) throw ConfigError("volt: --config needs a file: --config run.json.");
        load(*value);
      } else {
        set_flag(name, value, shown);
      }
    }
    validate();
    if (print) {
      out << json().dump(2) << "\n";
      return false;
    }
    return true;
  }

  /// Applies a JSON file: an object of sections, each an object of options (`--config FILE`).
  void load(const std::filesystem::path& file) {
    std::ifstream in(file);
    if (!in) throw ConfigError("volt: cannot open the configuration file " + file.string() + ".");
    std::stringstream text;
    text << in.rdbuf();
    Json j;
    try {
      j = Json::parse(text.str(), nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
    } catch (const Json::parse_error& e) {
      throw ConfigError("volt: " + file.string() + " is not valid JSON: " + e.what());
    }
    apply(j, config::Source{file.string()});
  }

  /// Applies a JSON object of sections (`{"trainer": {"max_epochs": 5}}`); `where` names it in messages.
  void apply(const Json& j, const config::Source& from) {
    if (!j.is_object()) {
      throw ConfigError("volt: " + from.where + ": a configuration is an object of sections ({\"trainer\": {...}}); "
                        "got " + config::shown(j) + " (" + config::kind_of(j) + ").");
    }
    const std::vector<std::string> all = keys();
    for (const auto& [name, value] : j.items()) {
      Section* s = find(name);
      if (s == nullptr) config::unknown_option(from, name, all);
      s->apply(value, from, all);
    }
  }

  /// Sets one option from text, as the flag `--<key>=<text>` does.
  void set(std::string_view key, const std::string& text) {
    set_flag(std::string(key), text, "--" + std::string(key) + "=" + text);
  }

  /// The effective configuration: every section's options, in the order they were added and declared.
  Json json() const {
    Json out = Json::object();
    for (const Section& s : sections_) out[s.name] = s.to_json();
    return out;
  }

  /// Every option's full name (`trainer.max_epochs`), in order.
  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    for (const Section& s : sections_) s.keys(out);
    return out;
  }

  /// What `--help` prints.
  std::string help() const {
    std::ostringstream s;
    s << "usage: " << program_ << " [--config FILE] [--<section>.<option>=VALUE ...] [--print_config] [--help]\n";
    if (!about_.empty()) s << about_ << "\n";
    s << "\n  --config FILE\n      read options from a JSON file ({\"trainer\": {\"max_epochs\": 5}}); files and flags "
         "apply in order\n  --print_config\n      print the effective configuration as JSON (--config reads it back) "
         "and end\n";
    for (const Section& section : sections_) {
      std::vector<std::string> lines;
      section.describe(lines);
      s << "\n" << section.name << ":\n";
      for (const std::string& l : lines) s << l << "\n";
    }
    return s.str();
  }

 private:
  struct Section {
    std::string name;
    std::function<Json()> to_json;
    std::function<void(const Json&, const config::Source&, const std::vector<std::string>&)> apply;
    std::function<bool(std::string_view, const std::string*, const config::Source&)> set;
    std::function<void(std::vector<std::string>&)> describe;
    std::function<void(std::vector<std::string>&)> keys;
    std::function<void()> validate;
  };

  Section* find(std::string_view name) {
    for (Section& s : sections_) {
      if (s.name == name) return &s;
    }
    return nullptr;
  }

  void set_flag(const std::string& name, const std::optional<std::string>& value, const std::string& shown) {
    const config::Source from{shown, /*flag=*/true, /*bare=*/!value.has_value()};
    const std::size_t dot = name.find('.');
    Section* s = dot == std::string::npos ? nullptr : find(std::string_view(name).substr(0, dot));
    const std::string text = value.value_or("");
    if (s == nullptr || !s->set(std::string_view(name).substr(dot + 1), &text, from)) {
      config::unknown_option(from, name, keys());
    }
  }

  void validate() const {
    for (const Section& s : sections_) {
      if (s.validate) s.validate();
    }
  }

  std::string program_;
  std::string about_;
  std::vector<Section> sections_;
};

}  // namespace volt
