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
#include <stdexcept>
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
      const torch::Tensor v = e.sync_dist ? collectives.sync_all_reduce(e.step_value, e.reduce) : e.step_value;
      set(key, v, e.prog_bar, e.logger);
      if (e.logger && for_loggers) pending_[key] = v;
    }
  }

  /// At an epoch's end: every on_epoch value reduced over the epoch (and across ranks when asked); those for
  /// loggers also go into `to_log` when given. Safe to call more than once: later calls add what epoch-end
  /// hooks logged since. Every rank calls it. Across ranks they first agree on the names each logged: a rank that has
  /// no value of a sync_dist name (no batch of a small loader) takes part with an empty sum, and one that has none of
  /// a name logged without sync_dist shows the first rank's value that has one, so that callbacks monitoring it
  /// (ModelCheckpoint, EarlyStopping) decide together.
  void publish_epoch(MetricStore& store, Collectives& collectives, MetricMap* to_log, const torch::Device& device) {
    std::vector<AgreedName> agreed;
    if (collectives.world_size() > 1) {
      agreed = agree_on_names(store, collectives);
      put_synced_first(store, agreed, device);
    }
    for (auto& e : store.entries()) {
      if (!e.on_epoch || (!e.sync_dist && e.weight == 0.0)) continue;
      torch::Tensor acc = e.accumulated.defined() ? e.accumulated : reduction_identity(e.reduce, torch::kFloat64);
      torch::Tensor weight = torch::scalar_tensor(e.weight, acc.options());
      if (e.sync_dist) {  // a weighted mean: sum the weighted values and the weights across ranks
        acc = collectives.sync_all_reduce(acc, e.reduce == Reduce::mean ? Reduce::sum : e.reduce);
        weight = collectives.sync_all_reduce(weight, Reduce::sum);
        if (weight.template item<double>() == 0.0) continue;  // no rank has a value yet
      }
      publish(e.reduce == Reduce::mean ? acc / weight : acc, e, to_log);
    }
    borrow_unsynced(agreed, collectives, to_log, device);
  }

  /// A value from outside a module step (a callback's measurement).
  void record(const std::string& name, const torch::Tensor& v, bool prog_bar, bool logger) {
    set(name, v, prog_bar, logger);
  }

 private:
  /// A name some rank logged on_epoch, as every rank learns it at an epoch's end: its options, and which ranks hold
  /// values of it.
  struct AgreedName {
    MetricEntry entry;
    std::vector<bool> held;
  };

  /// Every rank's on_epoch names (with values, or sync_dist ones) gathered on every rank, in rank order of first
  /// appearance. A name logged with other options on one rank than on another is an error on every rank.
  static std::vector<AgreedName> agree_on_names(MetricStore& store, Collectives& collectives) {
    std::string mine;  // per name: reduce, on_step, prog_bar, logger, sync_dist, then the name and '\0'
    for (const auto& e : store.entries()) {
      if (!e.on_epoch || (!e.sync_dist && e.weight == 0.0)) continue;
      mine += static_cast<char>('0' + static_cast<int>(e.reduce));
      for (bool f : {e.on_step, e.prog_bar, e.logger, e.sync_dist}) mine += f ? '1' : '0';
      mine += e.name;
      mine += '\0';
    }
    const std::vector<std::string> all = collectives.host_all_gather(mine);
    std::vector<AgreedName> agreed;
    for (std::size_t rank = 0; rank < all.size(); ++rank) {
      const std::string& theirs = all[rank];
      for (std::size_t at = 0; at < theirs.size();) {
        const std::size_t end = theirs.find('\0', at);
        MetricEntry e{theirs.substr(at + 5, end - at - 5), theirs[at + 1] == '1', true, theirs[at + 2] == '1',
                      theirs[at + 3] == '1', theirs[at + 4] == '1', static_cast<Reduce>(theirs[at] - '0'), {}, false,
                      {}, 0.0};
        auto it = std::find_if(agreed.begin(), agreed.end(),
                               [&](const AgreedName& a) { return a.entry.name == e.name; });
        if (it == agreed.end()) {
          agreed.push_back({e, std::vector<bool>(all.size(), false)});
          it = agreed.end() - 1;
        } else if (it->entry.sync_dist != e.sync_dist || it->entry.reduce != e.reduce ||
                   it->entry.on_step != e.on_step) {
          throw std::logic_error("volt: \"" + e.name + "\" was logged with other options (sync_dist, reduce or "
                                 "on_step) on rank " + std::to_string(rank) + " than on a rank before it; log each "
                                 "name the same way on every rank, so that the ranks reduce it together.");
        }
        it->held[rank] = true;
        at = end + 1;
      }
    }
    return agreed;
  }

  /// Every sync_dist name in the agreed order ahead of this rank's other names, as an empty sum where it has none, so
  /// that every rank's reductions come in one order.
  static void put_synced_first(MetricStore& store, const std::vector<AgreedName>& agreed, const torch::Device& device) {
    std::vector<MetricEntry> ordered;
    for (const AgreedName& a : agreed) {
      if (!a.entry.sync_dist) continue;
      auto it = std::find_if(store.entries().begin(), store.entries().end(),
                             [&](const MetricEntry& e) { return e.name == a.entry.name; });
      if (it != store.entries().end()) {
        ordered.push_back(std::move(*it));
        store.entries().erase(it);
      } else {
        ordered.push_back(a.entry);
        ordered.back().accumulated =
            reduction_identity(a.entry.reduce, torch::TensorOptions(torch::kFloat64).device(device));
      }
    }
    for (auto& e : store.entries()) ordered.push_back(std::move(e));
    store.entries() = std::move(ordered);
  }

  /// The names logged without sync_dist that some rank has no value of: the first rank's value that has one,
  /// broadcast (every rank takes part, in the agreed order), published where it was missing.
  void borrow_unsynced(const std::vector<AgreedName>& agreed, Collectives& collectives, MetricMap* to_log,
                       const torch::Device& device) {
    const auto me = static_cast<std::size_t>(collectives.global_rank());
    for (const AgreedName& a : agreed) {
      if (a.entry.sync_dist || std::all_of(a.held.begin(), a.held.end(), [](bool h) { return h; })) continue;
      const auto owner = static_cast<std::size_t>(std::find(a.held.begin(), a.held.end(), true) - a.held.begin());
      torch::Tensor v = me == owner ? callback_metrics_.at(a.entry.epoch_key()).clone()
                                    : torch::zeros({}, torch::TensorOptions(torch::kFloat64).device(device));
      collectives.broadcast_(v, static_cast<int>(owner));
      if (!a.held[me]) publish(v, a.entry, to_log);
    }
  }

  void publish(const torch::Tensor& v, const MetricEntry& e, MetricMap* to_log) {
    const std::string key = e.epoch_key();
    set(key, v, e.prog_bar, e.logger);
    if (e.logger && to_log != nullptr) (*to_log)[key] = v;
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
