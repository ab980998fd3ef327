#pragma once
/// \file
/// `volt::DataParallel<Layout, Launcher, Backend>`: data parallelism, with what each rank holds of the parameters,
/// gradients and optimizer state as a policy (`Layout`). `DDP` (strategies/ddp.hpp) is `DataParallel<Replicated>`
/// and `ZeRO<Stage>` (strategies/zero.hpp) is `DataParallel<Sharded<Stage>>`, as ensmallen's `Adam` is
/// `AdamType<AdamUpdate>`: one strategy, several names.
///
/// What every layout shares is here: the process group (`detail::ProcessGroupStrategy`: launcher, ranks,
/// collectives), the module's set-up (moved to the rank's device, rank 0's parameters and buffers broadcast),
/// the loaders' sharding, and the gradient buckets' sizes. What differs (the gradient hooks, what the optimizer
/// steps, what a checkpoint gathers) is the layout's `Holder` (strategies/replicated.hpp says its shape), to which the
/// strategy's members forward, handing it the strategy; a layout reaches the strategy through its public members only.

#include "volt/checkpoint/optimizer_state.hpp"
#include "volt/data/concept.hpp"
#include "volt/launchers/script.hpp"
#include "volt/launchers/spawn.hpp"
#include "volt/strategies/concept.hpp"
#include "volt/strategies/process_group.hpp"
#include "volt/strategies/reducer.hpp"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <iostream>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

namespace detail {

/// A data-parallel strategy's loader for `stage` on rank `rank` of `world`: for training, one per-epoch permutation on
/// every rank, padded; for evaluation and prediction, the one-process batches dealt out in turn where the loader can
/// (no sample twice, so means are over the real samples and predict's gathered results are the one-process results; a
/// rank may get none). `pad_evaluation` (the parameters are sharded, so every forward is a collective): evaluation is
/// padded as training is, every rank running as many batches, the last ones repeating the first samples (as PyTorch's
/// DistributedSampler). A loader that cannot be sharded so is said once (`warned`), naming `strategy`.
template <class Loader>
decltype(auto) data_parallel_loader(Loader&& loader, Stage stage, int rank, int world, bool pad_evaluation,
                                    const char* strategy, bool& warned) {
  const auto warn_once = [&](const char* what) {
    if (!warned && rank == 0 && world > 1) {
      warned = true;
      std::cerr << "volt: " << strategy << what << "\n";
    }
  };
  if constexpr (data::SplittableLoader<std::remove_cvref_t<Loader>>) {
    const bool padded = stage == Stage::train || pad_evaluation;
    const auto split = padded ? data::Split::padded_samples : data::Split::whole_batches;
    // Fewer evaluation batches than ranks leave some ranks none: they take part in the epoch's reductions with
    // empty sums (connectors/logger_connector.hpp), as Lightning runs such a loader.
    return loader.shard(rank, world, split);
  } else if constexpr (requires { loader.shard(0, 1); }) {
    if (stage != Stage::train) warn_once(": a loader without shard(rank, world_size, volt::data::Split) is split for "
                                         "evaluation as for training: padded, so some samples count twice.");
    return loader.shard(rank, world);
  } else {
    warn_once(" was given a loader without shard(rank, world_size); every rank iterates all of it. Shard it yourself, "
              "or use volt::data's loaders.");
    return std::forward<Loader>(loader);
  }
}

}  // namespace detail

template <class Layout, class L = Script, class B = AutoBackend>
class DataParallel : public detail::ProcessGroupStrategy<L, B> {
 public:
  using layout_type = Layout;
  static constexpr const char* name = Layout::name;
  /// Whether the optimizer steps this rank's pieces only (rules.hpp: no manual optimization, agreed inf checks).
  static constexpr bool shards_optimizer_state = Layout::stage > 0;
  /// The strategy the Trainer runs for accelerator `A` (the backend resolved).
  template <class A>
  using with_accelerator = DataParallel<Layout, L, resolve_backend_t<B, A>>;

  DataParallel() : detail::ProcessGroupStrategy<L, B>(name) {}

