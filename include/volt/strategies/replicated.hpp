#pragma once
/// \file
/// `volt::Replicated`: the layout of `DataParallel` in which every rank holds every parameter, gradient and optimizer
/// state (`DDP`, strategies/ddp.hpp). Gradients are averaged across ranks by `detail::Reducer`: bucketed flat
/// all-reduces started during backward, on the micro-batch that steps only when gradients accumulate. Everything
/// else is one process's work: each rank steps the whole optimizer, and rank zero's archive is the checkpoint's.
///
/// A layout is a policy of `DataParallel<Layout, Launcher, Backend>` (strategies/data_parallel.hpp) with this shape:
///
/// | member | meaning |
/// |---|---|
/// | `static constexpr int stage` | what is sharded, as ZeRO's stages count: 0 nothing, 1 the optimizer state, 2 the gradients too |
/// | `static constexpr const char* name` | the strategy's name in messages (`DDP`, `ZeRO<1>`, ...) |
/// | `template <class Backend> class Holder` | what one rank holds under this layout and the work on it, over the collective backend `Backend` |
///
/// and a Holder has `setup_optimizer`, `zero_grad`, `pre_backward`, `post_backward`, `clip_gradients`,
/// `optimizer_step`, `optimizer_state` and `load_optimizer_state`, each a template taking the strategy `G` first
/// (it uses the strategy's public members only: `backend()`, `world_size()`, `global_rank()`, `is_global_zero()`,
/// `root_device()`, `all_reduce`, `module_parameters()`, `bucket_bytes()`), and `teardown()`, `gradient_bytes()`,
/// `bucket_layout()`. The strategy's members of the same names (strategies/concept.hpp) forward to them.

#include "volt/checkpoint.hpp"
#include "volt/optim/gradients.hpp"
#include "volt/options.hpp"
#include "volt/strategies/reducer.hpp"

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace volt {

/// Every rank holds everything: DDP.
struct Replicated {
  static constexpr int stage = 0;
  static constexpr const char* name = "DDP";

  template <class Backend>
  class Holder {
   public:
    template <class G>
    void setup_optimizer(G& /*strategy*/, torch::optim::Optimizer& /*optimizer*/) {}
    template <class G>
    void zero_grad(G& /*strategy*/, torch::optim::Optimizer& optimizer) { detail::zero_grad(optimizer); }
    /// `sync` arms the reducer's hooks (the micro-batch that steps); the reducer is made at a fit's first backward.
    template <class G>
    void pre_backward(G& g, bool sync) {
      if (!reducer_) {
        const auto [first, others] = g.bucket_bytes();
        reducer_ = std::make_unique<detail::Reducer<Backend>>(g.module_parameters(), g.backend(), g.world_size(),
                                                               first, others);
      }
      reducer_->prepare(sync);
    }
    /// Gradients averaged across ranks (after a synchronised backward).
    template <class G>
    void post_backward(G& /*strategy*/) { reducer_->finish(); }
    template <class G>
    void clip_gradients(G& /*strategy*/, const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm) {
      detail::clip_gradients(params, value, algorithm);
    }
    template <class G, class P>
    bool optimizer_step(G& /*strategy*/, P& precision, torch::optim::Optimizer& optimizer) {
      return precision.optimizer_step(optimizer);
    }
    /// Rank zero's archive (every rank's is the same); the other ranks make none.
    template <class G>
    at::Tensor optimizer_state(G& g, torch::optim::Optimizer& optimizer) {
      return g.is_global_zero() ? checkpoint::optimizer_state(optimizer) : at::Tensor();
    }
    template <class G>
    void load_optimizer_state(G& /*strategy*/, torch::optim::Optimizer& optimizer, const at::Tensor& bytes,
                              const std::string& path) {
      checkpoint::load_optimizer_state(optimizer, bytes, path);
    }
    /// After a fit: the gradient hooks removed, the bucket layout kept readable.
    void teardown() {
      if (reducer_) layout_ = reducer_->bucket_layout();
      reducer_.reset();
    }
    std::size_t gradient_bytes() const { return reducer_ ? reducer_->gradient_bytes() : 0; }
    std::vector<std::vector<std::size_t>> bucket_layout() const { return reducer_ ? reducer_->bucket_layout() : layout_; }

   private:
    std::unique_ptr<detail::Reducer<Backend>> reducer_;
    std::vector<std::vector<std::size_t>> layout_;
  };
};

}  // namespace volt
