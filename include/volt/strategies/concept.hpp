#pragma once
/// \file
/// The Strategy kind: how many processes and devices a run uses and what that means for the module,
/// the data and the gradients. The Trainer owns one strategy object and calls the same members on every
/// strategy, never asking which one it holds; a strategy with nothing to do for a member makes it an identity
/// or a no-op. This table is every member volt calls:
///
/// | member | meaning |
/// |---|---|
/// | `static constexpr bool is_distributed` | more than one process may take part |
/// | `static constexpr const char* name` | for messages |
/// | `static constexpr bool shards_optimizer_state` | the strategy steps each rank's shard of the optimizer's state itself (ZeRO, FSDP, ModelParallel): rules.hpp refuses manual optimization and asks for an agreed inf check |
/// | `static constexpr bool averages_gradients` | the strategy averages the module's gradients over the ranks (a world of one trivially; ManualParallel: false, they are the module's business), so a token-weighted loss (`Context::weigh_loss`) can be weighed across ranks |
/// | `using backend_type` | the collective backend (`Mpi`, `Nccl`, `AutoBackend`), or `void` for none; rules.hpp checks it against the accelerator |
/// | `template <class A> using with_accelerator` (optional) | the strategy the Trainer runs on accelerator `A` (DDP resolves `AutoBackend` there); absent: the strategy itself |
/// | `check_devices(const TrainerOptions&, int available, const char* accelerator)` | phase (b): throw if `devices`/`num_nodes` cannot work |
/// | `launch(body) -> body's result` | runs the body of `validate`/`test`/`predict` in the process(es) that do the work |
/// | `launch(body, transfer&) -> body's result` | the same for `fit`; `transfer` packs rank 0's result where it is computed and unpacks it in the calling process (Spawn), see detail/fit_transfer.hpp |
/// | `setup_environment(torch::Device)` | process group, device selection (lazy: phase (c)) |
/// | `setup_module(torch::nn::Module&)` | places the module (and broadcasts it, in data parallelism) |
/// | `set_compute_dtype(std::optional<torch::Dtype>)` | after it, the precision's `compute_dtype`: FSDP gathers the parameters in it for each forward |
/// | `process_dataloader(loader, Stage) -> loader` | shards, wraps or returns the loader as it is |
/// | `module_state(const torch::nn::Module&, bool on_device) -> c10::Dict<std::string, at::Tensor>` | collective: the module's whole state (parameters and buffers by dotted name) for rank zero's checkpoint, empty on the other ranks; throws a `CheckpointError` where one file cannot hold the model (ManualParallel on several ranks); `on_device`: the tensors left where they are |
/// | `load_module_state(torch::nn::Module&, const checkpoint::Dict&)` | every rank loads such a whole state (checked against the module before) into what it holds |
/// | `global_rank()`, `local_rank()`, `world_size()`, `is_global_zero()` | this process's place |
/// | `root_device() -> torch::Device` | where batches go |
/// | `all_reduce(const torch::Tensor&, Reduce) -> torch::Tensor` | a reduced copy across ranks |
/// | `all_gather(const torch::Tensor&) -> torch::Tensor` | every rank's tensor stacked along a new first dimension |
/// | `broadcast_(const torch::Tensor&, int root)` | rank `root`'s tensor copied in place on every rank |
/// | `reduce_boolean_decision(bool, bool all) -> bool` | all ranks agree (all: every rank true; else any) |
/// | `barrier()` | every rank waits for the others |
/// | `host_max(int) -> int` | the largest value over the ranks, reduced on the host (no device synchronisation): the stop-signal agreement at each training batch |
/// | `host_all_gather(const std::string&) -> std::vector<std::string>` | every rank's bytes, in rank order, on every rank (predict's gathered results) |
/// | `pre_backward(bool sync)`, `post_backward()` | around each backward; `sync` is true on the micro-batch that steps |
/// | `setup_optimizer(torch::optim::Optimizer&)` | at each fit's start, once per optimizer `configure_optimizers` returned (ZeRO gives it this rank's pieces) |
/// | `zero_grad(torch::optim::Optimizer&)` | the gradients an optimizer steps, cleared (automatic optimization; a manual step's `opt.zero_grad()`) |
/// | `clip_gradients(params, value, ClipAlgorithm)` | the gradients of `params` clipped: `gradient_clip_val`, a manual step's `ctx.clip_gradients` (ZeRO: its pieces, the norm over every rank's) |
/// | `optimizer_step(Precision&, torch::optim::Optimizer&) -> bool` | the precision's step, and what follows it (ZeRO: the all-gather) |
/// | `optimizer_state(torch::optim::Optimizer&) -> at::Tensor` | collective: the optimizer's archive for rank zero's checkpoint (empty elsewhere) |
/// | `load_optimizer_state(torch::optim::Optimizer&, const at::Tensor&, path)` | loads such an archive (refused, unchanged, when it does not fit) |
/// | `forward_scope(Stage) -> ForwardScope` | held around each call of a step that runs the module's forward (training_step, validation_step, ...): FSDP gathers the root unit there |
/// | `finish_fit()` | after a fit that completed, before teardown (FSDP gathers the parameters back into the module) |
/// | `teardown()` | after a fit, also one that failed (validate, test and predict have none: they change nothing a fit set up) |
///
/// And the optional roles (volt/roles.hpp), each called where the strategy declares it in its `volt_roles` and
/// defaulted where it does not; a role declared and not met, or met and not declared, is a compile error naming it:
///
/// | role | members | default |
/// |---|---|---|
/// | `role::plans_parts` | `apply_plan(torch::nn::Module&, const ModelPlan&)`: after `setup_module`, what the module's `configure_model` planned (volt/model_plan.hpp) | the plan is not read |
/// | `role::writes_shards` | `state_dict_type() const -> StateDictType`; `state_slices() const -> std::vector<checkpoint::Slice>` (what this rank writes of the parameters); `full_param_groups(torch::optim::Optimizer&) -> std::vector<std::vector<at::Tensor>>` (its groups in the layout of an unsharded run) | checkpoints in the full form |
/// | `role::keeps_window_gradients` | `window_gradient(std::size_t j) -> at::Tensor`: collective, parameter `j`'s gradients of a running accumulation window where they are not in its `.grad` (FSDP), for a checkpoint | the `.grad` |
/// | `role::scatters_micro_batches` | `scatters_each_micro_batch() const -> bool`: each micro-batch's gradients are reduce-scattered as it ends (FSDP), which `Context::weigh_loss` with accumulation cannot follow | false |
/// | `role::shares_batches` (volt/context.hpp) | `data_all_reduce(const torch::Tensor&, Reduce) -> torch::Tensor` (what `sync_dist` reduces over) and `data_line() const -> std::vector<int>` (whose results predict gathers): ranks that share batches (a mesh's tensor or pipe axes) | `all_reduce`; every rank |
///
/// Writing your own: derive from `StrategyDefaults` (a world of one with no gradient work: its collectives
/// are identities, the backward hooks and teardown no-ops, no backend) and write the rest; copy `SingleDevice`
/// for a start. The phases (a), (b), (c) are defined in volt/rules.hpp.

