#pragma once

#include "volt/callbacks/model_summary.hpp"
#include "volt/loggers/concept.hpp"
#include "volt/loggers/log_dir.hpp"
#include "volt/loggers/tensorboard_events.hpp"
#include "volt/stage.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <system_error>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace volt {

/// Writes every logged metric as a TensorBoard scalar at its step, into
/// `<save_dir>/<name>/version_<n>/events.out.tfevents.<time>.<host>.<pid>.<n>` on rank zero, as Lightning's
/// TensorBoardLogger (open it with `tensorboard --logdir volt_logs`). Beside the scalars: the hyper-parameters given in
/// `Options::hparams` (TensorBoard's HPARAMS tab, with `hparam_metrics` as its metric columns) and the model's
/// summary as text (TEXT tab), both when the first fit starts. The folder is the one a CSVLogger of the same Trainer
/// uses under the same save_dir and name (loggers/log_dir.hpp), so both can run side by side.
///
/// Values are TensorBoard's `simple_value`, a float: a double logged is read back as the float nearest to it, as
/// with PyTorch's `SummaryWriter.add_scalar`. Records are written whole: at most `max_queue` logging events wait in
/// memory, and the Trainer flushes at each epoch's end, after each validation, on a stop signal, when a run fails and
/// when it ends, so a killed run loses at most the events since the last of those. One file per logger object (a fit
/// and a later test append to the same one). Writes nothing under fast_dev_run. The format is in
/// loggers/tensorboard_events.hpp.
class TensorBoardLogger {
 public:
  static constexpr bool is_logger = true;

  struct Options {
    /// Base folder; empty: the Trainer's default_root_dir.
    std::string save_dir;
    std::string name = "volt_logs";
    /// Unset: the version another logger of this Trainer chose, else the next free version number.
    std::optional<int> version;
    /// Hyper-parameters shown in the HPARAMS tab: numbers, bools or strings (`{"lr", 1e-3}, {"optimizer", "adam"}`).
    /// Empty: the Trainer's (`save_hyperparameters`), flattened as Lightning's (`trainer/max_epochs`; null as "None",
    /// a list as its JSON text).
    std::map<std::string, tensorboard::HParam> hparams;
    /// Logged metrics the HPARAMS tab shows beside the hyper-parameters (`{"val_acc"}`).
    std::vector<std::string> hparam_metrics;
    /// Write the model's summary (volt::summarize) as text when the first fit starts.
    bool log_model_summary = true;
    /// Logging events kept in memory before they are written (and whenever the Trainer flushes).
    int64_t max_queue = 10;
  };

  TensorBoardLogger() : TensorBoardLogger(Options{}) {}
  explicit TensorBoardLogger(Options options) : options_(std::move(options)) {
    if (options_.max_queue < 1) {
      throw std::invalid_argument("volt: TensorBoardLogger max_queue=" + std::to_string(options_.max_queue) +
                                  " is not allowed: give a number >= 1.");
    }
  }

  /// The run folder (empty until the first run starts).
  const std::filesystem::path& log_dir() const { return log_dir_; }
  /// The event file (empty until the first run starts).
  const std::filesystem::path& event_file() const { return file_; }

  template <class T, class M>
  void setup(T& trainer, M& module, Stage stage) {
    enabled_ = trainer.is_global_zero() && !trainer.fast_dev_run();
    if (!enabled_) return;
    if (file_.empty()) {
      log_dir_ = detail::logger_dir(trainer, options_.save_dir, options_.name, options_.version, "TensorBoardLogger");
      file_ = log_dir_ / event_file_name();
      pending_ += tensorboard::record(tensorboard::file_version_event(now()));
      write_pending();  // the file exists from the start, so a reader finds the run
    }
    fitting_ = stage == Stage::train;
    step_ = trainer.global_step();
    if (fitting_ && !started_) {
      started_ = session_pending_ = true;
      if (options_.log_model_summary) add({tensorboard::text_value("model_summary", summarize(module).to_markdown())}, step_);
    }
  }

