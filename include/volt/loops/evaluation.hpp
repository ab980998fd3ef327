#pragma once
/// \file
/// The hooks and the step of each evaluation stage, as Lightning's `_EvaluationLoop` picks hook names by
/// stage: one evaluation loop (the Trainer's `run_eval_loop`) runs validation, the sanity check (validation's
/// hooks, its values thrown away), test and predict with the set chosen here at compile time.

#include "volt/context.hpp"
#include "volt/data/concept.hpp"
#include "volt/loops/hooks.hpp"

namespace volt::detail {

/// validate, and the sanity check before training.
struct ValidationKind {
  using start = hooks::on_validation_start;
  using epoch_start = hooks::on_validation_epoch_start;
  using batch_start = hooks::on_validation_batch_start;
  using batch_end = hooks::on_validation_batch_end;
  using epoch_end = hooks::on_validation_epoch_end;
  using end = hooks::on_validation_end;
  /// Its epoch values reach callback_metrics and loggers (except in the sanity check).
  static constexpr bool publishes = true;
  static constexpr const char* step_name = "validation_step";
  template <class M, class B>
  static auto step(M& m, B& b, Context& ctx) -> decltype(m.validation_step(b, ctx)) {
    return m.validation_step(b, ctx);
  }
};

struct TestKind {
  using start = hooks::on_test_start;
  using epoch_start = hooks::on_test_epoch_start;
  using batch_start = hooks::on_test_batch_start;
  using batch_end = hooks::on_test_batch_end;
  using epoch_end = hooks::on_test_epoch_end;
  using end = hooks::on_test_end;
  static constexpr bool publishes = true;
  static constexpr const char* step_name = "test_step";
  template <class M, class B>
  static auto step(M& m, B& b, Context& ctx) -> decltype(m.test_step(b, ctx)) {
    return m.test_step(b, ctx);
  }
};

struct PredictKind {
  using start = hooks::on_predict_start;
  using epoch_start = hooks::on_predict_epoch_start;
  using batch_start = hooks::on_predict_batch_start;
  using batch_end = hooks::on_predict_batch_end;
  using epoch_end = hooks::on_predict_epoch_end;
  using end = hooks::on_predict_end;
  /// Predict logs nothing; its results are returned.
  static constexpr bool publishes = false;
  static constexpr const char* step_name = "predict_step";
  template <class M, class B>
  static auto step(M& m, B& b, Context& ctx) -> decltype(m.predict_step(b, ctx)) {
    return m.predict_step(b, ctx);
  }
};

/// Whether module `M` has the step of `Kind` for batches `B` (for `Batches<B...>`, several loaders': for each).
template <class Kind, class M, class B>
inline constexpr bool has_step = requires(M& m, B& b, Context& c) { Kind::step(m, b, c); };
template <class Kind, class M, class... B>
inline constexpr bool has_step<Kind, M, Batches<B...>> = (has_step<Kind, M, B> && ...);

}  // namespace volt::detail
