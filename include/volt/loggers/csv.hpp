#pragma once

#include "volt/loggers/concept.hpp"
#include "volt/loggers/log_dir.hpp"
#include "volt/stage.hpp"

#include <charconv>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace volt {

/// Writes every logged metric to `<save_dir>/<name>/version_<n>/metrics.csv` on rank zero (the version another
/// logger of the Trainer chose under the same folder, else the next free one: loggers/log_dir.hpp), one row per
/// logging event, with a `step` column and the union of all metric names as columns (empty where a row
/// has no value), as Lightning's CSVLogger. Rows are appended; when a new name appears the file is
/// rewritten through a temporary file and a rename, so a reader never sees a half-written header.
/// Every row reaches the file when it is logged (`flush_every` = 1); the Trainer also flushes at each epoch's
/// end, after each validation, on a stop signal, on a failure and at the end of a run, so a crash loses at
/// most the rows of the last `flush_every - 1` logging events. Writes nothing under fast_dev_run. The run's
/// hyper-parameters (`Trainer::save_hyperparameters`) go beside the metrics as `hparams.yaml` when each run starts.
class CSVLogger {
 public:
  static constexpr bool is_logger = true;

  struct Options {
    /// Base folder; empty: the Trainer's default_root_dir.
    std::string save_dir;
    std::string name = "volt_logs";
    /// Unset: the next free version number.
    std::optional<int> version;
    /// Write rows to the file every n logging events (and whenever the Trainer flushes).
    int64_t flush_every = 1;
  };

  CSVLogger() : CSVLogger(Options{}) {}
  explicit CSVLogger(Options options) : options_(std::move(options)) {
    if (options_.flush_every < 1) {
      throw std::invalid_argument("volt: CSVLogger flush_every=" + std::to_string(options_.flush_every) +
                                  " is not allowed: give a number >= 1.");
    }
  }

  /// The run folder (empty until the first run starts).
  const std::filesystem::path& log_dir() const { return log_dir_; }
  std::filesystem::path metrics_file() const { return log_dir_ / "metrics.csv"; }

  template <class T, class M>
  void setup(T& trainer, M&, Stage) {
    enabled_ = trainer.is_global_zero() && !trainer.fast_dev_run();
    if (!enabled_) return;
    if (log_dir_.empty()) {
      log_dir_ = detail::logger_dir(trainer, options_.save_dir, options_.name, options_.version, "CSVLogger");
    }
  }

  /// `hparams.yaml` beside the metrics.
  void log_hyperparams(const Json& params) {
    if (enabled_) detail::write_hparams_yaml(params, log_dir_, "CSVLogger");
  }

  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
    if (!enabled_) return;
    rows_.push_back({step, metrics});
    for (const auto& [key, value] : metrics) {
      if (!known_.count(key)) {
        known_.emplace(key, columns_.size());
        columns_.push_back(key);
        header_changed_ = true;
      }
    }
    if (static_cast<int64_t>(rows_.size() - written_) >= options_.flush_every) flush();
  }

  /// Writes rows not yet in the file (the Trainer calls it at the end of each run, failed ones included; see
  /// loggers/concept.hpp).
  void flush() {
    if (!enabled_ || log_dir_.empty() || written_ == rows_.size()) return;
    if (header_changed_) {
      out_.file.close();
      const std::filesystem::path tmp = log_dir_ / "metrics.csv.tmp";
      {
        std::ofstream f(tmp, std::ios::trunc);
        write_header(f);
        for (const auto& row : rows_) write_row(f, row);
        f.flush();
        if (!f) throw std::runtime_error("volt: CSVLogger could not write " + tmp.string());
      }
      std::filesystem::rename(tmp, metrics_file());
      header_changed_ = false;
    } else {
      std::ofstream& out = out_.file;
      if (!out.is_open()) out.open(metrics_file(), std::ios::app);
      for (std::size_t i = written_; i < rows_.size(); ++i) write_row(out, rows_[i]);
      out.flush();
      if (!out) {
        out.close();
        throw std::runtime_error("volt: CSVLogger could not append to " + metrics_file().string());
      }
    }
    written_ = rows_.size();
  }

 private:
  struct Row {
    int64_t step;
    std::map<std::string, double> values;
  };

  /// A name as Python's csv module writes one: quoted when it holds a comma, a quote or a line break (quotes
  /// doubled), as is otherwise.
  static std::string csv_field(const std::string& s) {
    if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
    std::string out = "\"";
    for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
    return out + "\"";
  }
  /// The shortest text that reads back to the same double, as Python's repr (what Lightning's CSVLogger writes).
  static std::string shortest(double v) {
    char buf[32];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
    return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
  }
  void write_header(std::ostream& f) const {
    for (const auto& c : columns_) f << csv_field(c) << ",";
    f << "step\n";
  }
  void write_row(std::ostream& f, const Row& row) const {
    for (const auto& c : columns_) {
      if (auto it = row.values.find(c); it != row.values.end()) f << shortest(it->second);
      f << ",";
    }
    f << row.step << "\n";
  }

  Options options_;
  bool enabled_ = false;
  std::filesystem::path log_dir_;
  std::vector<std::string> columns_;
  std::map<std::string, std::size_t> known_;
  std::vector<Row> rows_;
  std::size_t written_ = 0;
  bool header_changed_ = false;
  /// The file, open for appending between rewrites. A copied logger opens its own.
  struct AppendStream {
    std::ofstream file;
    AppendStream() = default;
    AppendStream(const AppendStream&) {}
    AppendStream(AppendStream&&) = default;
    AppendStream& operator=(const AppendStream&) { return *this; }
    AppendStream& operator=(AppendStream&&) = default;
  } out_;
};

}  // namespace volt
