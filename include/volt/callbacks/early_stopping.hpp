#pragma once

#include "volt/callbacks/concept.hpp"
#include "volt/stage.hpp"

#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace volt {

/// Stops training when a monitored metric stops improving, as Lightning's EarlyStopping: after
/// `patience` checks without an improvement of more than `min_delta`, when the value is not finite
/// (`check_finite`), when it reaches `stopping_threshold`, or when it passes `divergence_threshold`.
/// Checks after each validation run, or at the end of each training epoch when the fit has no validation
/// (or `check_on_train_epoch_end` says so). The decision is reduced across ranks, so all agree.
class EarlyStopping {
 public:
  using Mode = volt::Mode;
  struct Options {
    std::string monitor;
    Mode mode = Mode::min;
    int64_t patience = 3;
    double min_delta = 0.0;
    bool check_finite = true;
    std::optional<double> stopping_threshold;
    std::optional<double> divergence_threshold;
    /// A missing monitored metric is an error (true) or skips the check (false).
    bool strict = true;
    bool verbose = false;
    std::optional<bool> check_on_train_epoch_end;
  };

  /// Runs after the module's epoch-end hook, so it sees what that hook logged.
  static constexpr bool monitors_metrics = true;

  /// There is nothing to watch without a monitor: `EarlyStopping{}` is said at compile time, with the fix.
  template <class Never = void>
  EarlyStopping() {
    static_assert(!std::is_same_v<Never, Never>,
                  "volt: give EarlyStopping the metric to watch, as EarlyStopping({.monitor = \"val_loss\"}) (with "
                  ".mode = EarlyStopping::Mode::max for accuracies): it has no default.");
  }
  explicit EarlyStopping(Options options) : options_(std::move(options)) {
    if (options_.monitor.empty()) {
      throw std::invalid_argument("volt: EarlyStopping needs a metric to monitor (Options::monitor is empty).");
    }
    if (options_.patience < 0) {
      throw std::invalid_argument("volt: EarlyStopping patience=" + std::to_string(options_.patience) +
                                  " is not allowed: give a number >= 0.");
    }
    if (options_.min_delta < 0.0) {
      throw std::invalid_argument("volt: EarlyStopping min_delta=" + std::to_string(options_.min_delta) +
                                  " is not allowed: give a value >= 0 (an improvement must exceed it).");
    }
    best_score_ = options_.mode == Mode::min ? std::numeric_limits<double>::infinity()
                                             : -std::numeric_limits<double>::infinity();
  }

  template <class T, class M>
  void on_validation_end(T& trainer, M&) {
    if (trainer.sanity_checking() || trainer.stage() != Stage::validate || checks_on_train_epoch_end(trainer)) return;
    check(trainer);
  }
  template <class T, class M>
  void on_train_epoch_end(T& trainer, M&) {
    if (checks_on_train_epoch_end(trainer)) check(trainer);
  }

  int64_t wait_count() const { return wait_count_; }
  double best_score() const { return best_score_; }
  /// The epoch in which it stopped training (-1: it did not).
  int64_t stopped_epoch() const { return stopped_epoch_; }
  const std::string& stop_reason() const { return reason_; }

  std::map<std::string, double> state_dict() const {
    return {{"wait_count", static_cast<double>(wait_count_)},
            {"stopped_epoch", static_cast<double>(stopped_epoch_)},
            {"best_score", best_score_},
            {"patience", static_cast<double>(options_.patience)}};
  }
  void load_state_dict(const std::map<std::string, double>& state) {
    for (const char* key : {"wait_count", "stopped_epoch", "best_score"}) {
      if (!state.count(key)) {
        throw std::invalid_argument(std::string("volt: EarlyStopping state has no \"") + key +
                                    "\"; it was not saved by EarlyStopping.");
      }
    }
    wait_count_ = static_cast<int64_t>(state.at("wait_count"));
    stopped_epoch_ = static_cast<int64_t>(state.at("stopped_epoch"));
    best_score_ = state.at("best_score");
  }

 private:
  template <class T>
  bool checks_on_train_epoch_end(const T& trainer) const {
    return options_.check_on_train_epoch_end.value_or(!trainer.has_validation());
  }

  bool improved(double current) const {
    return options_.mode == Mode::min ? current < best_score_ - options_.min_delta
                                      : current > best_score_ + options_.min_delta;
  }

  template <class T>
  void check(T& trainer) {
    if (trainer.fast_dev_run()) return;
    const auto& metrics = trainer.callback_metrics();
    auto it = metrics.find(options_.monitor);
    if (it == metrics.end()) {
      if (!options_.strict) return;
      std::ostringstream s;
      s << "volt: EarlyStopping monitors \"" << options_.monitor << "\", which was not logged. Logged:";
      for (const auto& [k, v] : metrics) s << " " << k;
      s << ". Log it with ctx.log(\"" << options_.monitor << "\", ...) or pass strict=false.";
      throw std::runtime_error(s.str());
    }
    const double current = it->second.template item<double>();
    bool stop = false;
    std::ostringstream why;
    const bool beyond_divergence =
        options_.divergence_threshold &&
        (options_.mode == Mode::min ? current > *options_.divergence_threshold : current < *options_.divergence_threshold);
    const bool reached_threshold =
        options_.stopping_threshold &&
        (options_.mode == Mode::min ? current < *options_.stopping_threshold : current > *options_.stopping_threshold);
    if (options_.check_finite && !std::isfinite(current)) {
      stop = true;
      why << options_.monitor << "=" << current << " is not finite; previous best " << best_score_ << ".";
    } else if (reached_threshold) {
      stop = true;
      why << options_.monitor << "=" << current << " reached the stopping threshold " << *options_.stopping_threshold << ".";
    } else if (beyond_divergence) {
      stop = true;
      why << options_.monitor << "=" << current << " is beyond the divergence threshold " << *options_.divergence_threshold << ".";
    } else if (improved(current)) {
      best_score_ = current;
      wait_count_ = 0;
    } else if (++wait_count_ >= options_.patience) {
      stop = true;
      why << options_.monitor << " did not improve in the last " << wait_count_ << " checks; best " << best_score_ << ".";
    }
    stop = trainer.strategy().reduce_boolean_decision(stop, /*all=*/false);
    if (stop) {
      trainer.request_stop();
      stopped_epoch_ = trainer.current_epoch();
      reason_ = why.str();
      if (options_.verbose && trainer.is_global_zero()) std::cout << "EarlyStopping: " << reason_ << "\n";
    }
  }

  Options options_;
  int64_t wait_count_ = 0;
  int64_t stopped_epoch_ = -1;
  double best_score_;
  std::string reason_;
};

}  // namespace volt
