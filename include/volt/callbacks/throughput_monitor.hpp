#pragma once

#include "volt/batch.hpp"
#include "volt/callbacks/concept.hpp"

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

namespace volt {

/// Measures training throughput, as Lightning's ThroughputMonitor: over a sliding window of the last `window_size`
/// training batches, this rank's batches and samples per second (and FLOP/s when `flops_per_batch` is given), recorded
/// for the loggers at every logging step (`log_every_n_steps`). Only training time counts: the clock starts when
/// training starts and stops while validation runs (data loading between batches counts, as in Lightning).
///
/// Recorded (Lightning's names under `train/`): `train/time` (training seconds so far), `train/batches`,
/// `train/samples`, `train/device/batches_per_sec`, `train/device/samples_per_sec`, `train/device/flops_per_sec`, and
/// the whole job's `train/batches_per_sec`, `train/samples_per_sec`, `train/flops_per_sec` (the device's times the
/// world size, as Lightning estimates them). A batch's samples are its first tensor's first dimension (the size
/// Lightning infers); for a batch type volt cannot look into, samples are not counted and only batches are reported.
/// Rates need two batches in the window; they count from the fit's start (a resumed fit starts a new measurement).
class ThroughputMonitor {
 public:
  struct Options {
    /// Floating-point operations of one training batch on one device (forward and backward); 0: no FLOP/s.
    double flops_per_batch = 0.0;
    /// Batches the rates are measured over.
    int64_t window_size = 100;
  };
  ThroughputMonitor() = default;
  explicit ThroughputMonitor(Options options) : options_(options) {
    if (options_.window_size < 2) {
      throw std::invalid_argument("volt: ThroughputMonitor window_size=" + std::to_string(options_.window_size) +
                                  " is not allowed: a rate needs at least 2 batches; give a number >= 2.");
    }
    if (!(options_.flops_per_batch >= 0.0)) {
      throw std::invalid_argument("volt: ThroughputMonitor flops_per_batch=" + std::to_string(options_.flops_per_batch) +
                                  " is not allowed: give the FLOPs of one batch (>= 0; 0 reports no FLOP/s).");
    }
  }

  template <class T, class M>
  void on_train_start(T&, M&) {
    start_ = Clock::now();
    paused_ = Duration::zero();
    batches_ = samples_ = 0;
    window_.clear();
  }
  template <class T, class M>
  void on_validation_start(T& trainer, M&) {
    if (!trainer.sanity_checking()) validation_start_ = Clock::now();
  }
  template <class T, class M>
  void on_validation_end(T& trainer, M&) {
    if (!trainer.sanity_checking() && validation_start_) {
      paused_ += Clock::now() - *validation_start_;
      validation_start_.reset();
    }
  }

  template <class T, class M, class L, class B>
  void on_train_batch_end(T& trainer, M&, const L&, const B& batch, int64_t) {
    ++batches_;
    if constexpr (MappableBatch<B>) samples_ += infer_batch_size(batch);
    const double t = training_seconds();
    window_.push_back({t, batches_, samples_});
    if (static_cast<int64_t>(window_.size()) > options_.window_size) window_.pop_front();
    if (trainer.logs_this_batch()) record(trainer, t);
  }

  /// Training seconds so far (validation excluded).
  double training_seconds() const { return std::chrono::duration<double>(Clock::now() - start_ - paused_).count(); }

 private:
  using Clock = std::chrono::steady_clock;
  using Duration = Clock::duration;
  struct Point {
    double time;
    int64_t batches, samples;
  };

  template <class T>
  void record(T& trainer, double t) {
    const double world = static_cast<double>(trainer.strategy().world_size());
    std::map<std::string, double> values{{"train/time", t}, {"train/batches", static_cast<double>(batches_)}};
    if (samples_ > 0) values["train/samples"] = static_cast<double>(samples_);
    const Point& first = window_.front();
    const Point& last = window_.back();
    if (const double span = last.time - first.time; window_.size() >= 2 && span > 0.0) {
      const double batches_per_sec = static_cast<double>(last.batches - first.batches) / span;
      values["train/device/batches_per_sec"] = batches_per_sec;
      values["train/batches_per_sec"] = batches_per_sec * world;
      if (last.samples > 0) {
        const double samples_per_sec = static_cast<double>(last.samples - first.samples) / span;
        values["train/device/samples_per_sec"] = samples_per_sec;
        values["train/samples_per_sec"] = samples_per_sec * world;
      }
      if (options_.flops_per_batch > 0.0) {
        values["train/device/flops_per_sec"] = batches_per_sec * options_.flops_per_batch;
        values["train/flops_per_sec"] = batches_per_sec * options_.flops_per_batch * world;
      }
    }
    trainer.record_metrics(values);
  }

  Options options_;
  Clock::time_point start_ = Clock::now();
  Duration paused_ = Duration::zero();
  std::optional<Clock::time_point> validation_start_;
  int64_t batches_ = 0, samples_ = 0;
  std::deque<Point> window_;
};

}  // namespace volt