#include "volt/checkpoint.hpp"
#include "volt/checkpoint/sharded.hpp"
#include "volt/context.hpp"
#include "volt/model_plan.hpp"
#include "volt/roles.hpp"
#include "volt/reduce.hpp"
#include "volt/stage.hpp"
#include "volt/detail/fit_transfer.hpp"
#include "volt/detail/torch_compat.hpp"
#include "volt/optim/gradients.hpp"
#include "volt/options.hpp"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <concepts>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace volt {

/// What a strategy does when a forward of the module ends (`Strategy::forward_scope`): `leave(backward_follows)`,
/// unless the forward ended with an exception (whose own message says more). A training step that returned no loss
/// says so (`no_backward`): nothing it gathered for backward is kept.
class ForwardScope {
 public:
  ForwardScope() = default;
  explicit ForwardScope(std::function<void(bool)> leave)
      : leave_(std::move(leave)), exceptions_(std::uncaught_exceptions()) {}
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
  ~ForwardScope() noexcept(false) {
    if (leave_ && std::uncaught_exceptions() == exceptions_) leave_(backward_follows_);
  }
  void no_backward() { backward_follows_ = false; }

 private:
  std::function<void(bool)> leave_;
  int exceptions_ = 0;
  bool backward_follows_ = true;
};

