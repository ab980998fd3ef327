#pragma once
/// \file
/// The fit loop's progress counters, one object with its own state dict (the checkpoint's `loops` entry), and
/// the point a checkpoint resumes from. The epoch and the optimizer step live in `detail::LoopState`, where
/// modules read them through their Context; everything else the fit loop counts is here.

#include "volt/checkpoint.hpp"

#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace volt::detail {

/// Keys of the checkpoint's `loops` entry.
namespace loop_keys {
inline constexpr const char* epoch = "epoch";
inline constexpr const char* global_step = "global_step";
inline constexpr const char* batch_in_epoch = "batch_in_epoch";
inline constexpr const char* total_batch_idx = "total_batch_idx";
inline constexpr const char* epoch_finished = "epoch_finished";
inline constexpr const char* val_pending = "val_pending";
inline constexpr const char* should_stop = "should_stop";
inline constexpr const char* world_size = "world_size";
inline constexpr const char* optimizer_steps = "optimizer_steps";
inline constexpr const char* batches_that_stepped = "batches_that_stepped";
inline constexpr const char* time_elapsed = "time_elapsed";
inline constexpr const char* batch_stepped = "batch_stepped";
}  // namespace loop_keys

/// Where a checkpoint's fit stood: what `FitProgress::state_dict` wrote, read back and checked.
struct ResumePoint {
  /// The epoch to go on with (completed epochs) and the optimizer steps taken.
  int64_t epoch = 0;
  int64_t global_step = 0;
  /// Training batches run in the fit so far.
  int64_t total_batch_idx = 0;
  /// Batches of `epoch` already trained on (the next one to run).
  int64_t batch_in_epoch = 0;
  /// The save came from the epoch's end hooks: the epoch only needs closing.
  bool epoch_finished = false;
  /// The save came after a training batch whose validation had not started yet: it runs first.
  bool val_pending = false;
  bool should_stop = false;
  /// Ranks of the run that saved it.
  int world_size = 1;
  /// Each optimizer's steps (empty in files that predate the entry: one optimizer, whose steps are global_step).
  std::vector<int64_t> optimizer_steps;
  /// Training batches after which an optimizer stepped (files that predate the entry: global_step).
  int64_t batches_that_stepped = 0;
  /// Seconds of training before the save, across the fits it resumed from (max_time; 0 in files without it).
  double time_elapsed = 0.0;
  /// The save came during a batch that counted in batches_that_stepped (its pending validation logs one step back).
  bool batch_stepped = false;
  /// Filled by the checkpoint connector: this rank's generator states at the save, and whether the training
  /// loader took up its saved position (otherwise `batch_in_epoch` batches are skipped).
  std::vector<at::Tensor> rng;
  bool loader_positioned = false;

  static ResumePoint from_state_dict(const checkpoint::View& loops) {
    auto i = [&](const char* k) { return loops.integer(k); };
    auto b = [&](const char* k) { return loops.flag(k); };
    ResumePoint r;
    r.epoch = i(loop_keys::epoch);
    r.global_step = i(loop_keys::global_step);
    r.total_batch_idx = i(loop_keys::total_batch_idx);
    r.batch_in_epoch = i(loop_keys::batch_in_epoch);
    r.epoch_finished = b(loop_keys::epoch_finished);
    r.val_pending = b(loop_keys::val_pending);
    r.should_stop = b(loop_keys::should_stop);
    r.world_size = static_cast<int>(i(loop_keys::world_size));
    r.batches_that_stepped =
        loops.has(loop_keys::batches_that_stepped) ? i(loop_keys::batches_that_stepped) : r.global_step;
    if (loops.has(loop_keys::time_elapsed)) r.time_elapsed = loops.at(loop_keys::time_elapsed).toDouble();
    r.batch_stepped = loops.has(loop_keys::batch_stepped) && b(loop_keys::batch_stepped);
    if (loops.has(loop_keys::optimizer_steps)) {
      for (const auto& n : loops.at(loop_keys::optimizer_steps).toListRef()) {
        r.optimizer_steps.push_back(n.toInt());
      }
    }
    return r;
  }
};