  /// `hparams.yaml` beside the events; at the first fit also the HPARAMS tab's experiment and session (Options::hparams,
  /// else these flattened).
  void log_hyperparams(const Json& params) {
    if (!enabled_) return;
    detail::write_hparams_yaml(params, log_dir_, "TensorBoardLogger");
    if (!session_pending_) return;
    session_pending_ = false;
    shown_hparams_ = options_.hparams;
    if (shown_hparams_.empty()) flatten(params, shown_hparams_);
    if (shown_hparams_.empty() && !options_.hparam_metrics.empty()) {
      throw std::invalid_argument("volt: TensorBoardLogger hparam_metrics are given without hparams: the HPARAMS tab "
                                  "shows metrics beside hyper-parameters; give Options::hparams, or the Trainer's "
                                  "(save_hyperparameters).");
    }
    if (!shown_hparams_.empty()) {
      add({tensorboard::hparams_experiment(shown_hparams_, options_.hparam_metrics)}, step_);
      add({tensorboard::hparams_session_start(shown_hparams_, now())}, step_);
    }
    flush();
  }

  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
    if (!enabled_) return;
    std::vector<tensorboard::Proto> values;
    for (const auto& [tag, value] : metrics) values.push_back(tensorboard::scalar_value(tag, value));
    add(values, step);
  }

  /// A fit's end closes its HPARAMS session, as a success or a failure; one stopped by a signal (to be resumed) stays
  /// open.
  void finalize(RunStatus status) {
    try {  // after a failure, the run's own error is the one to see: a failing write here must not replace it
      if (enabled_ && fitting_ && !shown_hparams_.empty() && status != RunStatus::interrupted) {
        add({tensorboard::hparams_session_end(status == RunStatus::finished, now())}, step_);
      }
      flush();
    } catch (const std::exception& e) {
      if (status == RunStatus::finished) throw;
      std::cerr << "volt: TensorBoardLogger could not write its last events: " << e.what() << "\n";
    }
  }

  /// Writes the events not yet in the file (the Trainer calls it; see loggers/concept.hpp).
  void flush() {
    if (enabled_ && !file_.empty() && !pending_.empty()) write_pending();
  }

 private:
  /// A JSON object's values as HPARAMS entries named by their path (`trainer/max_epochs`), as Lightning flattens them.
  static void flatten(const Json& j, std::map<std::string, tensorboard::HParam>& out) {
    detail::for_each_hparam(j, [&](const std::string& name, const Json& v) {
      if (v.is_boolean()) {
        out.insert_or_assign(name, tensorboard::HParam(v.get<bool>()));
      } else if (v.is_number()) {
        out.insert_or_assign(name, tensorboard::HParam(v.get<double>()));
      } else if (v.is_string()) {
        out.insert_or_assign(name, tensorboard::HParam(v.get<std::string>()));
      } else {
        out.insert_or_assign(name, tensorboard::HParam(v.is_null() ? std::string("None") : v.dump()));
      }
    });
  }
  static double now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
  /// `events.out.tfevents.<seconds>.<host>.<pid>.<n>`, as PyTorch's SummaryWriter names its files.
  static std::string event_file_name() {
    static std::atomic<int> counter{0};
    char host[256] = "localhost";
    ::gethostname(host, sizeof host - 1);
    char name[512];
    std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s.%d.%d", static_cast<long long>(now()), host,
                  static_cast<int>(::getpid()), counter++);
    return name;
  }
  void add(const std::vector<tensorboard::Proto>& values, int64_t step) {
    step_ = step;
    pending_ += tensorboard::record(tensorboard::event(now(), step, values));
    if (++queued_ >= options_.max_queue) flush();
  }
  /// Appends the pending records; a failed write is cut off again, so that a later flush does not follow a torn
  /// record (readers stop at one).
  void write_pending() {
    std::error_code ec;
    const auto size_before = std::filesystem::exists(file_, ec) ? std::filesystem::file_size(file_, ec) : 0;
    std::ofstream out(file_, std::ios::binary | std::ios::app);
    out.write(pending_.data(), static_cast<std::streamsize>(pending_.size()));
    out.flush();
    if (!out) {
      out.close();
      std::filesystem::resize_file(file_, size_before, ec);
      throw std::runtime_error("volt: TensorBoardLogger could not append to " + file_.string());
    }
    pending_.clear();
    queued_ = 0;
  }

  Options options_;
  bool enabled_ = false;
  /// The summary is written (once per logger, at the first fit), and the HPARAMS session is still to start.
  bool started_ = false;
  bool session_pending_ = false;
  /// The running run is a fit; the step of the latest events.
  bool fitting_ = false;
  int64_t step_ = 0;
  /// The HPARAMS tab's values: Options::hparams, or the Trainer's flattened.
  std::map<std::string, tensorboard::HParam> shown_hparams_;
  std::filesystem::path log_dir_;
  std::filesystem::path file_;
  /// Whole records not yet written, and how many logging events they hold.
  std::string pending_;
  int64_t queued_ = 0;
};

}  // namespace volt
