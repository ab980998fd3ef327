#pragma once
/// \file
/// What is done to gradients between backward and the step, each written once: clearing them (`zero_grad`), and
/// clipping them.
///
/// Clipping, for every caller: the Trainer's `gradient_clip_val` (eager and graph mode),
/// a manual step's `ctx.clip_gradients`, and every strategy's `clip_gradients` (ZeRO's included).
///
/// By value, each gradient element is clamped to [-v, v]; by norm, each gradient is multiplied by
/// `min(1, max_norm / (total + 1e-6))`, `total` being the 2-norm of all of them. The arithmetic is LibTorch's
/// (`clip_grad_value_`, `clip_grad_norm_`: the per-tensor norms, the norm of their stack), op for op, so a
/// hand-written loop that calls LibTorch's gets the same bits; unlike LibTorch's, nothing is read back to the host,
/// so a captured step (graph mode) can hold it and an eager step does not wait for the device. Where each rank holds
/// a part of the gradients (ZeRO's pieces), the caller says how the per-tensor norms make the total over every rank.

#include "volt/options.hpp"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <type_traits>
#include <vector>

namespace volt::detail {

/// The total norm of gradients that are all here: LibTorch's (one tensor's norm, or the norm of the norms' stack);
/// undefined when there are none (nothing to clip). The coefficient multiplies each gradient as it is (LibTorch's).
struct LocalTotalNorm {
  static constexpr bool coefficient_in_grad_dtype = false;
  at::Tensor operator()(const std::vector<at::Tensor>& norms) const {
    if (norms.empty()) return {};
    return norms.size() == 1 ? norms[0] : at::stack(norms).norm(2.0);
  }
};

/// The dtype a total norm over several ranks sums its squares in: float64 where any of `params` is float64
/// (`Fp64True`: the sum as exact as the one-process norm of the norms' stack), else float32 (wider than bfloat16 and
/// float16). Read from the parameters, which every rank holds alike, not from this rank's gradients (a rank may hold
/// none), so every rank reduces the same dtype.
inline at::ScalarType squares_dtype(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    if (p.scalar_type() == at::kDouble) return at::kDouble;
  }
  return at::kFloat;
}

/// Clips the gradients of `params` (those that have one) by value or by their total norm (see the file comment).
/// `total` makes the total norm from the per-tensor 2-norms (undefined: nothing to clip); it is called on every rank,
/// also one without gradients, so that it may be a collective. Its `coefficient_in_grad_dtype` says whether the
/// coefficient is cast to each gradient's dtype before multiplying (ZeRO's, whose norm is in `squares_dtype`) or
/// multiplies as it is (LibTorch's).
template <class Total = LocalTotalNorm>
void clip_gradients(const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm, Total&& total = {}) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad().data());
  }
  if (algorithm == ClipAlgorithm::value) {
    for (auto& g : grads) g.clamp_(-value, value);
    return;
  }
  std::vector<at::Tensor> norms;
  norms.reserve(grads.size());
  for (const auto& g : grads) norms.push_back(g.norm(2.0));
  const at::Tensor norm = total(norms);
  if (!norm.defined()) return;
  const at::Tensor coef = at::clamp(value / (norm + 1e-6), c10::nullopt, 1.0);
  for (auto& g : grads) {
    if constexpr (std::remove_cvref_t<Total>::coefficient_in_grad_dtype) {
      g.mul_(coef.to(g.device(), g.scalar_type()));
    } else {
      g.mul_(coef);
    }
  }
}

/// The parameters an optimizer steps, in its groups' order.
inline std::vector<at::Tensor> optimizer_params(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) out.push_back(p);
  }
  return out;
}

/// Clears the gradients of `params`: each set to undefined (PyTorch's `set_to_none=True`: its memory is free for
/// the next forward), or, with `keep_tensors`, zeroed in place (graph mode, whose captured step writes into the
/// tensors it captured).
inline void zero_grad(const std::vector<at::Tensor>& params, bool keep_tensors) {
  std::vector<at::Tensor> grads;
  for (at::Tensor p : params) {
    if (!p.grad().defined()) continue;
    if (keep_tensors) {
      grads.push_back(p.grad());
    } else {
      p.mutable_grad() = at::Tensor();
    }
  }
  if (!grads.empty()) at::_foreach_zero_(grads);
}

/// Clears the gradients an optimizer steps, as its own `zero_grad` does on this LibTorch line: 2.x sets them to
/// undefined (its default, `set_to_none = true`); 1.13's optimizers only zero them in place, and so does volt there.
inline void zero_grad(const torch::optim::Optimizer& optimizer) {
  zero_grad(optimizer_params(optimizer), /*keep_tensors=*/TORCH_VERSION_MAJOR < 2);
}

}  // namespace volt::detail
