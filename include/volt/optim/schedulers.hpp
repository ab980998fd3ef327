#pragma once
/// \file
/// Learning-rate schedules LibTorch lacks, as PyTorch's: `LinearLR` (linear warm-up), `CosineAnnealingLR` (cosine
/// decay) and `SequentialLR` (one after another at milestones), for the usual recipe of today's models.
/// \code
///   volt::OptimizerConfig configure_optimizers() {
///     const auto defaults = torch::optim::AdamWOptions(6e-4);
///     auto groups = volt::optim::weight_decay_groups(*this, 0.1, defaults);
///     auto opt = std::make_shared<volt::optim::AdamW>(std::move(groups), defaults);
///     auto warmup = std::make_shared<volt::optim::LinearLR>(*opt, volt::optim::LinearLROptions{.start_factor = 0.01,
///                                                                                             .total_iters = 100});
///     auto decay = std::make_shared<volt::optim::CosineAnnealingLR>(
///         *opt, volt::optim::CosineAnnealingLROptions{.t_max = 900, .eta_min = 6e-5});
///     return {.optimizer = opt,
///             .scheduler = std::make_shared<volt::optim::SequentialLR>(*opt, volt::optim::Schedules{warmup, decay},
///                                                                      std::vector<int64_t>{100}),
///             .interval = volt::Interval::step};
///   }
/// \endcode
///
/// They are LibTorch `LRScheduler`s (what `OptimizerConfig::scheduler` holds): the Trainer steps them after each
/// optimizer step (`Interval::step`) or epoch, and a checkpoint keeps their step count. Unlike LibTorch's own, and as
/// PyTorch's, the constructor sets the first rate (`LinearLR`: `start_factor` times the initial rate), and each
/// `step()` the rate of the next step. Each group's rate is computed in closed form from the step count and the
/// group's initial rate: its rate when the schedule was made, and for the schedules of a `SequentialLR` the rates
/// before the first of them was made (PyTorch's `initial_lr`). Groups with different rates (parameter groups) keep
/// their ratio, and a resumed fit continues with the same rates bit for bit. Make one schedule per optimizer, or
/// several joined by `SequentialLR`: a second schedule made alone would start from the rate the first one set.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numbers>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace volt::optim {

/// A schedule in closed form: each group's rate after `step` steps, from the group's initial rate.
class ClosedFormLR : public torch::optim::LRScheduler {
 public:
  explicit ClosedFormLR(torch::optim::Optimizer& optimizer)
      : LRScheduler(optimizer), optimizer_(optimizer), order_(next_order()) {
    step_count_ = 0;  // (LibTorch 1.13 leaves it unset)
    for (const auto& group : optimizer.param_groups()) initial_.push_back(group.options().get_lr());
  }

  /// The rate after `step` steps of a group whose initial rate is `initial`.
  virtual double rate(int64_t step, double initial) const = 0;
  /// The groups' initial rates.
  const std::vector<double>& initial_lrs() const { return initial_; }
  /// The steps taken (the Trainer's checkpoints keep it).
  int64_t steps() const { return step_count_; }
  /// The optimizer it schedules.
  const torch::optim::Optimizer& optimizer() const { return optimizer_; }
  /// When it was made, relative to the other schedules (SequentialLR takes the first one's initial rates).
  uint64_t order() const { return order_; }

 protected:
  /// The rates of the next step (LibTorch's `step()` sets them, then counts the step).
  std::vector<double> get_lrs() override { return rates_at(static_cast<int64_t>(step_count_) + 1); }
  /// Sets every group's rate for the steps taken so far: the constructor's first rate (PyTorch's initial step).
  void set_rates_now() {
    const auto rates = rates_at(static_cast<int64_t>(step_count_));
    for (std::size_t g = 0; g < rates.size(); ++g) optimizer_.param_groups()[g].options().set_lr(rates[g]);
  }
  void set_initial_lrs(std::vector<double> initial) { initial_ = std::move(initial); }

 private:
  std::vector<double> rates_at(int64_t step) const {
    if (optimizer_.param_groups().size() != initial_.size()) {
      throw std::logic_error("volt: a learning-rate schedule made for an optimizer of " +
                             std::to_string(initial_.size()) + " parameter groups now steps one of " +
                             std::to_string(optimizer_.param_groups().size()) + "; make the schedule after every "
                             "group is added.");
    }
    std::vector<double> rates;
    for (double initial : initial_) rates.push_back(rate(step, initial));
    return rates;
  }
  static uint64_t next_order() {
    static std::atomic<uint64_t> made{0};
    return made++;
  }

  torch::optim::Optimizer& optimizer_;
  std::vector<double> initial_;
  uint64_t order_;
};

/// `LinearLR`'s settings, PyTorch's defaults.
struct LinearLROptions {
  double start_factor = 1.0 / 3.0;  ///< the first step's rate, times the initial rate; in (0, 1]
  double end_factor = 1.0;          ///< the rate from `total_iters` on, times the initial rate; in [0, 1]
  int64_t total_iters = 5;          ///< the steps the factor takes to go from start to end; at least 1
};

