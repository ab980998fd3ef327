#pragma once
/// \file
/// Part of volt/trainer.hpp, included at its end: the fit, as Lightning's `_FitLoop` and
/// `_TrainingEpochLoop` — set-up, the optional resume, the sanity check, epochs of training batches with
/// validation where `val_check_interval` and `check_val_every_n_epoch` put it, and the stop decision. Each training
/// batch's optimization is run by the step object the fit loop owns (`detail::training_step_t`: automatic, graphed
/// or manual). Stopping at a batch boundary (signals, max_time) is trainer/stop_impl.hpp.
/// Not a header of its own: include volt/trainer.hpp.

#include <torch/csrc/autograd/anomaly_mode.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>

namespace volt {
namespace detail {

/// The training step a fit of module `Impl` on batches `B` runs with Trainer `T`: manual optimization when the module
/// asks for it, graph mode on a graphed accelerator (when its rules hold; otherwise `fit` has said why), else the
/// automatic eager step.
template <class T, class Impl, class B>
using training_step_t = std::conditional_t<
    manual_optimization<Impl>, ManualStep<T, Impl>,
    std::conditional_t<captures_step<typename T::accelerator_type> && graph_rule_v<T, Impl> == GraphRule::none,
                       GraphedStep<T, Impl, B>, AutomaticStep<T>>>;

/// Thrown at a training batch boundary when max_time has passed (its checkpoint written); the fit loop ends there
/// and says `notice` after on_train_end (a progress bar has ended its line by then).
struct TimeUp {
  std::string notice;
};

}  // namespace detail

/// The body of `fit` in each process that trains: set-up, hooks around the loops, teardown (also on failure).
template <class S, class P, class A, class... Cs>
template <class Impl, class TL, class VL>
void Trainer<S, P, A, Cs...>::run_fit(Impl& module, TL& train, VL* val, const std::string& ckpt_path) {
  state_ = detail::LoopState{};
  progress_ = detail::FitProgress{};
  train_store_.clear();
  logger_.clear();
  setup_run(module);
  Context ctx(state_, train_store_);
  module_ = &module;

  decltype(auto) train_loader = strategy_.process_dataloader(train, Stage::train);
  using PTL = std::remove_reference_t<decltype(train_loader)>;
  detail::ShuffleOff<PTL> train_order(train_loader, overfits(), strategy_.is_global_zero(), "training");
  save_hooks_ = [this, &module](checkpoint::Dict& d, bool weights_only) {  // callbacks first, as Lightning
    detail::call_callbacks<detail::hooks::on_save_checkpoint>(callbacks_, *this, module, d);
    if constexpr (requires(Impl& m, checkpoint::Dict& dd) { m.on_save_checkpoint(dd); }) {
      if (!weights_only) module.on_save_checkpoint(d);
    }
  };
  train_loader_state_ = nullptr;  // the training loader's position, where it keeps one
  if constexpr (data::PositionedLoader<PTL>) train_loader_state_ = [&l = train_loader] { return l.state_dict(); };
  struct FitScope {  // however the fit ends: the loader's last position kept, nothing left "running"
    Trainer* t;
    explicit FitScope(Trainer* trainer) : t(trainer) { t->fitting_ = true; t->final_loader_state_.reset(); }
    ~FitScope() {
      t->fitting_ = false;
      if (t->train_loader_state_) t->final_loader_state_ = t->train_loader_state_();
      t->train_loader_state_ = nullptr;
      t->progress_.in_train_batch = t->progress_.in_epoch_end = false;
      t->progress_.stop_clock();
    }
  } scope(this);

  cluster::SignalScope signals(options_.signals);  // SIGTERM, SIGINT, the requeue signal: checkpoint and stop
  std::optional<torch::autograd::DetectAnomalyGuard> anomaly;  // detect_anomaly: LibTorch's anomaly mode while fitting
  if (options_.detect_anomaly) anomaly.emplace();
  ckpt_path_.clear();
  guarded(module, [&] {
    const std::string resume_from = ckpt_path.empty() ? std::string() : resolve_ckpt_path(ckpt_path, "fit");
    ckpt_path_ = resume_from;
    hook<detail::hooks::setup>(module, ctx, Stage::train);
    detail::log_hyperparams(callbacks_, strategy_.is_global_zero(), hparams_.effective);
    optim_ = detail::scheduled_optimizers(module.configure_optimizers());
    hook<detail::hooks::on_optimizers_configured>(module, ctx);  // parameter groups may be added (BackboneFinetuning)
    for (auto& o : optim_) strategy_.setup_optimizer(o.optimizer());  // ZeRO: this rank's pieces
    params_ = module.parameters();
    progress_.keeps_grads = manual_optimization<Impl>;

    auto go = [&](auto* processed_val) {
      resolve_fit_sizes(train_loader, processed_val);
      fit_loop(module, ctx, train_loader, processed_val,
               resume_from.empty() ? std::nullopt : std::optional(restore(module, train_loader, resume_from)));
    };
    if constexpr (!std::is_same_v<VL, NoLoader>) {
      decltype(auto) val_loader = detail::process_loader(strategy_, *val, Stage::validate);
      detail::ShuffleOff<std::remove_reference_t<decltype(val_loader)>> val_order(
          val_loader, overfits(), strategy_.is_global_zero(), "validation");
      go(&val_loader);
    } else {
      go(static_cast<NoLoader*>(nullptr));
    }

    writer_.wait();  // the fit's last asynchronous save is in place before teardown
    hook<detail::hooks::teardown>(module, ctx, Stage::train);
    strategy_.finish_fit();
    strategy_.teardown();
  }, [&](std::exception_ptr error) {  // a failure, or a stop signal after its checkpoint (guarded flushes the loggers)
    try {
      std::rethrow_exception(error);
    } catch (const Interrupted& stop) {  // said after on_exception, so a progress bar has ended its line
      if (strategy_.is_global_zero()) std::cerr << stop.what() << std::endl;
    } catch (...) {
    }
    try {
      writer_.wait();  // a save in flight completes (its previous file stays whole either way)
    } catch (...) {  // the run's own error says more
    }
    strategy_.teardown();
  });
}

/// The fit's loops: the sanity check, then epochs until fit_done. `resume`: where a checkpoint left off.
template <class S, class P, class A, class... Cs>
template <class Impl, class TL, class VL>
void Trainer<S, P, A, Cs...>::fit_loop(Impl& module, Context& ctx, TL& train, VL* val,
                                       std::optional<detail::ResumePoint> resume) {
  detail::StepParts<Trainer> parts{*this, strategy_, precision_, callbacks_, options_, state_, optim_, params_,
                                   train_store_};
  detail::training_step_t<Trainer, Impl, detail::batch_t<TL>> step(parts, module, ctx);
  hook<detail::hooks::on_fit_start>(module, ctx);

  if constexpr (!std::is_same_v<VL, NoLoader>) {
    // num_sanity_val_steps of each loader; not when resuming inside an epoch (Lightning's loops are "restarting"
    // then: the check would disturb the state loaded), but after an epoch-end checkpoint, as a fresh epoch; and, as
    // Lightning 2.6, not in any resumed fit that sets max_steps (such as one going on from the last.ckpt a fit wrote
    // when max_steps ended it inside an epoch).
    const bool mid_epoch = resume && !resume->epoch_finished && resume->batch_in_epoch > 0;
    const bool step_limited_resume = resume && options_.max_steps != -1;
    if (num_val_batches_ != 0 && options_.num_sanity_val_steps != 0 && !mid_epoch && !step_limited_resume) {
      state_.stage = Stage::sanity_check;
      detail::call_callbacks<detail::hooks::on_sanity_check_start>(callbacks_, *this, module);
      run_eval_loop<detail::ValidationKind>(
          module, *val, Stage::sanity_check,
          detail::limit_of(options_.limit_val_batches, "limit_val_batches", options_.num_sanity_val_steps));
      detail::call_callbacks<detail::hooks::on_sanity_check_end>(callbacks_, *this, module);
      state_.stage = Stage::train;
    }
  }

  std::optional<std::vector<at::Tensor>> rng;  // the generators as they were at the save
  if (resume) {
    rng = std::move(resume->rng);
    if (resume->epoch_finished) {  // an epoch saved from its end hooks is closed: the training starts at the next
      resume.reset();
      close_epoch();
    }
  }
  if (fit_done()) {  // nothing to train (no batches, max_epochs or max_steps reached): no training loop, as Lightning
    hook<detail::hooks::on_fit_end>(module, ctx);
    return;
  }
  module.train();
  hook<detail::hooks::on_train_start>(module, ctx);
  progress_.start_clock();  // max_time counts training from here, on top of the time of a fit resumed from
  if (rng) checkpoint::set_rng_states(*rng);
  std::string time_notice;
  try {
    while (!fit_done()) train_epoch(module, ctx, step, train, val, resume);
  } catch (const detail::TimeUp& up) {  // max_time: the checkpoint is written; the epoch is left as at a signal
    time_notice = up.notice;
  }

  hook<detail::hooks::on_train_end>(module, ctx);
  if (!time_notice.empty() && strategy_.is_global_zero()) std::cerr << time_notice << std::endl;
  hook<detail::hooks::on_fit_end>(module, ctx);
}

/// One training epoch: its batches (after a resume, from where the checkpoint left off), then its end hooks.
template <class S, class P, class A, class... Cs>
template <class Impl, class Step, class TL, class VL>
void Trainer<S, P, A, Cs...>::train_epoch(Impl& module, Context& ctx, Step& step, TL& train, VL* val,
                                          std::optional<detail::ResumePoint>& resume) {
  if constexpr (requires { train.set_epoch(int64_t{}); }) train.set_epoch(state_.current_epoch);
  if (!resume) train_store_.clear();  // a resumed epoch keeps the metric sums of its first part
  state_.stage = Stage::train;
  // An epoch resumed after some of its batches has started already: its start hooks ran before the save, and what
  // they reset is what the checkpoint restored (Lightning's `_FitLoop.on_advance_start`).
  if (!resume || resume->batch_in_epoch == 0) hook<detail::hooks::on_train_epoch_start>(module, ctx);

  int64_t start = 0;
  bool skip = false;
  if (resume) {
    start = resume->batch_in_epoch;
    skip = !resume->loader_positioned;  // a loader without a saved position skips what was trained on
    if constexpr (data::PositionedLoader<TL>) {
      if (resume->loader_positioned) start = train.batches_done();
    }
    if (resume->val_pending) {  // the check of the batch the save followed, logged where that batch's was
      progress_.batch_stepped = resume->batch_stepped;
      run_validation(module, val);
      progress_.batch_stepped = false;
    }
    resume.reset();
  }
  progress_.batches_this_epoch = start;
  detail::for_each_batch(
      train, num_training_batches_,
      [&](auto&& batch, int64_t batch_idx, bool is_last) {
        progress_.batches_this_epoch = batch_idx + 1;
        return train_batch(module, ctx, step, batch, batch_idx, is_last, val);
      },
      start, skip);
  // max_steps reached inside the epoch: it is left open, as max_time and a stop signal leave it (no end hooks, no
  // epoch-interval scheduler step), so a fit resumed from a save after this one goes on with its next batch.
  if (progress_.stopped_in_batch) return;

  // Epoch end: callbacks, the module, then callbacks that monitor metrics (they see its logs).
  progress_.in_epoch_end = true;
  logger_.publish_epoch(train_store_, collectives_, nullptr, state_.device);
  detail::call_callbacks<detail::hooks::on_train_epoch_end, detail::Watch::not_monitoring>(callbacks_, *this, module);
  detail::hooks::on_train_epoch_end::module(module, ctx);
  detail::MetricMap epoch_log;
  logger_.publish_epoch(train_store_, collectives_, &epoch_log, state_.device);
  detail::call_callbacks<detail::hooks::on_train_epoch_end, detail::Watch::monitoring>(callbacks_, *this, module);
  send_to_loggers(epoch_log);
  flush_loggers();
  progress_.in_epoch_end = false;
  close_epoch();
  stop_if_asked();  // between epochs: a checkpoint here resumes at the next epoch's first batch
}

/// One training batch: step, maybe optimizer step, hooks, metrics, maybe validation.
/// Returns false when the epoch should end here.
template <class S, class P, class A, class... Cs>
template <class Impl, class Step, class B, class VL>
bool Trainer<S, P, A, Cs...>::train_batch(Impl& module, Context& ctx, Step& step, B& batch, int64_t batch_idx,
                                          bool is_last, VL* val) {
  struct InBatch {  // what a checkpoint taken during this batch records
    detail::FitProgress& p;
    InBatch(detail::FitProgress& progress, int64_t idx, bool last) : p(progress) {
      p.in_train_batch = true;
      p.train_batch_idx = idx;
      p.train_is_last = last;
      p.val_started = false;
      p.batch_stepped = false;
    }
    ~InBatch() { p.in_train_batch = p.batch_stepped = false; }
  } in_batch(progress_, batch_idx, is_last);
  enter_batch(batch, batch_idx);
  using detail::hooks::on_train_batch_start;
  if constexpr (!std::is_void_v<decltype(hook<on_train_batch_start>(module, ctx, batch, batch_idx))>) {
    const auto response = hook<on_train_batch_start>(module, ctx, batch, batch_idx);
    if (static_cast<int64_t>(response) == -1) {  // the module ends the epoch here
      leave_batch();
      return false;
    }
  } else {
    hook<on_train_batch_start>(module, ctx, batch, batch_idx);
  }

  const auto window = detail::Window::of(batch_idx, is_last, options_.accumulate_grad_batches);
  progress_.mid_window = !window.steps;
  torch::Tensor detached = step.run(module, ctx, batch, window);
  // As Lightning's `_batches_that_stepped`: a batch that ends an accumulation window counts, and under manual
  // optimization every batch (whether it stepped one optimizer, several or none). Loggers get the batch's values
  // every log_every_n_steps of these; callbacks read it as logs_this_batch().
  const bool steps = manual_optimization<Impl> || window.steps;
  if (steps) {
    ++progress_.batches_that_stepped;
    progress_.batch_stepped = true;
  }
  const int64_t counted = progress_.batches_that_stepped;
  progress_.log_due = steps && (counted % options_.log_every_n_steps == 0 || progress_.should_stop);
  hook<detail::hooks::on_train_batch_end>(module, ctx, detached, batch, batch_idx);
  leave_batch();
  progress_.log_due = false;

  logger_.publish_step(train_store_, collectives_, has_loggers());
  if constexpr (has_loggers()) {
    if (steps && (counted % options_.log_every_n_steps == 0 || progress_.should_stop)) {
      send_to_loggers(logger_.pending());
    } else {
      logger_.pending().clear();
    }
  }

  if (should_check_val(batch_idx, is_last)) {
    progress_.val_started = true;
    run_validation(module, val);
  }
  stop_if_asked();  // still inside the batch: a checkpoint here resumes after it
  if (max_steps_reached() && !is_last) {  // the epoch stays open: a save after the fit resumes after this batch
    progress_.stopped_in_batch = true;
    return false;
  }
  ++progress_.total_batch_idx;
  if (max_steps_reached()) return false;
  return !(progress_.should_stop && can_stop_early());
}

/// Training batches per epoch, the validation interval in batches, and validation batches per run.
template <class S, class P, class A, class... Cs>
template <class TL, class VL>
void Trainer<S, P, A, Cs...>::resolve_fit_sizes(TL& train, VL* val) {
  num_training_batches_ = options_.limit_train_batches.resolve(detail::loader_size(train), "limit_train_batches");
  val_check_batch_ = -1;
  const Limit& vci = options_.val_check_interval;
  if (!vci.is_fraction()) {
    val_check_batch_ = vci.count();
    if (options_.check_val_every_n_epoch && num_training_batches_ >= 0 && val_check_batch_ > num_training_batches_) {
      throw ConfigError("volt: val_check_interval=" + std::to_string(val_check_batch_) +
                        " must be no more than the number of training batches per epoch (" +
                        std::to_string(num_training_batches_) +
                        "). Give a smaller value, a fraction, or leave check_val_every_n_epoch unset to count "
                        "batches across epochs.");
    }
  } else if (num_training_batches_ >= 0) {
    val_check_batch_ = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(num_training_batches_) * vci.fraction()));
  } else if (vci.fraction() != 1.0) {
    throw ConfigError("volt: val_check_interval=" + std::to_string(vci.fraction()) +
                      " is a fraction of the training loader, which has no size(). Give an integer number of "
                      "batches.");
  }
  num_val_batches_ = 0;
  if constexpr (!std::is_same_v<VL, NoLoader>) {
    num_val_batches_ = detail::sum_over_loaders(*val, detail::limit_of(options_.limit_val_batches,
                                                                          "limit_val_batches"));
    // A rank dealt no validation batch (fewer batches than ranks) still runs every validation, over none, so that the
    // ranks' hooks and reductions stay together.
    if (strategy_.world_size() > 1 && strategy_.host_max(num_val_batches_ != 0 ? 1 : 0) == 1 && num_val_batches_ == 0) {
      num_val_batches_ = -1;
    }
  }
  // Said once, at the start, as Lightning warns: an empty loader is rarely meant.
  if (strategy_.is_global_zero()) {
    if (num_training_batches_ == 0) {
      std::cerr << "volt: fit has no training batches ("
                << (detail::loader_size(train) == 0 ? std::string("the training loader is empty")
                                                    : std::string("limit_train_batches is 0"))
                << "), so nothing is trained.\n";
    }
    if constexpr (!std::is_same_v<VL, NoLoader>) {
      if (num_val_batches_ == 0 && detail::loader_size(*val) == 0) {
        std::cerr << "volt: the validation loader given to fit is empty, so validation never runs and nothing it "
                     "would log (val_loss, ...) can be monitored.\n";
      }
    }
  }
}

