#pragma once
/// \file
/// Where a logger writes: `<save_dir>/<name>/version_<n>/`, the versioning of Lightning's loggers, shared by every
/// logger of a Trainer so that side-by-side loggers (CSVLogger and TensorBoardLogger) write into one folder.

#include "volt/callbacks/concept.hpp"
#include "volt/config/yaml.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>

namespace volt::detail {

/// The folder a logger with these settings writes to in this run, created. `save_dir` empty: the Trainer's
/// `default_root_dir`. `version` unset: the folder another logger of the same Trainer already chose under the same
/// `<save_dir>/<name>` (a callback with a non-empty `log_dir()`), else one more than the highest version there.
template <class T>
std::filesystem::path logger_dir(T& trainer, const std::string& save_dir, const std::string& name,
                                 std::optional<int> version, const char* who) {
  const std::filesystem::path base =
      std::filesystem::path(save_dir.empty() ? trainer.options().default_root_dir : save_dir) / name;
  std::filesystem::path dir;
  if (version) {
    dir = base / ("version_" + std::to_string(*version));
  } else {
    dir = detail::first_answer<std::filesystem::path>(trainer.callbacks(), [&](const auto& c)
      requires requires { c.log_dir(); }
    {
      const std::filesystem::path other = c.log_dir();
      return other.parent_path() == base ? other : std::filesystem::path();
    });
  }
  std::error_code ec;
  if (!dir.empty()) {
    std::filesystem::create_directories(dir, ec);
    if (ec) throw std::runtime_error(std::string("volt: ") + who + " cannot create " + dir.string() + ": " + ec.message());
    return dir;
  }
  // The next version after the highest there, as Lightning counts; claimed by creating it, so that two runs starting
  // together take two folders.
  std::filesystem::create_directories(base, ec);
  if (ec) throw std::runtime_error(std::string("volt: ") + who + " cannot create " + base.string() + ": " + ec.message());
  int next = 0;
  for (const auto& entry : std::filesystem::directory_iterator(base, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.rfind("version_", 0) == 0 && name.size() > 8 &&
        name.find_first_not_of("0123456789", 8) == std::string::npos && name.size() < 18) {
      next = std::max(next, std::stoi(name.substr(8)) + 1);
    }
  }
  for (;; ++next) {
    dir = base / ("version_" + std::to_string(next));
    if (std::filesystem::create_directory(dir, ec)) return dir;
    if (ec) throw std::runtime_error(std::string("volt: ") + who + " cannot create " + dir.string() + ": " + ec.message());
  }
}

/// Writes the run's hyper-parameters as `<dir>/hparams.yaml`, as Lightning's loggers do, through a temporary file and
/// a rename; nothing when there are none.
inline void write_hparams_yaml(const Json& hparams, const std::filesystem::path& dir, const char* who) {
  if (hparams.empty() || dir.empty()) return;
  const std::filesystem::path tmp = dir / "hparams.yaml.tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << config::to_yaml(hparams);
    f.flush();
    if (!f) throw std::runtime_error(std::string("volt: ") + who + " could not write " + tmp.string());
  }
  std::filesystem::rename(tmp, dir / "hparams.yaml");
}

}  // namespace volt::detail
