#pragma once

#include "volt/callbacks/concept.hpp"
#include "volt/detail/clock_text.hpp"

#include <torch/types.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>

namespace volt {

/// Training progress on rank zero: epoch, step/total, it/s, ETA and the progress-bar metrics.
/// it/s counts the training batches this process ran over the time they took: validation inside the epoch and
/// the batches a resumed fit skips are not in it.
/// On a terminal the line is redrawn in place (at most `redraws_per_second` times); otherwise (a log file,
/// CI) plain lines are printed about every tenth of an epoch and at its end. Reading metric values waits
/// for the device, so redraws are throttled rather than done every step.
class ProgressBar {
 public:
  struct Options {
    /// Where to draw; defaults to std::cout.
    std::ostream* out = nullptr;
    /// Force plain lines (true) or in-place redraws (false); unset: redraw only when `out` is a terminal.
    std::optional<bool> plain;
    double redraws_per_second = 10.0;
  };

  /// Its on_train_batch_end does not read the loss (graph mode need not copy it).
  static constexpr bool keeps_loss = false;

  ProgressBar() : ProgressBar(Options{}) {}
  explicit ProgressBar(Options options) : options_(options) {
    out_ = options_.out != nullptr ? options_.out : &std::cout;
    plain_ = options_.plain.value_or(!(out_ == &std::cout && ::isatty(STDOUT_FILENO)));
  }

  /// A fit resumed inside an epoch gets no on_train_epoch_start for it (Lightning's order): the training's start
  /// starts the epoch's line too.
  template <class T, class M>
  void on_train_start(T& trainer, M& module) {
    on_train_epoch_start(trainer, module);
  }
  template <class T, class M>
  void on_train_epoch_start(T& trainer, M&) {
    if (!trainer.is_global_zero()) return;
    epoch_start_ = last_draw_ = Clock::now();
    total_ = trainer.num_training_batches();
    done_ = ran_ = 0;
    paused_ = Clock::duration::zero();
    in_epoch_ = true;
    next_plain_ = total_ > 0 ? std::max<int64_t>(1, total_ / 10) : 50;
  }

  /// The clock starts at the epoch's first batch this process runs (after a resume's skipped batches).
  template <class T, class M, class B>
  void on_train_batch_start(T& trainer, M&, const B&, int64_t) {
    if (trainer.is_global_zero() && ran_ == 0) epoch_start_ = last_draw_ = Clock::now();
  }

  template <class T, class M, class L, class B>
  void on_train_batch_end(T& trainer, M&, const L&, const B&, int64_t batch_idx) {
    if (!trainer.is_global_zero()) return;
    ++ran_;
    const int64_t done = done_ = batch_idx + 1;
    const auto now = Clock::now();
    if (plain_) {
      if (done % next_plain_ != 0) return;
    } else if (seconds(now - last_draw_) < 1.0 / options_.redraws_per_second && done != total_) {
      return;
    }
    last_draw_ = now;
    draw(trainer, done, now, /*final=*/false);
  }

  /// The epoch's last line; none for an epoch this process ran no batch of (a resume at its end).
  template <class T, class M>
  void on_train_epoch_end(T& trainer, M&) {
    if (!trainer.is_global_zero()) return;
    if (ran_ > 0) draw(trainer, done_, Clock::now(), /*final=*/true);
    in_epoch_ = false;
  }

  /// A run that fails or stops (a signal) in the middle of a redrawn line ends that line, so that what is said next
  /// (the error, the stop notice) starts a line of its own.
  template <class T, class M>
  void on_exception(T& trainer, M&, const std::exception_ptr&) {
    if (trainer.is_global_zero()) end_line();
  }
  /// Likewise for a fit that max_time ends in the middle of an epoch.
  template <class T, class M>
  void on_train_end(T& trainer, M&) {
    if (trainer.is_global_zero()) end_line();
  }

  /// Validation inside a training epoch pauses the rate's clock.
  template <class T, class M>
  void on_validation_start(T& trainer, M&) {
    if (in_epoch_ && trainer.is_global_zero()) validation_start_ = Clock::now();
  }
  template <class T, class M>
  void on_validation_end(T& trainer, M&) {
    if (in_epoch_ && trainer.is_global_zero()) paused_ += Clock::now() - validation_start_;
  }

  template <class T, class M>
  void on_test_end(T& trainer, M&) {
    if (!trainer.is_global_zero()) return;
    *out_ << "Test:" << metrics_text(trainer.callback_metrics()) << "\n" << std::flush;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

  static std::string metrics_text(const std::map<std::string, torch::Tensor>& metrics) {
    std::ostringstream o;
    o << std::setprecision(4);
    for (const auto& [name, value] : metrics) o << "  " << name << "=" << value.template item<double>();
    return o.str();
  }

  /// Ends a redrawn line that is still open.
  void end_line() {
    if (last_width_ == 0) return;
    *out_ << "\n" << std::flush;
    last_width_ = 0;
  }

  template <class T>
  void draw(const T& trainer, int64_t done, Clock::time_point now, bool final) {
    const double elapsed = seconds(now - epoch_start_);
    const double training = elapsed - seconds(paused_);
    const double rate = training > 0 ? static_cast<double>(ran_) / training : 0.0;
    std::ostringstream line;
    line << "Epoch " << trainer.current_epoch();
    if (trainer.max_epochs() > 0) line << "/" << trainer.max_epochs() - 1;
    line << "  ";
    if (total_ > 0) {
      constexpr int width = 24;
      const int filled = static_cast<int>(width * std::min<int64_t>(done, total_) / total_);
      line << "[" << std::string(filled, '=') << (filled < width ? ">" : "") << std::string(std::max(0, width - filled - 1), ' ')
           << "] " << done << "/" << total_;
    } else {
      line << done << "/?";
    }
    line << std::fixed << std::setprecision(2) << "  " << rate << " it/s";
    if (total_ > 0 && !final && rate > 0) line << "  ETA " << detail::clock_text(static_cast<double>(total_ - done) / rate);
    if (final) line << "  " << detail::clock_text(elapsed);
    line << std::defaultfloat << metrics_text(trainer.progress_bar_metrics());
    if (plain_) {
      *out_ << line.str() << "\n";
    } else {
      std::string text = line.str();
      const std::size_t pad = last_width_ > text.size() ? last_width_ - text.size() : 0;
      last_width_ = text.size();
      *out_ << "\r" << text << std::string(pad, ' ');
      if (final) {
        *out_ << "\n";
        last_width_ = 0;
      }
    }
    *out_ << std::flush;
  }

  Options options_;
  std::ostream* out_;
  bool plain_;
  Clock::time_point epoch_start_{}, last_draw_{}, validation_start_{};
  /// Time spent validating inside the running epoch.
  Clock::duration paused_{};
  bool in_epoch_ = false;
  int64_t total_ = -1;
  /// The position in the epoch (the last batch's index + 1) and the batches this process ran in it.
  int64_t done_ = 0;
  int64_t ran_ = 0;
  int64_t next_plain_ = 50;
  std::size_t last_width_ = 0;
};

}  // namespace volt