/// What the fit loop counts besides the epoch and the step, and where inside an epoch it is (a checkpoint can
/// be taken from any hook, so it must know whether a batch or an epoch's end is running).
struct FitProgress {
  /// Training batches run in this fit, across epochs (val_check_interval counts these when
  /// check_val_every_n_epoch is unset).
  int64_t total_batch_idx = 0;
  /// Training batches after which an optimizer stepped (loggers count these, as Lightning's `_batches_that_stepped`).
  int64_t batches_that_stepped = 0;
  /// The running training batch counted in `batches_that_stepped` (it ended an accumulation window); also while a
  /// resumed fit runs the validation pending after such a batch.
  bool batch_stepped = false;
  /// The running training batch stepped and is one whose metrics go to loggers (every log_every_n_steps).
  bool log_due = false;
  /// Batches of the running epoch done so far (the running one included).
  int64_t batches_this_epoch = 0;
  /// The running training batch: its index and whether it is the epoch's last.
  int64_t train_batch_idx = 0;
  bool train_is_last = false;
  /// A training batch is running (its step, its hooks or the validation it triggers).
  bool in_train_batch = false;
  /// The epoch's end hooks are running.
  bool in_epoch_end = false;
  /// The running batch does not end its gradient-accumulation window (its gradients are mid-sum).
  bool mid_window = false;
  /// Gradients belong to the module between batches (manual optimization), so every checkpoint keeps them.
  bool keeps_grads = false;
  /// The running batch's validation has started.
  bool val_started = false;
  /// A callback or the module asked the fit to stop (honoured once min_epochs and min_steps are met).
  bool should_stop = false;
  /// A validation run of this fit has ended (not saved: a resumed fit has not validated yet).
  bool validated = false;
  /// max_time, or max_steps inside an epoch, stopped the fit inside a training batch: the epoch stays open, and a
  /// save after it resumes after that batch, as one during it.
  bool stopped_in_batch = false;
  /// Seconds trained by the fits this one resumed from, and when this one's training started (max_time).
  double time_before = 0.0;
  std::optional<std::chrono::steady_clock::time_point> clock_start;

  /// The step loggers file values under, as Lightning's `_batches_that_stepped` at the moment it logs: inside a
  /// training batch, the batches that stepped before it (a validation inside an accumulation window: all of them so
  /// far); at a training epoch's end, its last stepping batch's; anywhere else (validate, test), all of them.
  int64_t logging_step() const {
    if (batch_stepped || in_epoch_end) return std::max<int64_t>(batches_that_stepped - 1, 0);
    return batches_that_stepped;
  }

  void start_clock() { clock_start = std::chrono::steady_clock::now(); }
  /// The fit is over: its time stops (a save after it records the fit's time, not the time since).
  void stop_clock() {
    time_before = time_elapsed();
    clock_start.reset();
  }
  /// Seconds of training so far, the fits this one resumed from included.
  double time_elapsed() const {
    if (!clock_start) return time_before;
    return time_before + std::chrono::duration<double>(std::chrono::steady_clock::now() - *clock_start).count();
  }

  /// The `loops` entry of a checkpoint taken now. `val_due`: the running batch is one after which validation
  /// runs. A save during a batch resumes after it; a save from an epoch's end hooks resumes by closing it.
  checkpoint::Dict state_dict(int64_t epoch, int64_t global_step, bool val_due, int world_size,
                              const std::vector<int64_t>& optimizer_steps) const {
    int64_t batch_in_epoch = 0, total = total_batch_idx;
    bool finished = false, val_pending = false;
    if (in_epoch_end) {
      finished = true;
      batch_in_epoch = batches_this_epoch;
    } else if (in_train_batch || stopped_in_batch) {
      batch_in_epoch = train_batch_idx + 1;
      total = total_batch_idx + 1;
      val_pending = val_due && !val_started;
    }
    checkpoint::Dict d = checkpoint::make_dict();
    d.insert(loop_keys::epoch, epoch);
    d.insert(loop_keys::global_step, global_step);
    d.insert(loop_keys::batch_in_epoch, batch_in_epoch);
    d.insert(loop_keys::total_batch_idx, total);
    d.insert(loop_keys::epoch_finished, finished);
    d.insert(loop_keys::val_pending, val_pending);
    d.insert(loop_keys::should_stop, should_stop);
    d.insert(loop_keys::world_size, static_cast<int64_t>(world_size));
    d.insert(loop_keys::optimizer_steps, c10::List<int64_t>(optimizer_steps));
    d.insert(loop_keys::batches_that_stepped, batches_that_stepped);
    d.insert(loop_keys::time_elapsed, time_elapsed());
    d.insert(loop_keys::batch_stepped, batch_stepped);
    return d;
  }

  /// Takes up the counters of a resumed fit.
  void load(const ResumePoint& r) {
    total_batch_idx = r.total_batch_idx;
    batches_that_stepped = r.batches_that_stepped;
    should_stop = r.should_stop;
    time_before = r.time_elapsed;
  }
};

}  // namespace volt::detail
