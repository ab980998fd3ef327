#pragma once
/// \file
/// `volt::optim::SGD`: LibTorch's `torch::optim::SGD` (momentum, dampening, Nesterov, weight decay; same options,
/// state and archives) whose step is one `at::_fused_sgd_` per parameter group, device and dtype (see
/// volt/optim/fused.hpp).

#include "volt/optim/fused.hpp"

#include <torch/optim/sgd.h>

#include <memory>
#include <vector>

namespace volt::optim {

/// Stochastic gradient descent with LibTorch's `SGDOptions`; the momentum buffer is made on a parameter's first
/// step from its gradient (weight decay included), as LibTorch and PyTorch make it.
class SGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;

  /// One step of every parameter that has a gradient. Returns the closure's loss, as LibTorch's step does.
  at::Tensor step(LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    at::Tensor loss = detail::run_closure(closure);
    if (!detail::fused_applies(*this)) {
      torch::optim::SGD::step();
      return loss;
    }
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      const bool momentum = o.momentum() != 0;
      // Parameters stepping for the first time (no buffer yet) go to buckets of their own: the kernel takes
      // "first step" for a whole list.
      std::vector<detail::Bucket> buckets, first;
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        if (!momentum) {
          auto& b = detail::bucket_for(buckets, p);
          b.params.push_back(p);
          b.grads.push_back(p.grad());
          continue;
        }
        auto& s = detail::state_of<torch::optim::SGDParamState>(
            *this, p, [] { return std::make_unique<torch::optim::SGDParamState>(); });
        const bool is_first = !s.momentum_buffer().defined();
        if (is_first) s.momentum_buffer(at::empty_like(p, at::MemoryFormat::Preserve));
        auto& b = detail::bucket_for(is_first ? first : buckets, p);
        b.params.push_back(p);
        b.grads.push_back(p.grad());
        b.a.push_back(s.momentum_buffer());
      }
      for (auto& b : buckets) kernel(b, o, /*is_first_step=*/false);
      for (auto& b : first) kernel(b, o, /*is_first_step=*/true);
    }
    return loss;
  }

 private:
  static void kernel(detail::Bucket& b, const torch::optim::SGDOptions& o, bool is_first_step) {
    volt::detail::fused_sgd(b.params, b.grads, b.a, o.weight_decay(), o.momentum(), o.lr(), o.dampening(), o.nesterov(),
                            /*maximize=*/false, is_first_step);
  }
};

}  // namespace volt::optim