namespace detail {
/// A run body for the concept's probes.
struct ProbeBody {
  FitResult operator()() const { return {}; }
};
/// A transfer for the concept's probes (FitTransfer's shape).
struct ProbeTransfer {
  std::string pack(const FitResult&) const { return {}; }
  FitResult unpack(const std::string&) const { return {}; }
};
}  // namespace detail

template <class S>
concept Strategy = requires(S& s, const S& cs, const TrainerOptions& options, torch::nn::Module& m,
                            const torch::Tensor& t, std::vector<torch::Tensor>& loader,
                            detail::ProbeTransfer& transfer, torch::optim::Optimizer& optimizer,
                            const checkpoint::Dict& state) {
  { S::is_distributed } -> std::convertible_to<bool>;
  { S::name } -> std::convertible_to<const char*>;
  { S::averages_gradients } -> std::convertible_to<bool>;
  { S::shards_optimizer_state } -> std::convertible_to<bool>;
  typename S::backend_type;
  s.check_devices(options, 1, "CPU");
  s.launch(detail::ProbeBody{});
  s.launch(detail::ProbeBody{}, transfer);
  s.setup_environment(torch::Device(torch::kCPU));
  s.setup_module(m);
  s.set_compute_dtype(std::optional<torch::Dtype>());
  s.process_dataloader(loader, Stage::train);
  { s.module_state(m, false) } -> std::convertible_to<c10::Dict<std::string, at::Tensor>>;
  s.load_module_state(m, state);
  { cs.global_rank() } -> std::convertible_to<int>;
  { cs.local_rank() } -> std::convertible_to<int>;
  { cs.world_size() } -> std::convertible_to<int>;
  { cs.is_global_zero() } -> std::convertible_to<bool>;
  { cs.root_device() } -> std::convertible_to<torch::Device>;
  { s.all_reduce(t, Reduce::sum) } -> std::convertible_to<torch::Tensor>;
  { s.all_gather(t) } -> std::convertible_to<torch::Tensor>;
  s.broadcast_(t, 0);
  { s.reduce_boolean_decision(true, true) } -> std::convertible_to<bool>;
  s.barrier();
  { s.host_max(0) } -> std::convertible_to<int>;
  { s.host_all_gather(std::string()) } -> std::convertible_to<std::vector<std::string>>;
  s.pre_backward(true);
  s.post_backward();
  s.setup_optimizer(optimizer);
  s.zero_grad(optimizer);
  s.clip_gradients(std::vector<at::Tensor>{}, 1.0, ClipAlgorithm::norm);
  { s.optimizer_state(optimizer) } -> std::convertible_to<at::Tensor>;
  s.load_optimizer_state(optimizer, t, std::string());
  { s.forward_scope(Stage::train) } -> std::same_as<ForwardScope>;
  s.finish_fit();
  s.teardown();
};

namespace detail {
/// Whether strategy `S` shards the optimizer's state (ZeRO): it then steps the optimizer itself, automatically.
template <class S>
inline constexpr bool shards_optimizer_state = S::shards_optimizer_state;
}  // namespace detail

namespace role {
/// The strategy reads the module's plan of parts: `apply_plan(torch::nn::Module&, const ModelPlan&)`.
struct plans_parts {
  template <class S>
  static constexpr bool met = requires(S& s, torch::nn::Module& m, const ModelPlan& plan) { s.apply_plan(m, plan); };
};
/// The strategy may write the sharded checkpoint form (checkpoint/sharded.hpp): `state_dict_type() const`,
/// `state_slices() const`, `full_param_groups(torch::optim::Optimizer&)`.
struct writes_shards {
  template <class S>
  static constexpr bool met = requires(S& s, const S& cs, torch::optim::Optimizer& o) {
    { cs.state_dict_type() } -> std::same_as<StateDictType>;
    { cs.state_slices() } -> std::same_as<std::vector<checkpoint::Slice>>;
    { s.full_param_groups(o) } -> std::same_as<std::vector<std::vector<at::Tensor>>>;
  };
};
/// The strategy keeps a running accumulation window's gradients outside `.grad`: `window_gradient(std::size_t)`.
struct keeps_window_gradients {
  template <class S>
  static constexpr bool met = requires(S& s) {
    { s.window_gradient(std::size_t{0}) } -> std::same_as<at::Tensor>;
  };
};
/// The strategy reduce-scatters each micro-batch's gradients as it ends: `scatters_each_micro_batch() const`.
struct scatters_micro_batches {
  template <class S>
  static constexpr bool met = requires(const S& s) {
    { s.scatters_each_micro_batch() } -> std::same_as<bool>;
  };
};
}  // namespace role