/// Phase (c) for a module with manual optimization: the options that only automatic optimization reads are left
/// unset, as Lightning requires (the module does in training_step what they would do).
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::check_manual_options() const {
  if (options_.accumulate_grad_batches != 1) {
    throw ConfigError("volt: accumulate_grad_batches=" + std::to_string(options_.accumulate_grad_batches) +
                      " is for automatic optimization, and this module steps its own optimizers "
                      "(automatic_optimization = false): leave it at 1 and accumulate in training_step (step the "
                      "optimizer every k batches; under DDP, hold ctx.no_sync() around the other backwards).");
  }
  if (options_.gradient_clip_val && *options_.gradient_clip_val > 0.0) {
    throw ConfigError("volt: gradient_clip_val=" + std::to_string(*options_.gradient_clip_val) +
                      " is for automatic optimization, and this module steps its own optimizers "
                      "(automatic_optimization = false): leave it unset and call ctx.clip_gradients(opt, value, "
                      "algorithm) in training_step, between ctx.manual_backward and opt.step().");
  }
}

/// Whether min_epochs and min_steps are met, so a stop request may end the fit.
template <class S, class P, class A, class... Cs>
bool Trainer<S, P, A, Cs...>::can_stop_early() const {
  return state_.current_epoch >= options_.min_epochs && state_.global_step >= options_.min_steps;
}
/// Whether max_steps optimizer steps were taken.
template <class S, class P, class A, class... Cs>
bool Trainer<S, P, A, Cs...>::max_steps_reached() const {
  return options_.max_steps >= 0 && state_.global_step >= options_.max_steps;
}
/// Whether the fit ends before another epoch: no batches, max_steps, max_epochs, or an honoured stop request.
template <class S, class P, class A, class... Cs>
bool Trainer<S, P, A, Cs...>::fit_done() const {
  if (num_training_batches_ == 0 || max_steps_reached()) return true;
  if (max_epochs_ >= 0 && state_.current_epoch >= max_epochs_) return true;
  return progress_.should_stop && can_stop_early();
}

