#pragma once
/// \file
/// Part of volt/trainer.hpp, included at its end: the one evaluation loop. Validation, the sanity check, test
/// and predict differ only in their hooks, their step and whether their values are published
/// (loops/evaluation.hpp); `eval_epoch` runs any of them. Not a header of its own: include volt/trainer.hpp.

#include "volt/data/predict_gather.hpp"

#include <c10/core/InferenceMode.h>
#include <torch/utils.h>

#include <optional>

namespace volt {
namespace detail {

/// InferenceMode or NoGradGuard, chosen at run time (TrainerOptions::inference_mode).
class EvalGradGuard {
 public:
  explicit EvalGradGuard(bool inference_mode) {
    if (inference_mode) {
      inference_.emplace();
    } else {
      no_grad_.emplace();
    }
  }

 private:
  std::optional<c10::InferenceMode> inference_;
  std::optional<torch::NoGradGuard> no_grad_;
};

}  // namespace detail

/// One pass of an evaluation stage, hooks included: start, epoch start, then each loader's batches in turn (several
/// loaders: `data::loaders`), at most `limit_of(loader)` of each (each batch: its start hook, the step, its end hook
/// with the output `sink` keeps: the step's own, or predict's copy in its results), epoch end, the epoch values
/// published (not in the sanity check: Lightning throws them away), end.
template <class S, class P, class A, class... Cs>
template <class Kind, class Impl, class L, class LimitOf, class Sink>
void Trainer<S, P, A, Cs...>::eval_epoch(Impl& module, Context& ctx, L& loader, LimitOf&& limit_of, Stage stage,
                                         Sink&& sink) {
  hook<typename Kind::start>(module, ctx);
  hook<typename Kind::epoch_start>(module, ctx);
  data::for_each_loader(loader, [&](auto& one, std::size_t loader_idx, std::size_t loaders) {
    state_.dataloader_idx = static_cast<int64_t>(loader_idx);
    state_.dataloaders = static_cast<int64_t>(loaders);
    num_eval_batches_ = limit_of(one);
    detail::for_each_batch(one, num_eval_batches_, [&](auto&& batch, int64_t idx, bool) {
      enter_batch(batch, idx);
      hook<typename Kind::batch_start>(module, ctx, batch, idx);
      auto out = run_eval_step(batch, [&](auto& b) {
        return detail::run_module_step(state_, Kind::step_name, [&] {
          [[maybe_unused]] auto scope = strategy_.forward_scope(stage);
          return Kind::step(module, b, ctx);
        });
      });
      decltype(auto) kept = sink(out);
      hook<typename Kind::batch_end>(module, ctx, kept, batch, idx);
      leave_batch();
      return true;
    });
  });
  state_.dataloader_idx = 0;  // the epoch's end hooks log under plain names, as Lightning's
  state_.dataloaders = 1;
  hook<typename Kind::epoch_end>(module, ctx);
  if constexpr (Kind::publishes) {
    if (stage != Stage::sanity_check) {
      detail::MetricMap to_log;
      logger_.publish_epoch(eval_store_, collectives_, &to_log, state_.device);
      send_to_loggers(to_log);
      flush_loggers();
    }
  }
  hook<typename Kind::end>(module, ctx);
}

/// Validation (or the sanity check) inside a fit, or a standalone validate/test: the module in eval mode
/// without gradients, fresh metric values, the stage set for Contexts and callbacks.
template <class S, class P, class A, class... Cs>
template <class Kind, class Impl, class L, class LimitOf>
void Trainer<S, P, A, Cs...>::run_eval_loop(Impl& module, L& loader, Stage stage, LimitOf&& limit_of) {
  const Stage previous = state_.stage;
  state_.stage = stage;
  eval_store_.clear();
  Context ctx(state_, eval_store_);
  const bool was_training = module.is_training();
  module.eval();
  {
    detail::EvalGradGuard no_grad(options_.inference_mode);
    eval_epoch<Kind>(module, ctx, loader, limit_of, stage, [](auto& out) -> auto& { return out; });
  }
  if (was_training) module.train();
  state_.stage = previous;
}

/// See the declaration.
template <class S, class P, class A, class... Cs>
template <class M, class Loader>
std::map<std::string, double> Trainer<S, P, A, Cs...>::validate(M& module, Loader&& loader,
                                                                const std::string& ckpt_path) {
  using BatchTypes = typename detail::batch_of<std::remove_cvref_t<Loader>>::type;
  static_assert(detail::has_step<detail::ValidationKind, module_impl_t<M>, BatchTypes>,
                "volt: validate needs the module's validation_step(const Batch&, volt::Context&) for this "
                "loader's batches (for each loader's, given several).");
  return strategy_.launch([&] {
    return run_standalone_eval<detail::ValidationKind>(detail::unwrap(module), detail::deref_loader(loader),
                                                       Stage::validate, ckpt_path);
  });
}

/// See the declaration.
template <class S, class P, class A, class... Cs>
template <class M, class Loader>
std::map<std::string, double> Trainer<S, P, A, Cs...>::test(M& module, Loader&& loader, const std::string& ckpt_path) {
  using BatchTypes = typename detail::batch_of<std::remove_cvref_t<Loader>>::type;
  static_assert(detail::has_step<detail::TestKind, module_impl_t<M>, BatchTypes>,
                "volt: test needs the module's test_step(const Batch&, volt::Context&) for this loader's batches (for "
                "each loader's, given several).");
  return strategy_.launch([&] {
    return run_standalone_eval<detail::TestKind>(detail::unwrap(module), detail::deref_loader(loader), Stage::test,
                                                 ckpt_path);
  });
}

/// `validate` and `test`: a run of its own around one evaluation loop; returns the callback metrics.
template <class S, class P, class A, class... Cs>
template <class Kind, class Impl, class L>
std::map<std::string, double> Trainer<S, P, A, Cs...>::run_standalone_eval(Impl& module, L& loader, Stage stage,
                                                                           const std::string& ckpt_path) {
  reset_state_keeping_progress();
  logger_.clear();
  setup_run(module);
  decltype(auto) processed = detail::process_loader(strategy_, loader, stage);
  const bool test = stage == Stage::test;
  Context ctx(state_, eval_store_);
  guarded(module, [&] {
    hook<detail::hooks::setup>(module, ctx, stage);
    detail::log_hyperparams(callbacks_, strategy_.is_global_zero(), hparams_.effective);
    load_for_evaluation(module, ckpt_path, to_string(stage));  // after setup, as Lightning restores
    run_eval_loop<Kind>(module, processed, stage,
                        detail::limit_of(test ? options_.limit_test_batches : options_.limit_val_batches,
                                         test ? "limit_test_batches" : "limit_val_batches"));
    hook<detail::hooks::teardown>(module, ctx, stage);
  }, [](std::exception_ptr) {});
  return callback_metric_values();
}

/// `predict`: the evaluation loop with predict's hooks, each step's result kept in order; across ranks, every
/// rank's results gathered back into the loader's order.
template <class S, class P, class A, class... Cs>
template <class R, class Impl, class L>
std::vector<R> Trainer<S, P, A, Cs...>::run_predict(Impl& module, L& loader, bool keep, const std::string& ckpt_path) {
  reset_state_keeping_progress();
  setup_run(module);
  state_.stage = Stage::predict;
  decltype(auto) processed = strategy_.process_dataloader(loader, Stage::predict);
  const bool gathers = keep && detail::predict_gathers<R>(processed, static_cast<int>(detail::data_line(strategy_).size()));
  const int64_t n = options_.limit_predict_batches.resolve(detail::loader_size(processed), "limit_predict_batches");
  num_eval_batches_ = n;
  if constexpr (requires { processed.batch_indices(int64_t{}); }) {
    batch_indices_ = [&processed](int64_t b) { return processed.batch_indices(b); };
  }
  struct Forget {  // the indices reader refers to this run's loader
    std::function<torch::Tensor(int64_t)>& f;
    ~Forget() { f = nullptr; }
  } forget{batch_indices_};
  Context ctx(state_, eval_store_);
  std::vector<R> results;
  if (keep && n > 0) results.reserve(static_cast<std::size_t>(n));
  const bool was_training = module.is_training();
  module.eval();
  guarded(module, [&] {
    detail::EvalGradGuard no_grad(options_.inference_mode);
    hook<detail::hooks::setup>(module, ctx, Stage::predict);
    detail::log_hyperparams(callbacks_, strategy_.is_global_zero(), hparams_.effective);
    load_for_evaluation(module, ckpt_path, "predict");
    const auto limit = [n](auto&) { return n; };
    eval_epoch<detail::PredictKind>(module, ctx, processed, limit, Stage::predict, [&](R& out) -> R& {
      if (!keep) return out;
      results.push_back(std::move(out));
      return results.back();
    });
    hook<detail::hooks::teardown>(module, ctx, Stage::predict);
  }, [&](std::exception_ptr) { if (was_training) module.train(); });
  if (was_training) module.train();
  if (gathers) {
    if constexpr (detail::GatherableResult<R>) results = detail::gather_dealt_results(std::move(results), strategy_);
  }
  return results;
}

}  // namespace volt
