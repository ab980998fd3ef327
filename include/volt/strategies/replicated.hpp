#pragma once
/// \file
/// `volt::Replicated`: the layout in which every rank holds every parameter, gradient and optimizer
/// state (`DDP`, strategies/ddp.hpp). Gradients are averaged across ranks by `detail::Reducer`: bucketed flat
/// all-reduces started during backward, on the micro-batch that steps only when gradients accumulate. Everything
/// else is one process's work: each rank steps the whole optimizer, and rank zero's archive is the checkpoint's.
///
/// A layout (strategies/layout.hpp says the kind) with its options: `DDP`'s default part is `Replicated{}`, and
/// `trainer.strategy().layout()` is it.

#include "volt/checkpoint.hpp"
#include "volt/optim/gradients.hpp"
#include "volt/options.hpp"
#include "volt/strategies/layout.hpp"
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
  using volt_roles = Roles<>;
  /// The gradient buckets' sizes in bytes (PyTorch's defaults: 1 MiB for the first bucket, 25 MiB for the rest).
  std::size_t first_bucket_bytes = detail::kFirstBucketBytes;
  std::size_t bucket_bytes = detail::kBucketBytes;

  template <class Backend>
  class Holder {
   public:
    template <class G>
    void setup_optimizer(G& /*part*/, torch::optim::Optimizer& /*optimizer*/) {}
    template <class G>
    void zero_grad(G& /*part*/, torch::optim::Optimizer& optimizer) { detail::zero_grad(optimizer); }
    /// `sync` arms the reducer's hooks (the micro-batch that steps); the reducer is made at a fit's first backward.
    template <class G>
    void pre_backward(G& g, bool sync) {
      if (!reducer_) {
        reducer_ = std::make_unique<detail::Reducer<Backend>>(g.module_parameters(), g.backend(), g.world_size(),
                                                               g.layout().first_bucket_bytes, g.layout().bucket_bytes);
      }
      reducer_->prepare(sync);
    }
    /// Gradients averaged across ranks (after a synchronised backward).
    template <class G>
    void post_backward(G& /*part*/) { reducer_->finish(); }
    /// Rank zero's archive (every rank's is the same); the other ranks make none.
    template <class G>
    at::Tensor optimizer_state(G& g, torch::optim::Optimizer& optimizer) {
      return g.is_global_zero() ? checkpoint::optimizer_state(optimizer) : at::Tensor();
    }
    template <class G>
    void load_optimizer_state(G& /*part*/, torch::optim::Optimizer& optimizer, const at::Tensor& bytes,
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
