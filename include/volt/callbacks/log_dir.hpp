#pragma once
/// \file
/// Where a logger writes: `<save_dir>/<name>/version_<n>/`, the versioning of Lightning's loggers, shared by every
/// logger of a Trainer so that side-by-side loggers (CSVLogger and TensorBoardLogger) write into one folder.

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>

namespace volt::detail {

/// The folder a logger with these settings writes to in this run, created. `save_dir` empty: the Trainer's
/// `default_root_dir`. `version` unset: the folder another logger of the same Trainer already chose under the same
/// `<save_dir>/<name>` (a callback with a non-empty `log_dir()`), else the next free version number.
template <class T>
std::filesystem::path logger_dir(T& trainer, const std::string& save_dir, const std::string& name,
                                 std::optional<int> version, const char* who) {
  const std::filesystem::path base =
      std::filesystem::path(save_dir.empty() ? trainer.options().default_root_dir : save_dir) / name;
  std::filesystem::path dir;
  if (version) {
    dir = base / ("version_" + std::to_string(*version));
  } else {
    std::apply([&](const auto&... cb) {
      auto one = [&](const auto& c) {
        if constexpr (requires { c.log_dir(); }) {
          const std::filesystem::path other = c.log_dir();
          if (dir.empty() && !other.empty() && other.parent_path() == base) dir = other;
        }
      };
      (one(cb), ...);
      (void)one;
    }, trainer.callbacks());
    int n = 0;
    while (dir.empty()) {
      if (!std::filesystem::exists(base / ("version_" + std::to_string(n)))) dir = base / ("version_" + std::to_string(n));
      ++n;
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error(std::string("volt: ") + who + " cannot create " + dir.string() + ": " + ec.message());
  return dir;
}

}  // namespace volt::detail
