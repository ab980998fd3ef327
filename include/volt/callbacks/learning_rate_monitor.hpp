#pragma once

#include "volt/callbacks/concept.hpp"
#include "volt/module.hpp"

#include <c10/util/Type.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <typeinfo>

namespace volt {

/// Records the learning rate of each parameter group as `lr-<Optimizer>` (`lr-<Optimizer>/pg1`, `/pg2`, ... when
/// there are several groups; `lr-<Optimizer>-1` for a second optimizer of one type), all in one logging event, as
/// Lightning's
/// LearningRateMonitor: at the start of every epoch, or (`volt::Interval::step`) at the start of every training batch
/// that loggers get values of (every `log_every_n_steps` optimizer steps), under the step its values are filed at:
/// the rate step i runs with is recorded at step i. Lightning records again at each batch of an accumulation window;
/// volt once per step.
class LearningRateMonitor {
 public:
  /// Lightning's `logging_interval`: "epoch" or "step" (the schedulers' `volt::Interval`).
  using Interval = volt::Interval;
  struct Options {
    Interval logging_interval = Interval::epoch;
    bool prog_bar = false;
  };

  LearningRateMonitor() = default;
  explicit LearningRateMonitor(Options options) : options_(options) {}

  template <class T, class M>
  void on_train_epoch_start(T& trainer, M&) {
    if (options_.logging_interval == Interval::epoch) record(trainer);
  }
  template <class T, class M, class B>
  void on_train_batch_start(T& trainer, M&, const B&, int64_t) {
    if (options_.logging_interval != Interval::step) return;
    const int64_t step = trainer.logging_step();  // the batches that stepped before this one
    if ((step + 1) % trainer.options().log_every_n_steps != 0 || step == last_step_) return;
    last_step_ = step;
    record(trainer);
  }

  /// The rate last recorded for the first optimizer's group 0 (unset before the first record).
  std::optional<double> last_lr() const { return last_lr_; }

 private:
  template <class T>
  void record(T& trainer) {
    std::map<std::string, int> seen;  // a second optimizer of one type is `lr-<Optimizer>-1`, as Lightning names it
    std::map<std::string, double> rates;
    bool first = true;
    for (torch::optim::Optimizer* opt : trainer.optimizers()) {
      std::string name = c10::demangle(typeid(*opt).name());
      if (const auto colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
      if (const int n = seen[name]++; n > 0) name += "-" + std::to_string(n);
      const auto& groups = opt->param_groups();
      for (std::size_t i = 0; i < groups.size(); ++i) {
        const double lr = groups[i].options().get_lr();
        if (first && i == 0) last_lr_ = lr;
        rates[groups.size() == 1 ? "lr-" + name : "lr-" + name + "/pg" + std::to_string(i + 1)] = lr;
      }
      first = false;
    }
    if (!rates.empty()) trainer.record_metrics(rates, options_.prog_bar);  // one row of a CSV file, as Lightning
  }

  Options options_;
  std::optional<double> last_lr_;
  int64_t last_step_ = -1;  // the step last recorded at (Interval::step)
};

}  // namespace volt
