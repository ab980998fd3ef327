#pragma once
/// \file
/// `volt::Context`: what a module's steps and hooks are handed. It says where the run is (stage, epoch,
/// step, batch, rank, device) and takes the values the module logs, as Lightning's `self.log`:
/// \code
///   torch::Tensor training_step(const Batch& batch, volt::Context& ctx) {
///     auto loss = torch::nn::functional::cross_entropy(forward(batch.data), batch.target);
///     ctx.log("train_loss", loss, {.prog_bar = true});
///     return loss;
///   }
/// \endcode
/// A Context is not tied to the Trainer's type, so modules stay plain classes.

#include <c10/util/Type.h>
#include <torch/types.h>

#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace volt {

/// Which loop is running. `sanity_check` is the short validation run before training.
enum class Stage { train, sanity_check, validate, test, predict };

inline const char* to_string(Stage s) {
  switch (s) {
    case Stage::train: return "train";
    case Stage::sanity_check: return "sanity_check";
    case Stage::validate: return "validate";
    case Stage::test: return "test";
    case Stage::predict: return "predict";
  }
  return "?";
}

/// How a logged value is reduced over an epoch (and across ranks when `sync_dist` is set).
/// `mean` is weighted by batch size, as Lightning's default.
enum class Reduce { mean, sum, max, min };

/// Options of one `Context::log` call; Lightning's `self.log` keywords.
struct LogOptions {
  /// Show in the progress bar.
  bool prog_bar = false;
  /// Send to loggers (CSVLogger and any callback with `on_log_metrics`).
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

/// The strategy's collectives, as a module sees them through its Context (not tied to the strategy's type).
struct Collectives {
  virtual ~Collectives() = default;
  virtual torch::Tensor all_reduce(const torch::Tensor& t, Reduce op) = 0;
  virtual torch::Tensor all_gather(const torch::Tensor& t) = 0;
  virtual void broadcast_(const torch::Tensor& t, int root) = 0;
  virtual void barrier() = 0;
};

/// Collectives of a strategy `S` (every strategy has the four: strategies/concept.hpp).
template <class S>
class StrategyCollectives final : public Collectives {
 public:
  explicit StrategyCollectives(S* strategy) : s_(strategy) {}
  torch::Tensor all_reduce(const torch::Tensor& t, Reduce op) override { return s_->all_reduce(t, op); }
  torch::Tensor all_gather(const torch::Tensor& t) override { return s_->all_gather(t); }
  void broadcast_(const torch::Tensor& t, int root) override { s_->broadcast_(t, root); }
  void barrier() override { s_->barrier(); }

 private:
  S* s_;
};

/// Where the loops stand; the Trainer owns it and every Context points at it.
struct LoopState {
  Stage stage = Stage::train;
  int64_t current_epoch = 0;
  int64_t global_step = 0;
  int64_t batch_idx = 0;
  bool in_batch = false;  // inside a step or batch hook (decides the on_step default)
  int global_rank = 0;
  int world_size = 1;
  torch::Device device = torch::kCPU;
  const void* batch = nullptr;                        // the current batch, for batch-size inference
  int64_t (*batch_size_of)(const void*) = nullptr;  // typed by the loop that set `batch`; -1: cannot tell
  const std::type_info* batch_type = nullptr;        // for messages
  Collectives* collectives = nullptr;                // the strategy's, set when a run starts
};

}  // namespace detail

/// An exception thrown by a module's step, with where it was thrown: the step, the stage, the epoch, the batch
/// and the rank (`volt: training_step failed in epoch 2, batch 17 (global step 81): Target 10 is out of bounds.`).
/// The original exception is nested in it (`std::rethrow_if_nested` gives it back).
class StepError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

/// Runs a module's step `f`; an exception from it comes out as a StepError that says where, with the original
/// nested (`step`: "training_step", ...).
template <class F>
decltype(auto) run_module_step(const LoopState& state, const char* step, F&& f) {
  try {
    return f();
  } catch (const StepError&) {
    throw;  // already says where
  } catch (const std::exception& e) {
    std::string where = std::string("volt: ") + step + " failed in ";
    if (state.stage == Stage::train) {
      where += "epoch " + std::to_string(state.current_epoch) + ", batch " + std::to_string(state.batch_idx) +
               " (global step " + std::to_string(state.global_step) + ")";
    } else {
      where += std::string(to_string(state.stage)) + " batch " + std::to_string(state.batch_idx);
      if (state.stage == Stage::validate || state.stage == Stage::sanity_check) {
        where += " (training epoch " + std::to_string(state.current_epoch) + ")";
      }
    }
    if (state.world_size > 1) where += " on rank " + std::to_string(state.global_rank);
    std::throw_with_nested(StepError(where + ": " + e.what()));
  }
}

}  // namespace detail

