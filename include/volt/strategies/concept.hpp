#pragma once
/// \file
/// The Strategy kind: how many processes and devices a run uses and what that means for the module,
/// the data and the gradients. The Trainer owns one strategy object and calls the same hooks on every
/// strategy; a strategy with nothing to do for a hook makes it an identity or a no-op.
///
/// | member | meaning |
/// |---|---|
/// | `static constexpr bool is_distributed` | more than one process may take part |
/// | `static constexpr const char* name` | for messages |
/// | `check_devices(const TrainerOptions&, int available, const char* accelerator)` | phase (b): throw if `devices`/`num_nodes` cannot work |
/// | `launch(fn) -> fn's result` | runs the body of `fit`/`validate`/... in the process(es) that do the work |
/// | `setup_environment(torch::Device)` | process group, device selection (lazy: phase (c)) |
/// | `setup_module(torch::nn::Module&)` | places the module (and broadcasts it, in data parallelism) |
/// | `process_dataloader(loader, Stage) -> loader` | shards, wraps or returns the loader as it is |
/// | `global_rank()`, `local_rank()`, `world_size()`, `is_global_zero()` | this process's place |
/// | `root_device() -> torch::Device` | where batches go |
/// | `all_reduce(const torch::Tensor&, Reduce) -> torch::Tensor` | a reduced copy across ranks |
/// | `reduce_boolean_decision(bool, bool all) -> bool` | all ranks agree (all: every rank true; else any) |
/// | `barrier()` | every rank waits for the others |
///
/// Writing your own: a class with these members (copy `SingleDevice` and change what differs).

#include "volt/context.hpp"
#include "volt/options.hpp"

#include <torch/nn/module.h>
#include <torch/types.h>

#include <concepts>
#include <vector>

namespace volt {

namespace detail {
struct ProbeBody {
  void operator()() const {}
};
}  // namespace detail

template <class S>
concept Strategy = requires(S& s, const S& cs, const TrainerOptions& options, torch::nn::Module& m,
                            const torch::Tensor& t, std::vector<torch::Tensor>& loader) {
  { S::is_distributed } -> std::convertible_to<bool>;
  { S::name } -> std::convertible_to<const char*>;
  s.check_devices(options, 1, "CPU");
  s.launch(detail::ProbeBody{});
  s.setup_environment(torch::Device(torch::kCPU));
  s.setup_module(m);
  s.process_dataloader(loader, Stage::train);
  { cs.global_rank() } -> std::convertible_to<int>;
  { cs.local_rank() } -> std::convertible_to<int>;
  { cs.world_size() } -> std::convertible_to<int>;
  { cs.is_global_zero() } -> std::convertible_to<bool>;
  { cs.root_device() } -> std::convertible_to<torch::Device>;
  { s.all_reduce(t, Reduce::sum) } -> std::convertible_to<torch::Tensor>;
  { s.reduce_boolean_decision(true, true) } -> std::convertible_to<bool>;
  s.barrier();
};

}  // namespace volt
