#pragma once
/// \file
/// The Layout kind: what each rank holds of a part of the module (its parameters, gradients and optimizer state) and
/// the work on it. `Parallel` (strategies/parallel.hpp) gives every part of the module a layout: DDP's one part is
/// `Replicated` (strategies/replicated.hpp), ZeRO's `Sharded<1|2>` and FSDP's `FullySharded` (strategies/sharded.hpp),
/// and ModelParallel's plan names a layout per part. A layout is a value that holds its options (as ensmallen's update
/// policies do), and its `Holder<Backend>` is what one rank holds of a part under it:
///
/// | member of the layout | meaning |
/// |---|---|
/// | `static constexpr int stage` | what is sharded, as ZeRO's stages count: 0 nothing, 1 the optimizer state, 2 the gradients too, 3 the parameters too |
/// | `static constexpr const char* name` | the strategy's name in messages (`DDP`, `ZeRO<1>`, `FSDP`) |
/// | `using volt_roles = volt::Roles<...>` | the optional roles its holder takes on (below; volt/roles.hpp) |
/// | its options, as data members | `Replicated{.first_bucket_bytes = ..., .bucket_bytes = ...}`, `FullySharded{.reshard_after_forward = false}` |
/// | `template <class Backend> class Holder` | one rank's share of a part and the work on it |
///
/// Each member of a holder takes the part first (`detail::PartGroup`: its parameters, the backend of the axis it is
/// sharded along, of the axes it is replicated along, the layout's options), and the host calls it for every part:
///
/// | member of the holder | meaning |
/// |---|---|
/// | `setup_optimizer(g, optimizer)` | at each fit's start (ZeRO gives the optimizer this rank's pieces) |
/// | `zero_grad(g, optimizer)` | the gradients cleared |
/// | `pre_backward(g, bool sync)`, `post_backward(g)` | around each backward; gradients averaged over the part's data ranks after a synchronised one |
/// | `optimizer_state(g, optimizer) -> at::Tensor`, `load_optimizer_state(g, optimizer, bytes, path)` | the optimizer's archive in the layout of an unsharded run, on rank zero; loaded from any run's |
/// | `teardown()`, `gradient_bytes() -> std::size_t`, `bucket_layout()` | after a fit; the bytes of gradients held; the buckets (parameter indices in fill order) |
///
/// | optional role | members | default |
/// |---|---|---|
/// | `role::steps_pieces` | `piece_tensors() -> std::vector<at::Tensor>` (what the optimizer steps of the part: its clipping's tensors), `after_step(g)` (after the optimizer's step: ZeRO gathers the parameters), `state_slices(g) -> std::vector<checkpoint::Slice>` (the sharded checkpoint's pieces, indices of the part's parameters), `full_param_groups(optimizer)` (its groups in the layout of an unsharded run) | the optimizer steps the part's parameters whole |
/// | `role::gathers_units` | `begin_forward(Stage)`, `end_forward(g, bool backward_follows)`, `units() -> UnitRuntime*` (null outside a fit), `finish_fit(g)`, `module_state(g, module, bool on_device)`, `load_module_state(g, module, state)`, `window_gradient(g, std::size_t) -> at::Tensor`, `parameter_bytes() -> std::size_t` (FSDP: the parameters live in shards and are gathered unit by unit) | the part's parameters are whole on every rank |

#include "volt/comm/concept.hpp"
#include "volt/checkpoint/sharded.hpp"
#include "volt/reduce.hpp"
#include "volt/roles.hpp"
#include "volt/stage.hpp"
#include "volt/units.hpp"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <concepts>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace volt {

