#pragma once
/// \file
/// Metric publishing, as Lightning's logger connector: what modules log into a `MetricStore` during a loop
/// becomes, after each batch and at each epoch's end, the three views the Trainer offers —
/// `callback_metrics` (every latest value, for callbacks), `progress_bar_metrics` (`prog_bar`) and
/// `logged_metrics` (`logger`) — and the values due to loggers. It never sees the Trainer's type: reductions
/// across ranks go through the run's `Collectives`.

#include "volt/context.hpp"

#include <torch/types.h>

#include <map>
#include <string>

namespace volt::detail {

/// Metric values by name.
using MetricMap = std::map<std::string, torch::Tensor>;

/// The values as numbers (reads device values).
inline std::map<std::string, double> to_doubles(const MetricMap& m) {
  std::map<std::string, double> out;
  for (const auto& [k, v] : m) out.emplace(k, v.template item<double>());
  return out;
}

class LoggerConnector {
 public:
  const MetricMap& callback_metrics() const { return callback_metrics_; }
  const MetricMap& progress_bar_metrics() const { return progress_bar_metrics_; }
  const MetricMap& logged_metrics() const { return logged_metrics_; }
  /// Step values waiting for the next logging step (log_every_n_steps).
  MetricMap& pending() { return pending_; }

  /// Forgets every value (a new run starts).
  void clear() {
    callback_metrics_.clear();
    progress_bar_metrics_.clear();
    logged_metrics_.clear();
  }

  /// After a batch: fresh step values become visible; those for loggers also wait in `pending()` when
  /// `for_loggers` (some callback writes logs).
  void publish_step(MetricStore& store, Collectives& collectives, bool for_loggers) {
    for (auto& e : store.entries()) {
      if (!e.step_fresh) continue;
      e.step_fresh = false;
      const std::string key = e.step_key();
      const torch::Tensor v = e.sync_dist ? collectives.all_reduce(e.step_value, e.reduce) : e.step_value;
      set(key, v, e.prog_bar, e.logger);
      if (e.logger && for_loggers) pending_[key] = v;
    }
  }

  /// At an epoch's end: every on_epoch value reduced over the epoch (and across ranks when asked); those for
  /// loggers also go into `to_log` when given. Safe to call more than once: later calls add what epoch-end
  /// hooks logged since.
  void publish_epoch(MetricStore& store, Collectives& collectives, MetricMap* to_log) {
    for (auto& e : store.entries()) {
      if (!e.on_epoch || e.weight == 0.0) continue;
      torch::Tensor acc = e.accumulated;
      torch::Tensor weight = torch::scalar_tensor(e.weight, acc.options());
      if (e.sync_dist) {  // a weighted mean: sum the weighted values and the weights across ranks
        acc = collectives.all_reduce(acc, e.reduce == Reduce::mean ? Reduce::sum : e.reduce);
        if (e.reduce == Reduce::mean) weight = collectives.all_reduce(weight, Reduce::sum);
      }
      const torch::Tensor v = e.reduce == Reduce::mean ? acc / weight : acc;
      const std::string key = e.epoch_key();
      set(key, v, e.prog_bar, e.logger);
      if (e.logger && to_log != nullptr) (*to_log)[key] = v;
    }
  }

  /// A value from outside a module step (a callback's measurement).
  void record(const std::string& name, const torch::Tensor& v, bool prog_bar, bool logger) {
    set(name, v, prog_bar, logger);
  }

 private:
  void set(const std::string& key, const torch::Tensor& v, bool prog_bar, bool logger) {
    callback_metrics_[key] = v;
    if (prog_bar) progress_bar_metrics_[key] = v;
    if (logger) logged_metrics_[key] = v;
  }

  MetricMap callback_metrics_;
  MetricMap progress_bar_metrics_;
  MetricMap logged_metrics_;
  MetricMap pending_;
};

}  // namespace volt::detail