  /// Moves the module and makes every rank start from rank 0's parameters and buffers. The layout is not touched:
  /// DDP's reducer ended with the last fit (teardown), and ZeRO's layout stays until its next fit.
  void setup_module(torch::nn::Module& module) {
    this->replicate_from_rank_zero(module);
    params_ = module.parameters();
  }

  /// Shards loaders that can be sharded (detail::data_parallel_loader); evaluation padded where the parameters are
  /// sharded (FSDP), every forward being a collective.
  template <class Loader>
  decltype(auto) process_dataloader(Loader&& loader, Stage stage) {
    return detail::data_parallel_loader(std::forward<Loader>(loader), stage, this->global_rank(), this->world_size(),
                                        /*pad_evaluation=*/Layout::stage == 3, name, warned_);
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
  /// The first bucket's size and the others', in bytes.
  std::pair<std::size_t, std::size_t> bucket_bytes() const { return {first_bucket_bytes_, bucket_bytes_}; }
  /// The module's parameters, as the last `setup_module` found them.
  const std::vector<torch::Tensor>& module_parameters() const { return params_; }

  void setup_optimizer(torch::optim::Optimizer& optimizer) { holder_.setup_optimizer(*this, optimizer); }
  void zero_grad(torch::optim::Optimizer& optimizer) { holder_.zero_grad(*this, optimizer); }
  /// Before a backward: `sync` is true on the micro-batch that steps (the others only accumulate).
  void pre_backward(bool sync) { holder_.pre_backward(*this, sync); }
  /// After it: gradients averaged across ranks (each rank's share of them, where the layout shards them).
  void post_backward() { holder_.post_backward(*this); }
  void clip_gradients(const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm) {
    holder_.clip_gradients(*this, params, value, algorithm);
  }
  template <class P>
  bool optimizer_step(P& precision, torch::optim::Optimizer& optimizer) {
    return holder_.optimizer_step(*this, precision, optimizer);
  }
  /// Collective: the optimizer's archive for rank zero's checkpoint, in the layout of an unsharded run.
  at::Tensor optimizer_state(torch::optim::Optimizer& optimizer) { return holder_.optimizer_state(*this, optimizer); }
  /// Loads an archive of any data-parallel layout and world size (refused, unchanged, when it does not fit).
  void load_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& bytes, const std::string& path) {
    holder_.load_optimizer_state(*this, optimizer, bytes, path);
  }
  /// FSDP: the root unit gathered for the forward (the layout's `forward_scope`); nothing for the other layouts.
  ForwardScope forward_scope(Stage stage) {
    if constexpr (requires { holder_.forward_scope(*this, stage); }) {
      return holder_.forward_scope(*this, stage);
    } else {
      return ForwardScope();
    }
  }
  /// FSDP: the parameters gathered back into the module, so that it is whole on every rank after the fit.
  void finish_fit() {
    if constexpr (requires { holder_.finish_fit(*this); }) holder_.finish_fit(*this);
  }
  void teardown() { holder_.teardown(); }