/// Whether validation runs after training batch `batch_idx` (`is_last`: the epoch's last).
template <class S, class P, class A, class... Cs>
bool Trainer<S, P, A, Cs...>::should_check_val(int64_t batch_idx, bool is_last) const {
  if (num_val_batches_ == 0) return false;
  if (options_.check_val_every_n_epoch && (state_.current_epoch + 1) % *options_.check_val_every_n_epoch != 0) {
    return false;
  }
  const bool infinite = val_check_batch_ < 0;
  if (is_last && infinite) return true;
  if (progress_.should_stop && can_stop_early()) return true;
  if (infinite) return false;
  const int64_t iteration = options_.check_val_every_n_epoch ? batch_idx : progress_.total_batch_idx;
  return (iteration + 1) % val_check_batch_ == 0;
}

/// After an epoch's end hooks: the epoch-interval schedulers' steps, the next epoch, the stop decision.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::close_epoch() {
  for (auto& o : optim_) o.epoch_ended(state_.current_epoch);
  ++state_.current_epoch;
  progress_.should_stop = strategy_.reduce_boolean_decision(progress_.should_stop, /*all=*/false);
}

/// A validation run inside the fit; the module goes back to training.
template <class S, class P, class A, class... Cs>
template <class Impl, class VL>
void Trainer<S, P, A, Cs...>::run_validation(Impl& module, VL* val) {
  if constexpr (!std::is_same_v<VL, NoLoader>) {
    run_eval_loop<detail::ValidationKind>(module, *val, Stage::validate,
                                          detail::limit_of(options_.limit_val_batches, "limit_val_batches"));
    progress_.validated = true;
    module.train();
    state_.stage = Stage::train;
  }
}

}  // namespace volt
