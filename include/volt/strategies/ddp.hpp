#pragma once
/// \file
/// `volt::DDP<Launcher, Backend>`: data parallelism, as Lightning's `ddp` / `ddp_spawn` and PyTorch's
/// DistributedDataParallel.
///  - set-up: the module moves to the rank's device and rank 0's parameters and buffers are broadcast;
///  - data: `process_dataloader` shards a loader that offers `shard(rank, world_size)` (volt's loaders do:
///    for training one seeded permutation per epoch shared by every rank, padded so every rank gets the same
///    number of batches, as PyTorch's DistributedSampler; for evaluation and prediction the one-process batches
///    dealt out in turn, no sample twice, as Lightning's unrepeated sampler); a loader without it is used as it
///    is, and a note says so;
///  - gradients: averaged across ranks by `detail::Reducer` (bucketed flat all-reduces started during
///    backward), only on the micro-batch that steps when gradients accumulate;
///  - logging with sync_dist, stop decisions and checkpoints follow the base strategy's collectives.
/// The backend defaults to `AutoBackend`: Nccl on GPU, Mpi on CPU.
///
/// \code
///   volt::Trainer<volt::DDP<volt::Spawn>, volt::Bf16Mixed, volt::GPU> trainer({.devices = 4});
///   volt::Trainer<volt::DDP<volt::Script, volt::Mpi>, volt::Fp32, volt::CPU> cpu({.devices = 2});
/// \endcode

#include "volt/data/concept.hpp"
#include "volt/strategies/reducer.hpp"
#include "volt/launchers/script.hpp"
#include "volt/launchers/spawn.hpp"
#include "volt/strategies/concept.hpp"
#include "volt/strategies/process_group.hpp"

#include <torch/nn/module.h>

#include <iostream>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

template <class L = Script, class B = AutoBackend>
class DDP : public detail::ProcessGroupStrategy<L, B> {
  using Base = detail::ProcessGroupStrategy<L, B>;

 public:
  static constexpr const char* name = "DDP";
  /// The strategy the Trainer runs for accelerator `A` (the backend resolved).
  template <class A>
  using with_accelerator = DDP<L, resolve_backend_t<B, A>>;

  DDP() { this->spec_.strategy = "DDP"; }

  /// Moves the module and makes every rank start from rank 0's parameters and buffers. The reducer is not touched:
  /// DDP's ended with the last fit (teardown), and ZeRO's stays with its layout until its next fit.
  void setup_module(torch::nn::Module& module) {
    module.to(this->device_);
    torch::NoGradGuard no_grad;
    for (auto& p : module.parameters()) this->backend().broadcast_(p, 0);
    for (auto& b : module.buffers()) this->backend().broadcast_(b, 0);
    params_ = module.parameters();
  }

  /// Shards loaders that can be sharded: for training, one per-epoch permutation on every rank, padded; for
  /// evaluation and prediction, the one-process batches dealt out in turn where the loader can (no sample twice,
  /// so means are over the real samples and predict's gathered results are the one-process results; a rank may get
  /// none).
  template <class Loader>
  decltype(auto) process_dataloader(Loader&& loader, Stage stage) {
    if constexpr (data::SplittableLoader<std::remove_cvref_t<Loader>>) {
      const auto split = stage == Stage::train ? data::Split::padded_samples : data::Split::whole_batches;
      // Fewer evaluation batches than ranks leave some ranks none: they take part in the epoch's reductions with
      // empty sums (connectors/logger_connector.hpp), as Lightning runs such a loader.
      return loader.shard(this->global_rank(), this->world_size(), split);
    } else if constexpr (requires { loader.shard(0, 1); }) {
      if (stage != Stage::train) warn_once("a loader without shard(rank, world_size, volt::data::Split) is split for "
                                           "evaluation as for training: padded, so some samples count twice.");
      return loader.shard(this->global_rank(), this->world_size());
    } else {
      warn_once("DDP was given a loader without shard(rank, world_size); every rank iterates all of it. Shard it "
                "yourself, or use volt::data's loaders.");
      return std::forward<Loader>(loader);
    }
  }

  /// Gradient bucket sizes in bytes (PyTorch's defaults: 1 MiB for the first bucket, 25 MiB for the rest).
  /// Takes effect at the next fit.
  void set_bucket_bytes(std::size_t first_bucket, std::size_t other_buckets) {
    if (first_bucket == 0 || other_buckets == 0) {
      throw ConfigError("volt: DDP bucket sizes must be positive, got first=" + std::to_string(first_bucket) +
                        " and others=" + std::to_string(other_buckets) + " bytes.");
    }
    first_bucket_bytes_ = first_bucket;
    bucket_bytes_ = other_buckets;
  }

  /// Before a backward: `sync` is true on the micro-batch that steps (the others only accumulate).
  void pre_backward(bool sync) {
    if (!reducer_) reducer_ = std::make_unique<detail::Reducer<B>>(params_, this->backend(), this->world_size(),
                                                                 first_bucket_bytes_, bucket_bytes_);
    reducer_->prepare(sync);
  }
  /// After it: gradients averaged across ranks.
  void post_backward() { reducer_->finish(); }
  /// After a run: gradient hooks removed (the bucket layout stays readable).
  void teardown() {
    if (reducer_) layout_ = reducer_->bucket_layout();
    reducer_.reset();
  }

  /// Bytes of gradients this rank holds between steps, during a fit: the module's `.grad` and the reducer's buffers
  /// (ZeRO<2>: its blocks); not the optimizer's state.
  std::size_t gradient_bytes() const { return reducer_ ? reducer_->gradient_bytes() : 0; }

  /// The gradient buckets of the running or last fit (parameter indices in fill order); empty before the
  /// first backward.
  std::vector<std::vector<std::size_t>> bucket_layout() const { return reducer_ ? reducer_->bucket_layout() : layout_; }

 protected:
  void warn_once(const char* what) {
    if (!warned_ && this->is_global_zero() && this->world_size() > 1) {
      warned_ = true;
      std::cerr << "volt: " << what << "\n";
    }
  }
  std::vector<torch::Tensor> params_;
  /// The gradients' reducer, the one of DDP and of ZeRO (which makes it with its own GradSync in setup_optimizer).
  std::unique_ptr<detail::Reducer<B>> reducer_;
  std::vector<std::vector<std::size_t>> layout_;
  std::size_t first_bucket_bytes_ = detail::kFirstBucketBytes;
  std::size_t bucket_bytes_ = detail::kBucketBytes;
  bool warned_ = false;
};

}  // namespace volt