  /// FSDP: whether a unit's parameters are freed after its forward (default) or kept until its backward (more memory,
  /// one all-gather fewer per unit and step). Takes effect at the next fit.
  void set_reshard_after_forward(bool reshard) { reshard_after_forward_ = reshard; }
  bool reshard_after_forward() const { return reshard_after_forward_; }
  /// FSDP: whether every micro-batch of an accumulation window has its gradients reduce-scattered into this rank's
  /// shards (default: no rank holds a window's unsharded gradients, at one reduce-scatter per unit and micro-batch), or
  /// only the last, the others accumulating in the module's `.grad` as DDP's do (needed by `Context::weigh_loss` with
  /// accumulation). FSDP2's `set_requires_gradient_sync`. Takes effect at the next fit.
  void set_sync_every_micro_batch(bool every) { sync_every_micro_batch_ = every; }
  bool sync_every_micro_batch() const { return sync_every_micro_batch_; }
  /// Whether each micro-batch's gradients are reduce-scattered as it ends (FSDP syncing every micro-batch).
  bool scatters_each_micro_batch() const { return Layout::stage == 3 && sync_every_micro_batch_; }
  /// FSDP: the dtype the units' parameters are gathered in for each forward (none: as stored); the Trainer sets the
  /// precision's `compute_dtype` (Bf16Mixed: bfloat16). Takes effect at the next fit.
  void set_compute_dtype(std::optional<torch::Dtype> dtype) { compute_dtype_ = dtype; }
  std::optional<torch::Dtype> compute_dtype() const { return compute_dtype_; }
  /// FSDP: the module's whole state gathered unit by unit, on rank zero (elsewhere empty).
  c10::Dict<std::string, at::Tensor> module_state(const torch::nn::Module& module, bool on_device) {
    if constexpr (requires { holder_.module_state(*this, module, on_device); }) {
      return holder_.module_state(*this, module, on_device);
    } else {
      return detail::ProcessGroupStrategy<L, B>::module_state(module, on_device);
    }
  }
  /// FSDP, collective: parameter `j`'s gradients of the running accumulation window, where they are not in its `.grad`
  /// (each micro-batch reduce-scattered): their average so far, for a checkpoint; undefined elsewhere.
  at::Tensor window_gradient(std::size_t j) {
    if constexpr (requires { holder_.window_gradient(*this, j); }) {
      return holder_.window_gradient(*this, j);
    } else {
      return at::Tensor();
    }
  }
  /// How checkpoints are written (Lightning's `state_dict_type`): one file from rank zero (`full`, the default; FSDP
  /// gathers it unit by unit), or a folder of every rank's pieces written at once (`sharded`: no rank holds more than
  /// its share; volt/checkpoint/sharded.hpp). Both resume on any world size and any data-parallel layout.
  void set_state_dict_type(StateDictType type) { state_dict_type_ = type; }
  StateDictType state_dict_type() const { return state_dict_type_; }
  /// What this rank writes of the parameters into a sharded checkpoint: its pieces (ZeRO, FSDP), or where every rank
  /// holds a parameter, a near-equal part of it.
  std::vector<checkpoint::Slice> state_slices() const {
    if constexpr (requires { holder_.state_slices(*this); }) {
      return holder_.state_slices(*this);
    } else {
      return checkpoint::replicated_slices(params_, this->global_rank(), this->world_size());
    }
  }
  /// `optimizer`'s groups in the layout of an unsharded run (ZeRO: the module's parameters, not this rank's pieces).
  std::vector<std::vector<at::Tensor>> full_param_groups(torch::optim::Optimizer& optimizer) const {
    if constexpr (requires { holder_.full_param_groups(optimizer); }) return holder_.full_param_groups(optimizer);
    return detail::param_lists(optimizer);
  }
  /// FSDP: each rank keeps its shard of the whole state given.
  void load_module_state(torch::nn::Module& module, const checkpoint::Dict& state) {
    if constexpr (requires { holder_.load_module_state(*this, module, state); }) {
      holder_.load_module_state(*this, module, state);
    } else {
      detail::ProcessGroupStrategy<L, B>::load_module_state(module, state);
    }
  }

  /// Bytes of gradients this rank holds between steps, during a fit: the module's `.grad` and the layout's buffers;
  /// not the optimizer's state.
  std::size_t gradient_bytes() const { return holder_.gradient_bytes(); }
  /// Bytes of parameters this rank holds now (FSDP: its shards and the units gathered at this moment).
  std::size_t parameter_bytes() const {
    if constexpr (requires { holder_.parameter_bytes(); }) {
      return holder_.parameter_bytes();
    } else {
      std::size_t bytes = 0;
      for (const auto& p : params_) bytes += detail::bytes_of(p);
      return bytes;
    }
  }
  /// The gradient buckets of the running or last fit (parameter indices in fill order); empty before the first
  /// backward.
  std::vector<std::vector<std::size_t>> bucket_layout() const { return holder_.bucket_layout(); }

 private:
  std::vector<torch::Tensor> params_;
  typename Layout::template Holder<B> holder_;
  std::size_t first_bucket_bytes_ = detail::kFirstBucketBytes;
  std::size_t bucket_bytes_ = detail::kBucketBytes;
  bool reshard_after_forward_ = true;
  bool sync_every_micro_batch_ = true;
  StateDictType state_dict_type_ = StateDictType::full;
  std::optional<torch::Dtype> compute_dtype_;
  bool warned_ = false;
};

}  // namespace volt
