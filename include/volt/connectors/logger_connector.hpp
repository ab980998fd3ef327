#pragma once
/// \file
/// Metric publishing, as Lightning's logger connector: what modules log into a `MetricStore` during a loop
/// becomes, after each batch and at each epoch's end, the three views the Trainer offers —
/// `callback_metrics` (every latest value, for callbacks), `progress_bar_metrics` (`prog_bar`) and
/// `logged_metrics` (`logger`) — and the values due to loggers. It never sees the Trainer's type: reductions
/// across ranks go through the run's `Collectives`.

#include "volt/context.hpp"

#include <torch/types.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

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
  /// hooks logged since. Every rank calls it: the ranks first agree on the names logged with sync_dist, so that a
  /// rank that logged some of them, or none (no batch of a small loader), takes part with an empty sum.
  void publish_epoch(MetricStore& store, Collectives& collectives, MetricMap* to_log, const torch::Device& device) {
    if (collectives.world_size() > 1) agree_on_synced(store, collectives, device);
    for (auto& e : store.entries()) {
      if (!e.on_epoch || (!e.sync_dist && e.weight == 0.0)) continue;
      torch::Tensor acc = e.accumulated.defined() ? e.accumulated : reduction_identity(e.reduce, torch::kFloat64);
      torch::Tensor weight = torch::scalar_tensor(e.weight, acc.options());
      if (e.sync_dist) {  // a weighted mean: sum the weighted values and the weights across ranks
        acc = collectives.all_reduce(acc, e.reduce == Reduce::mean ? Reduce::sum : e.reduce);
        weight = collectives.all_reduce(weight, Reduce::sum);
        if (weight.template item<double>() == 0.0) continue;  // no rank has a value yet
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
  /// Every rank ends with every name some rank logged with sync_dist and on_epoch (an empty sum where it has none),
  /// those names in the same order (rank zero's first, then each other rank's new ones) ahead of its own others.
  static void agree_on_synced(MetricStore& store, Collectives& collectives, const torch::Device& device) {
    std::string mine;  // per name: its options, then the name, each entry ending in '\0'
    for (const auto& e : store.entries()) {
      if (!e.sync_dist || !e.on_epoch) continue;
      mine += static_cast<char>('0' + static_cast<int>(e.reduce));
      for (bool f : {e.on_step, e.prog_bar, e.logger}) mine += f ? '1' : '0';
      mine += e.name;
      mine += '\0';
    }
    std::vector<MetricEntry> agreed;
    for (const std::string& theirs : collectives.host_all_gather(mine)) {
      for (std::size_t at = 0; at < theirs.size();) {
        const std::size_t end = theirs.find('\0', at);
        const std::string name = theirs.substr(at + 4, end - at - 4);
        if (std::none_of(agreed.begin(), agreed.end(), [&](const MetricEntry& e) { return e.name == name; })) {
          MetricEntry e{name, theirs[at + 1] == '1', true, theirs[at + 2] == '1', theirs[at + 3] == '1', true,
                        static_cast<Reduce>(theirs[at] - '0'), {}, false, {}, 0.0};
          e.accumulated = reduction_identity(e.reduce, torch::TensorOptions(torch::kFloat64).device(device));
          agreed.push_back(std::move(e));
        }
        at = end + 1;
      }
    }
    for (auto& e : store.entries()) {
      auto it = std::find_if(agreed.begin(), agreed.end(), [&](const MetricEntry& a) { return a.name == e.name; });
      if (it != agreed.end()) {
        *it = std::move(e);
      } else {
        agreed.push_back(std::move(e));
      }
    }
    store.entries() = std::move(agreed);
  }

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