namespace detail {

/// What every part of a run shares of its strategy: where it runs and the dtype sharded units are gathered in.
struct RunPlace {
  bool global_zero = true;
  torch::Device device = torch::kCPU;
  std::optional<torch::Dtype> compute_dtype;
};

/// One part of the module as its layout's holder sees it: its parameters, the backend of the axis it is sharded (or
/// replicated) along and its rank and size there, the backend of the axes it is replicated across where it is sharded
/// (HSDP; else null), the units declared in it, and its layout's options. The host owns what it points to.
template <class B, class Layout>
class PartGroup {
 public:
  PartGroup(B& along, B* replicas, std::vector<at::Tensor> params, const Layout& layout, const RunPlace& place)
      : along_(&along), replicas_(replicas), params_(std::move(params)), layout_(&layout), place_(&place) {}
  B& backend() const { return *along_; }
  int world_size() const { return along_->size(); }
  int global_rank() const { return along_->rank(); }
  bool is_global_zero() const { return place_->global_zero; }
  torch::Device root_device() const { return place_->device; }
  std::optional<torch::Dtype> compute_dtype() const { return place_->compute_dtype; }
  const Layout& layout() const { return *layout_; }
  B* replicas() const { return replicas_; }
  const std::vector<at::Tensor>& module_parameters() const { return params_; }
  /// The units `configure_model` declared in this part, in the order the forward runs them (empty: none declared).
  const std::vector<const torch::nn::Module*>& units() const { return units_; }
  void set_units(std::vector<const torch::nn::Module*> units) { units_ = std::move(units); }
  /// A reduced copy of `t` along the part's axis.
  at::Tensor all_reduce(const at::Tensor& t, Reduce op) const {
    const bool fits = t.is_cpu() ? backend_traits<B>::supports_cpu : backend_traits<B>::supports_cuda;
    at::Tensor r = (fits ? t : t.to(root_device())).detach().clone();
    along_->all_reduce_(r, op);
    return r.to(t.device());
  }

 private:
  B* along_;
  B* replicas_;
  std::vector<at::Tensor> params_;
  std::vector<const torch::nn::Module*> units_;
  const Layout* layout_;
  const RunPlace* place_;
};

}  // namespace detail

namespace role {
/// The holder steps pieces of its part's parameters (ZeRO, FSDP): see strategies/layout.hpp's table.
struct steps_pieces {
  template <class H, class G>
  static constexpr bool met = requires(H& h, const H& ch, G& g, torch::optim::Optimizer& o) {
    { ch.piece_tensors() } -> std::same_as<std::vector<at::Tensor>>;
    h.after_step(g);
    { ch.state_slices(g) } -> std::same_as<std::vector<checkpoint::Slice>>;
    { ch.full_param_groups(o) } -> std::same_as<std::vector<std::vector<at::Tensor>>>;
  };
};
/// The holder keeps its part's parameters in shards and gathers them unit by unit (FSDP): see the table.
struct gathers_units {
  template <class H, class G>
  static constexpr bool met = requires(H& h, const H& ch, G& g, torch::nn::Module& m, const checkpoint::Dict& state) {
    h.begin_forward(Stage::train);
    h.end_forward(g, true);
    { ch.units() } -> std::same_as<detail::UnitRuntime*>;
    h.finish_fit(g);
    { h.module_state(g, m, false) } -> std::same_as<c10::Dict<std::string, at::Tensor>>;
    h.load_module_state(g, m, state);
    { ch.window_gradient(g, std::size_t{0}) } -> std::same_as<at::Tensor>;
    { ch.parameter_bytes() } -> std::same_as<std::size_t>;
  };
};
}  // namespace role

/// A layout's holder over backend `B`: the members every one has (the first table).
template <class H, class G>
concept LayoutHolder = requires(H& h, const H& ch, G& g, torch::optim::Optimizer& o, const at::Tensor& t) {
  h.setup_optimizer(g, o);
  h.zero_grad(g, o);
  h.pre_backward(g, true);
  h.post_backward(g);
  { h.optimizer_state(g, o) } -> std::same_as<at::Tensor>;
  h.load_optimizer_state(g, o, t, std::string());
  h.teardown();
  { ch.gradient_bytes() } -> std::convertible_to<std::size_t>;
  { ch.bucket_layout() } -> std::same_as<std::vector<std::vector<std::size_t>>>;
};

namespace detail {
/// Layout `L`'s holder over `B` checked: its members, then each optional role (a compile error naming the role where
/// one is declared and not met, or met and not declared).
template <class L, class B>
constexpr bool check_layout() {
  using H = typename L::template Holder<B>;
  using G = PartGroup<B, L>;
  static_assert(LayoutHolder<H, G>, "volt: a layout's Holder lacks one of the members every holder has, or has one of "
                                    "another signature: see strategies/layout.hpp's first table of a holder's members.");
  VOLT_DETAIL_CHECK_ROLE(steps_pieces, "layout", L, H, G);
  VOLT_DETAIL_CHECK_ROLE(gathers_units, "layout", L, H, G);
  return true;
}
}  // namespace detail

}  // namespace volt
