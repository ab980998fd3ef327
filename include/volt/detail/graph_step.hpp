#pragma once
/// \file
/// What graph mode (`Graphed<...>`, volt/accelerators/graphed.hpp) keeps across a fit: the captured variants of
/// the training step, the static batch they read, the log calls they make, and the gradients they zero; and the
/// gradient clipping that reads nothing on the host.

#include "volt/batch.hpp"
#include "volt/context.hpp"

#include <ATen/ATen.h>
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace volt::detail {

/// Clips gradients to a total 2-norm of `max_norm` with LibTorch's arithmetic (`clip_grad_norm_`: per-tensor norms,
/// the norm of their stack, the coefficient `max_norm / (norm + 1e-6)` clamped to 1), without reading the norm back.
inline void clip_grad_norm_on_device(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads, norms;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(g.data().norm(2.0));
  const at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2.0);
  const at::Tensor coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
  for (auto& g : grads) g.data().mul_(coef);
}

/// The tensors inside a batch, in the order `map_tensors` visits them.
template <class B>
std::vector<at::Tensor> tensors_of(const B& batch) {
  std::vector<at::Tensor> out;
  (void)map_tensors(batch, [&](const at::Tensor& t) {
    out.push_back(t);
    return t;
  });
  return out;
}

inline std::string shapes_text(const std::vector<at::Tensor>& tensors) {
  std::ostringstream s;
  for (std::size_t i = 0; i < tensors.size(); ++i) s << (i ? ", " : "") << tensors[i].sizes();
  return s.str();
}

/// The graph state of a fit, whatever its batch type (the Trainer holds it through this base).
struct GraphedStepsBase {
  virtual ~GraphedStepsBase() = default;
};

/// Graph mode's state for graph type `G` and batch type `B`. A step is one of four variants, by whether it starts
/// an accumulation window (zeroes the gradients) and whether it ends one (steps the optimizer): index
/// `2 * starts + steps`. Each is captured the first time it is needed, all from one memory pool.
template <class G, class B>
struct GraphedSteps final : GraphedStepsBase {
  /// Runs the warm-up steps; its stream is the one captures use.
  G warm;
  std::array<G, 4> graphs;
  std::array<bool, 4> captured{};
  /// What `ctx.log` recorded in each variant's `training_step`.
  std::array<LogRecorder, 4> logs;
  /// Each variant's loss (its output, rewritten by every replay).
  std::array<at::Tensor, 4> loss;
  /// The batch the graphs read, on the device, and its tensors in map order.
  std::optional<B> inputs;
  std::vector<at::Tensor> input_tensors;
  /// Eager batches run before the first capture.
  int64_t warm_batches = 0;

  static constexpr int variant(bool starts, bool steps) { return (starts ? 2 : 0) + (steps ? 1 : 0); }

  /// The graph a new capture shares memory with: one captured before, or the warm-up's (same stream, new pool).
  const G* shared() const {
    for (std::size_t v = 0; v < graphs.size(); ++v) {
      if (captured[v]) return &graphs[v];
    }
    return &warm;
  }

  /// Whether `batch` has the tensors, shapes and dtypes-to-be of the static batch (true before there is one).
  bool fits(const B& batch) const {
    if (!inputs) return true;
    const std::vector<at::Tensor> given = tensors_of(batch);
    if (given.size() != input_tensors.size()) return false;
    for (std::size_t i = 0; i < given.size(); ++i) {
      if (given[i].sizes() != input_tensors[i].sizes()) return false;
    }
    return true;
  }

  /// Copies `batch` into the static batch (made from `prepared`, the batch as a step would see it, the first time).
  template <class Prepare>
  void copy_in(const B& batch, Prepare&& prepare) {
    if (!inputs) {
      inputs.emplace(map_tensors(prepare(batch), [](const at::Tensor& t) { return t.clone(); }));
      input_tensors = tensors_of(*inputs);
      return;
    }
    const std::vector<at::Tensor> given = tensors_of(batch);
    for (std::size_t i = 0; i < given.size(); ++i) input_tensors[i].copy_(given[i], /*non_blocking=*/true);
  }
};

}  // namespace volt::detail