namespace detail {
/// Every optional role of strategy `S` checked (a compile error naming the role where one is declared and not met, or
/// met and not declared); the Trainer checks it where it is made.
template <class S>
constexpr bool check_strategy_roles() {
  VOLT_DETAIL_CHECK_ROLE(plans_parts, "strategy", S, S);
  VOLT_DETAIL_CHECK_ROLE(writes_shards, "strategy", S, S);
  VOLT_DETAIL_CHECK_ROLE(keeps_window_gradients, "strategy", S, S);
  VOLT_DETAIL_CHECK_ROLE(scatters_micro_batches, "strategy", S, S);
  VOLT_DETAIL_CHECK_ROLE(shares_batches, "strategy", S, S);
  return true;
}
}  // namespace detail

/// The members a strategy without processes or gradient work shares: one rank's collectives, no backend,
/// no-op backward hooks and teardown. A strategy that derives from it redefines what differs.
struct StrategyDefaults {
  using backend_type = void;
  static constexpr bool averages_gradients = true;
  static constexpr bool shards_optimizer_state = false;

  /// A world of one: the module's state (checkpoint::module_state).
  c10::Dict<std::string, at::Tensor> module_state(const torch::nn::Module& module, bool on_device) {
    return checkpoint::module_state(module, on_device);
  }
  /// Parameters used as they are stored.
  void set_compute_dtype(std::optional<torch::Dtype> /*dtype*/) {}
  /// A world of one: the state copied into the module (checkpoint::load_module_state).
  void load_module_state(torch::nn::Module& module, const checkpoint::Dict& state) {
    checkpoint::load_module_state(module, state);
  }

  /// A world of one: this rank's tensor, stacked.
  torch::Tensor all_gather(const torch::Tensor& t) { return t.detach().unsqueeze(0).clone(); }
  /// A world of one: nothing to copy.
  void broadcast_(const torch::Tensor& /*t*/, int /*root*/ = 0) {}
  /// A world of one: its own value.
  int host_max(int value) { return value; }
  /// A world of one: its own bytes.
  std::vector<std::string> host_all_gather(const std::string& bytes) { return {bytes}; }
  void pre_backward(bool /*sync*/) {}
  void post_backward() {}
  void setup_optimizer(torch::optim::Optimizer& /*optimizer*/) {}
  void zero_grad(torch::optim::Optimizer& optimizer) { detail::zero_grad(optimizer); }
  /// The gradients of `params` clipped in place (optim/gradients.hpp: LibTorch's arithmetic, nothing read on the host).
  void clip_gradients(const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm) {
    detail::clip_gradients(params, value, algorithm);
  }
  /// The precision's step (false: skipped for an inf/NaN).
  template <class P>
  bool optimizer_step(P& precision, torch::optim::Optimizer& optimizer) {
    return precision.optimizer_step(optimizer);
  }
  /// A world of one: the optimizer's archive.
  at::Tensor optimizer_state(torch::optim::Optimizer& optimizer) { return checkpoint::optimizer_state(optimizer); }
  void load_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& bytes, const std::string& path) {
    checkpoint::load_optimizer_state(optimizer, bytes, path);
  }
  /// A forward needs nothing of a strategy whose ranks hold every parameter.
  ForwardScope forward_scope(Stage /*stage*/) { return ForwardScope(); }
  void finish_fit() {}
  void teardown() {}
};

}  // namespace volt