/// Handed to every step and hook of a module.
class Context {
 public:
  Context(detail::LoopState& state, detail::MetricStore& store) : state_(&state), store_(&store) {}

  Stage stage() const { return state_->stage; }
  int64_t current_epoch() const { return state_->current_epoch; }
  /// Optimizer steps taken so far (as Lightning's `global_step`).
  int64_t global_step() const { return state_->global_step; }
  int64_t batch_idx() const { return state_->batch_idx; }
  int global_rank() const { return state_->global_rank; }
  int world_size() const { return state_->world_size; }
  bool is_global_zero() const { return state_->global_rank == 0; }
  /// The device batches are moved to.
  torch::Device device() const { return state_->device; }

  /// Collectives across the ranks of the run (identities in a world of one). Every rank must call them in
  /// the same order. `all_reduce` returns a reduced copy (mean divides by the world size); `all_gather`
  /// stacks every rank's tensor along a new first dimension; `broadcast_` copies rank `root`'s tensor in place.
  /// They are not differentiable: wrap them in an autograd Function to use them inside a graph.
  torch::Tensor all_reduce(const torch::Tensor& t, Reduce op = Reduce::sum) {
    return state_->collectives ? state_->collectives->all_reduce(t, op) : t.detach().clone();
  }
  torch::Tensor all_gather(const torch::Tensor& t) {
    return state_->collectives ? state_->collectives->all_gather(t) : t.detach().unsqueeze(0).clone();
  }
  void broadcast_(const torch::Tensor& t, int root = 0) {
    if (state_->collectives) state_->collectives->broadcast_(t, root);
  }
  void barrier() {
    if (state_->collectives) state_->collectives->barrier();
  }

  /// Records a scalar under `name` (see LogOptions for where it goes and how it is reduced).
  void log(std::string_view name, const torch::Tensor& value, const LogOptions& options = {}) {
    if (state_->stage == Stage::predict) {
      throw std::logic_error("volt: log(\"" + std::string(name) + "\") was called while predicting; predict logs nothing.");
    }
    const bool step_default = state_->in_batch && state_->stage == Stage::train;
    const bool on_step = options.on_step.value_or(step_default);
    const bool on_epoch = options.on_epoch.value_or(!step_default);
    if (!on_step && !on_epoch) {
      throw std::invalid_argument("volt: log(\"" + std::string(name) +
                                  "\") with on_step=false and on_epoch=false would record nothing; set one of them.");
    }
    if (on_step && !state_->in_batch) {
      throw std::invalid_argument("volt: log(\"" + std::string(name) +
                                  "\", on_step=true) outside a step or batch hook; epoch-level hooks log with on_epoch.");
    }
    int64_t batch_size = 1;
    if (on_epoch && options.reduce == Reduce::mean) {
      if (options.batch_size) {
        batch_size = *options.batch_size;
      } else if (state_->batch != nullptr) {
        batch_size = state_->batch_size_of(state_->batch);
        if (batch_size < 0) {
          throw std::invalid_argument(
              "volt: log(\"" + std::string(name) + "\") averages over the epoch weighted by batch size, but volt "
              "cannot look inside the batch type " + c10::demangle(state_->batch_type->name()) +
              " to find its size. Pass the size, log(name, value, {.batch_size = n}), or specialise "
              "volt::BatchTraits for that type (see volt/batch.hpp).");
        }
      }
    }
    store_->add(name, value, options, on_step, on_epoch, batch_size);
  }
  void log(std::string_view name, double value, const LogOptions& options = {}) {
    log(name, torch::scalar_tensor(value, torch::kFloat64), options);
  }

 private:
  detail::LoopState* state_;
  detail::MetricStore* store_;
};

}  // namespace volt
