#pragma once
/// \file
/// What a run's `Context::log` calls leave behind, as Lightning's `_ResultCollection`: `LogOptions` (the keywords of
/// one call), and the store of one loop run's values (the last step's value and the epoch's running reduction of
/// each name). The logger connector (connectors/logger_connector.hpp) publishes them to callback_metrics, the progress
/// bar and loggers; a checkpoint keeps the training epoch's sums (connectors/checkpoint_connector.hpp). Graph mode
/// redirects a captured step's calls to a `LogRecorder` and adds its values back after each replay.

#include "volt/reduce.hpp"

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace volt {

/// Options of one `Context::log` call; Lightning's `self.log` keywords.
struct LogOptions {
  /// Show in the progress bar.
  bool prog_bar = false;
  /// Send to loggers (volt/loggers/concept.hpp).
  bool logger = true;
  /// Keep the value of every step. Default: true in training steps and batch hooks, false elsewhere.
  std::optional<bool> on_step;
  /// Reduce over the epoch. Default: the opposite of the on_step default.
  std::optional<bool> on_epoch;
  /// How the epoch value is formed.
  Reduce reduce = Reduce::mean;
  /// Reduce the epoch value across ranks too.
  bool sync_dist = false;
  /// The weight of this value in the epoch mean; default: the first dimension of the batch's first tensor.
  std::optional<int64_t> batch_size;
  /// In a run over several loaders (`data::loaders`), name it `<name>/dataloader_idx_<i>` after the batch's loader.
  bool add_dataloader_idx = true;
};

namespace detail {

/// One logged name within one loop run (a training epoch, a validation run).
struct MetricEntry {
  std::string name;
  bool on_step = false, on_epoch = false, prog_bar = false, logger = true, sync_dist = false;
  Reduce reduce = Reduce::mean;
  torch::Tensor step_value;  // the last step's value, detached
  bool step_fresh = false;   // logged since the last publication
  torch::Tensor accumulated;  // mean: sum of value * weight; sum: sum; max/min: running extreme
  double weight = 0.0;        // mean: sum of batch sizes; others: number of values
  std::string step_key() const { return on_step && on_epoch ? name + "_step" : name; }
  std::string epoch_key() const { return on_step && on_epoch ? name + "_epoch" : name; }
};

/// One `Context::log` call as a captured training step made it (graph mode): its value is the graph's output,
/// which each replay overwrites.
struct LogCall {
  std::string name;
  torch::Tensor value;
  LogOptions options;
  bool on_step = false, on_epoch = false;
  int64_t batch_size = 1;
};

/// The log calls of one captured step, in call order. The first pass over the step that logs records them; a later
/// pass that runs the step's host code again (a graph type that re-runs it) updates their values, and must make the
/// same calls; a pass that runs no host code (a CUDA graph's replay) makes none.
class LogRecorder {
 public:
  /// Starts a pass over the step.
  void begin() { next_ = 0; }
  void take(std::string_view name, const torch::Tensor& value, const LogOptions& o, bool on_step, bool on_epoch,
            int64_t batch_size) {
    if (!closed_ && next_ == calls_.size()) {
      calls_.push_back(LogCall{std::string(name), value.detach(), o, on_step, on_epoch, batch_size});
    } else if (next_ < calls_.size() && calls_[next_].name == name) {
      calls_[next_].value = value.detach();
    } else {
      differs(name);
    }
    ++next_;
  }
  /// Ends a pass: the calls are fixed once a pass has made some.
  void end() {
    if (closed_ && next_ != 0 && next_ != calls_.size()) differs("");
    if (!calls_.empty()) closed_ = true;
  }
  const std::vector<LogCall>& calls() const { return calls_; }

 private:
  [[noreturn]] void differs(std::string_view name) const {
    throw std::logic_error("volt: Graphed: training_step made log calls (" +
                           (name.empty() ? std::to_string(next_) + " of them" : "\"" + std::string(name) + "\" as call " +
                                                                                    std::to_string(next_ + 1)) +
                           ") that differ from those of the step that was captured (" +
                           std::to_string(calls_.size()) + "); a captured step must log the same names in the same "
                           "order every time.");
  }
  std::vector<LogCall> calls_;
  std::size_t next_ = 0;
  bool closed_ = false;
};

/// The value an epoch reduction starts from: adding it (mean, sum), or taking the extreme with it (max, min),
/// changes nothing; a rank that has nothing of a name takes part in the reduction across ranks with it.
inline torch::Tensor reduction_identity(Reduce r, const torch::TensorOptions& options) {
  const double inf = std::numeric_limits<double>::infinity();
  return torch::scalar_tensor(r == Reduce::max ? -inf : r == Reduce::min ? inf : 0.0, options);
}

/// One rank's running epoch sums in a fit resumed on `world` ranks from the sums every rank of the saving run held
/// (`saved[r]`: rank r's entries). On the same number of ranks each rank takes up its own. On another number, rank
/// zero takes each name's reduction over the saved ranks (the sums and weights added, the extremes taken) and the
/// others its identity, so that a reduction across ranks at the epoch's end (`sync_dist`) sees every value the saving
/// run saw, once; a value logged without sync_dist, which each rank keeps for itself, then holds on rank zero what
/// every saving rank had. Every rank has every name, in the order of first appearance.
inline std::vector<MetricEntry> resumed_entries(const std::vector<std::vector<MetricEntry>>& saved, int rank,
                                                int world) {
  if (static_cast<int>(saved.size()) == world) return saved[static_cast<std::size_t>(rank)];
  std::vector<MetricEntry> out;
  for (const auto& entries : saved) {
    for (const MetricEntry& e : entries) {
      auto it = std::find_if(out.begin(), out.end(), [&](const MetricEntry& o) { return o.name == e.name; });
      if (it == out.end()) {
        out.push_back(e);
        out.back().accumulated = torch::Tensor();
        out.back().weight = 0.0;
        it = out.end() - 1;
      }
      if (rank != 0 || !e.accumulated.defined()) continue;
      const torch::Tensor& a = it->accumulated;
      if (!a.defined()) {
        it->accumulated = e.accumulated;
      } else if (e.reduce == Reduce::max) {
        it->accumulated = torch::maximum(a, e.accumulated);
      } else if (e.reduce == Reduce::min) {
        it->accumulated = torch::minimum(a, e.accumulated);
      } else {
        it->accumulated = a + e.accumulated;
      }
      it->weight += e.weight;
    }
  }
  for (MetricEntry& e : out) {
    if (e.on_epoch && !e.accumulated.defined()) e.accumulated = reduction_identity(e.reduce, torch::kFloat64);
  }
  return out;
}

/// The values logged during one loop run. Few names per run: a vector searched linearly beats a map.
/// Accumulation uses out-of-place ops only, so values computed under InferenceMode mix with normal ones.
class MetricStore {
 public:
  void clear() { entries_.clear(); }
  std::vector<MetricEntry>& entries() { return entries_; }
  /// While set, log calls go to `recorder` instead (a step being captured); null: back to this store.
  void redirect(LogRecorder* recorder) { recorder_ = recorder; }

  void add(std::string_view name, const torch::Tensor& value, const LogOptions& o, bool on_step, bool on_epoch,
           int64_t batch_size) {
    if (recorder_ != nullptr) {
      check_scalar(name, value);
      recorder_->take(name, value, o, on_step, on_epoch, batch_size);
      return;
    }
    MetricEntry* e = find(name);
    if (e == nullptr) {
      entries_.push_back(MetricEntry{std::string(name), on_step, on_epoch, o.prog_bar, o.logger, o.sync_dist,
                                     o.reduce, {}, false, {}, 0.0});
      e = &entries_.back();
    } else if (e->on_step != on_step || e->on_epoch != on_epoch || e->reduce != o.reduce) {
      throw std::invalid_argument("volt: \"" + std::string(name) +
                                  "\" was logged twice in one loop with different on_step/on_epoch/reduce options; "
                                  "log each name with one set of options.");
    }
    check_scalar(name, value);
    torch::Tensor v = value.detach().reshape({});
    if (on_step) {
      e->step_value = v;
      e->step_fresh = true;
    }
    if (on_epoch) {
      v = v.to(torch::kFloat64);
      const double w = e->reduce == Reduce::mean ? static_cast<double>(batch_size) : 1.0;
      if (!e->accumulated.defined()) {
        e->accumulated = e->reduce == Reduce::mean ? v * w : v;
      } else {
        switch (e->reduce) {
          case Reduce::mean: e->accumulated = e->accumulated + v * w; break;
          case Reduce::sum: e->accumulated = e->accumulated + v; break;
          case Reduce::max: e->accumulated = torch::maximum(e->accumulated, v); break;
          case Reduce::min: e->accumulated = torch::minimum(e->accumulated, v); break;
        }
      }
      e->weight += w;
    }
  }

 private:
  static void check_scalar(std::string_view name, const torch::Tensor& value) {
    if (value.numel() != 1) {
      throw std::invalid_argument("volt: log(\"" + std::string(name) + "\") needs a single value, got a tensor of " +
                                  std::to_string(value.numel()) + " elements; reduce it first (e.g. .mean()).");
    }
  }
  MetricEntry* find(std::string_view name) {
    for (auto& e : entries_)
      if (e.name == name) return &e;
    return nullptr;
  }
  std::vector<MetricEntry> entries_;
  LogRecorder* recorder_ = nullptr;
};

}  // namespace detail
}  // namespace volt