/// The rate times a factor that goes linearly from `start_factor` to `end_factor` over `total_iters` steps, then
/// stays (PyTorch's `LinearLR`: a warm-up from a small fraction of the rate).
class LinearLR : public ClosedFormLR {
 public:
  LinearLR(torch::optim::Optimizer& optimizer, LinearLROptions options) : ClosedFormLR(optimizer), o_(options) {
    if (!(o_.start_factor > 0.0 && o_.start_factor <= 1.0) || !(o_.end_factor >= 0.0 && o_.end_factor <= 1.0)) {
      throw std::invalid_argument("volt: LinearLR: start_factor " + std::to_string(o_.start_factor) +
                                  " and end_factor " + std::to_string(o_.end_factor) +
                                  "; allowed: 0 < start_factor <= 1, 0 <= end_factor <= 1 (as PyTorch's).");
    }
    if (o_.total_iters < 1) {
      throw std::invalid_argument("volt: LinearLR: total_iters " + std::to_string(o_.total_iters) +
                                  "; allowed: 1 or more steps.");
    }
    set_rates_now();
  }
  double rate(int64_t step, double initial) const override {
    const double done = static_cast<double>(std::min(step, o_.total_iters)) / static_cast<double>(o_.total_iters);
    return initial * (o_.start_factor + (o_.end_factor - o_.start_factor) * done);
  }

 private:
  LinearLROptions o_;
};

/// `CosineAnnealingLR`'s settings.
struct CosineAnnealingLROptions {
  int64_t t_max = 0;     ///< the steps of half a cosine period: the rate reaches `eta_min` there; at least 1
  double eta_min = 0.0;  ///< the lowest rate
};

/// The rate on a cosine from the initial rate down to `eta_min` over `t_max` steps (and back up over the next
/// `t_max`, as PyTorch's `CosineAnnealingLR` without restarts).
class CosineAnnealingLR : public ClosedFormLR {
 public:
  CosineAnnealingLR(torch::optim::Optimizer& optimizer, CosineAnnealingLROptions options)
      : ClosedFormLR(optimizer), o_(options) {
    if (o_.t_max < 1) {
      throw std::invalid_argument("volt: CosineAnnealingLR: t_max " + std::to_string(o_.t_max) +
                                  "; allowed: 1 or more steps (the steps from the initial rate down to eta_min).");
    }
    set_rates_now();
  }
  double rate(int64_t step, double initial) const override {
    const double phase = std::numbers::pi * static_cast<double>(step) / static_cast<double>(o_.t_max);
    return o_.eta_min + (initial - o_.eta_min) * (1.0 + std::cos(phase)) / 2.0;
  }

 private:
  CosineAnnealingLROptions o_;
};

/// The schedules a `SequentialLR` runs, in order.
using Schedules = std::vector<std::shared_ptr<ClosedFormLR>>;

/// Several schedules of one optimizer one after another: schedule i + 1 starts at step `milestones[i]`, counting its
/// own steps from 0 there (PyTorch's `SequentialLR`). Each runs from the groups' initial rates.
class SequentialLR : public ClosedFormLR {
 public:
  SequentialLR(torch::optim::Optimizer& optimizer, Schedules schedules, std::vector<int64_t> milestones)
      : ClosedFormLR(optimizer), schedules_(std::move(schedules)), milestones_(std::move(milestones)) {
    check(optimizer);
    // The initial rates are those the groups had before the first of the schedules was made (PyTorch: initial_lr).
    const auto first = std::min_element(schedules_.begin(), schedules_.end(),
                                        [](const auto& a, const auto& b) { return a->order() < b->order(); });
    set_initial_lrs((*first)->initial_lrs());
    set_rates_now();
  }
  double rate(int64_t step, double initial) const override {
    const auto i = static_cast<std::size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), step) -
                                            milestones_.begin());
    return schedules_[i]->rate(i == 0 ? step : step - milestones_[i - 1], initial);
  }

 private:
  void check(const torch::optim::Optimizer& optimizer) const {
    if (schedules_.empty() || milestones_.size() + 1 != schedules_.size()) {
      throw std::invalid_argument("volt: SequentialLR: " + std::to_string(schedules_.size()) + " schedules and " +
                                  std::to_string(milestones_.size()) +
                                  " milestones; allowed: one milestone fewer than schedules (at least one schedule).");
    }
    for (std::size_t i = 0; i < schedules_.size(); ++i) {
      if (!schedules_[i] || &schedules_[i]->optimizer() != &optimizer) {
        throw std::invalid_argument("volt: SequentialLR: schedule " + std::to_string(i) +
                                    " is missing or schedules another optimizer; all must schedule this one.");
      }
    }
    for (std::size_t i = 0; i < milestones_.size(); ++i) {
      if (milestones_[i] < 1 || (i > 0 && milestones_[i] <= milestones_[i - 1])) {
        throw std::invalid_argument("volt: SequentialLR: milestone " + std::to_string(i) + " is " +
                                    std::to_string(milestones_[i]) + "; allowed: increasing steps from 1.");
      }
    }
  }

  Schedules schedules_;
  std::vector<int64_t> milestones_;
};

/// Two parameter groups of `module`'s parameters that require gradients, for AdamW as GPT-2 and most trainers of
/// transformers build them: matrices (weights of linear layers and embeddings: two or more dimensions) with
/// `weight_decay`, vectors (biases, norms' scales) without. Each group's options are `defaults` with that decay
/// (`Options`: `torch::optim::AdamWOptions`, `AdamOptions` or `SGDOptions`); a tensor shared by several modules
/// counts once.
template <class Options>
std::vector<torch::optim::OptimizerParamGroup> weight_decay_groups(const torch::nn::Module& module,
                                                                   double weight_decay, const Options& defaults) {
  std::vector<at::Tensor> decay, no_decay;
  std::unordered_set<const void*> seen;
  for (const auto& p : module.parameters()) {
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    (p.dim() >= 2 ? decay : no_decay).push_back(p);
  }
  auto with = [&](double wd) {
    auto o = std::make_unique<Options>(defaults);
    o->weight_decay(wd);
    return o;
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::move(decay), with(weight_decay));
  groups.emplace_back(std::move(no_decay), with(0.0));
  return groups;
}

}  // namespace volt::optim
