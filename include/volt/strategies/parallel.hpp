#pragma once
/// \file
/// `volt::Parallel<Launcher, Backend, Layouts...>`: the one host of data parallelism and of its compositions. A run's
/// processes are laid out on a mesh of named axes (`set_mesh`; default one data axis, the world), and the module is
/// cut into parts, each held under a layout (strategies/layout.hpp) along an axis of it. Its names:
///
/// | strategy | is | the parts |
/// |---|---|---|
/// | `DDP<L, B>` | `Parallel<L, B, Replicated>` | the whole module, replicated over the data axes |
/// | `ZeRO<1\|2, L, B>` | `Parallel<L, B, Sharded<1\|2>>` | the whole module, its optimizer state (and gradients) sharded over the data axes |
/// | `FSDP<L, B>` | `Parallel<L, B, FullySharded>` | the whole module, sharded along the innermost data axis (and replicated across the other data axes: HSDP) |
/// | `ModelParallel<L, B>` | `Parallel<L, B, Replicated, FullySharded>` | what the module's `configure_model` plans (strategies/model_parallel.hpp): a sharded part per `plan.shard`, the rest replicated |
///
/// Every Strategy member (strategies/concept.hpp) is written once here, over the parts: each part's holder is handed
/// its `detail::PartGroup` (its parameters, its axes' backends, its layout's options). Along the data axes each rank
/// trains on its own share of every batch: the loaders are split over the data axes flattened (`Mesh::data()`),
/// `sync_dist` reduces over them, and every gradient ends averaged over them, so a fit equals a one-process fit on the
/// global batches whatever the parts. The ranks along a tensor or pipe axis share each batch (no layout uses such an
/// axis yet). Clipping by norm sums each sharded part's squares along its axis; a loss-scaled step's inf check is
/// agreed by every rank where a part steps pieces. Checkpoints: the full form (one file from rank zero, each sharded
/// part gathered along its axis) and the sharded form (`set_state_dict_type`: every part's pieces, each written
/// once); the optimizer's state of more than one part that steps pieces is not written yet (refused, nothing
/// written or loaded).

#include "volt/comm/mesh.hpp"
#include "volt/data/concept.hpp"
#include "volt/errors.hpp"
#include "volt/launchers/script.hpp"
#include "volt/launchers/spawn.hpp"
#include "volt/model_plan.hpp"
#include "volt/optim/gradients.hpp"
#include "volt/roles.hpp"
#include "volt/strategies/concept.hpp"
#include "volt/strategies/data_parallel.hpp"
#include "volt/strategies/layout.hpp"
#include "volt/strategies/parts.hpp"
#include "volt/strategies/process_group.hpp"
#include "volt/strategies/replicated.hpp"
#include "volt/strategies/sharded.hpp"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstddef>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

namespace volt {

template <class L, class B, class... Layouts>
class Parallel : public detail::ProcessGroupStrategy<L, B> {
  static_assert(sizeof...(Layouts) >= 1, "volt: Parallel<Launcher, Backend, Layouts...> takes one layout or more.");
  using Base = detail::ProcessGroupStrategy<L, B>;
  static constexpr bool plans = sizeof...(Layouts) > 1;

 public:
  /// The default part's layout: what holds what no planned part holds (all of the module, but for ModelParallel).
  using layout_type = std::tuple_element_t<0, std::tuple<Layouts...>>;
  static constexpr const char* name = plans ? "ModelParallel" : layout_type::name;
  /// Whether a part steps this rank's pieces (rules.hpp: no manual optimization, agreed inf checks).
  static constexpr bool shards_optimizer_state = ((Layouts::stage > 0) || ...);
  using volt_roles = Roles<role::plans_parts, role::writes_shards, role::keeps_window_gradients,
                           role::scatters_micro_batches, role::shares_batches>;
  template <class A>
  using with_accelerator = Parallel<L, resolve_backend_t<B, A>, Layouts...>;

  Parallel() : Base(name) {
    static_assert((detail::check_layout<Layouts, B>() && ...));  // each layout's holder and roles (strategies/layout.hpp)
  }

  /// The mesh's axes, outermost first (Mesh's layout; one of them may be -1: what the others leave), each with its role
  /// (`AxisRole`, default data). Default: `{{"data", -1}}`. Takes effect at the next run's set-up.
  void set_mesh(std::vector<Mesh::Dim> dims) {
    if (dims.empty()) throw ConfigError(std::string("volt: ") + name + " takes a mesh of one axis or more, got none.");
    dims_ = std::move(dims);
    mesh_world_ = nullptr;
  }
  /// The mesh of the running or last run.
  const Mesh& mesh() const {
    if (!mesh_) throw std::logic_error(std::string("volt: ") + name + "'s mesh is made at a run's set-up; none yet.");
    return *mesh_;
  }
  /// The options of the parts held under layout `T` (default: the default part's), as a value to change:
  /// `trainer.strategy().layout() = volt::FullySharded{.reshard_after_forward = false}`. Take effect at the next fit.
  template <class T = layout_type>
  T& layout() {
    return std::get<T>(layouts_);
  }
  /// Forwarding aliases of the layouts' options (each sets it on every layout that has it).
  void set_bucket_bytes(std::size_t first_bucket, std::size_t other_buckets)
    requires((Layouts::stage < 3) || ...)
  {
    if (first_bucket == 0 || other_buckets == 0) {
      throw ConfigError(std::string("volt: ") + name + " bucket sizes must be positive, got first=" +
                        std::to_string(first_bucket) + " and others=" + std::to_string(other_buckets) + " bytes.");
    }
    for_layouts([&]<class T>(T& l) {
      if constexpr (T::stage < 3) l.first_bucket_bytes = first_bucket, l.bucket_bytes = other_buckets;
    });
  }
  void set_reshard_after_forward(bool reshard)
    requires((Layouts::stage == 3) || ...)
  {
    for_layouts([&]<class T>(T& l) {
      if constexpr (T::stage == 3) l.reshard_after_forward = reshard;
    });
  }
  void set_sync_every_micro_batch(bool every)
    requires((Layouts::stage == 3) || ...)
  {
    for_layouts([&]<class T>(T& l) {
      if constexpr (T::stage == 3) l.sync_every_micro_batch = every;
    });
  }
  /// The dtype sharded units are gathered in for each forward (none: as stored); the Trainer sets the precision's.
  void set_compute_dtype(std::optional<torch::Dtype> dtype) { place_.compute_dtype = dtype; }
  /// How checkpoints are written (Lightning's `state_dict_type`): one file from rank zero (`full`, the default), or a
  /// folder of every rank's pieces written at once (`sharded`: volt/checkpoint/sharded.hpp). Both resume on any world
  /// size and any data-parallel layout.
  void set_state_dict_type(StateDictType type) { state_dict_type_ = type; }
  StateDictType state_dict_type() const { return state_dict_type_; }

  void setup_environment(torch::Device device);
  /// The module moved, every rank starting from rank 0's parameters and buffers.
  void setup_module(torch::nn::Module& module) { this->replicate_from_rank_zero(module); }
  /// The parts of `module` as its configure_model's `plan` names them (ModelParallel; a strategy of one layout holds
  /// the module as one part and reads only the plan's units), kept while the plan and the module are the same, so that
  /// a run after a fit sees the layout the fit left.
  void apply_plan(torch::nn::Module& module, const ModelPlan& plan) { assign(module, plan); }
  template <class Loader>
  decltype(auto) process_dataloader(Loader&& loader, Stage stage) {
    const MeshAxis& data = mesh().data();  // ranks that differ only along a tensor or pipe axis see the same batches
    return detail::data_parallel_loader(std::forward<Loader>(loader), stage, data.rank(), data.size(),
                                        /*pad_evaluation=*/count<role::gathers_units>() > 0, name, warned_);
  }
  /// The world ranks whose batches are every batch once (the data line through rank zero).
  std::vector<int> data_line() const { return mesh().data_line_of_rank_zero(); }
  /// `t` reduced over the data axes (flattened: the ranks whose batches differ), as `sync_dist` reduces logged values.
  torch::Tensor data_all_reduce(const torch::Tensor& t, Reduce op) {
    const bool fits = t.is_cpu() ? backend_traits<B>::supports_cpu : backend_traits<B>::supports_cuda;
    torch::Tensor r = (fits ? t : t.to(this->root_device())).detach().clone();
    data_backend().all_reduce_(r, op);
    return r.to(t.device());
  }

  void setup_optimizer(torch::optim::Optimizer& optimizer);
  /// Each part's holder clears what it holds (each clears the optimizer's gradients too); with no part, the optimizer's.
  void zero_grad(torch::optim::Optimizer& optimizer) {
    if (parts_.empty()) return detail::zero_grad(optimizer);
    each([&](auto& h) { h.holder.zero_grad(h.group, optimizer); });
  }
  /// Before a backward: `sync` is true on the micro-batch that steps (the others only accumulate).
  void pre_backward(bool sync) {
    each([&](auto& h) { h.holder.pre_backward(h.group, sync); });
  }
  /// After it: gradients averaged over the data ranks (each rank's share of them, where a layout shards them).
  void post_backward() {
    each([&](auto& h) { h.holder.post_backward(h.group); });
  }
  void clip_gradients(const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm);
  /// Every rank agrees on a loss-scaled step's inf check where a part steps pieces; the one optimizer steps every part,
  /// then each part does what follows (ZeRO: the all-gather).
  template <class P>
  bool optimizer_step(P& precision, torch::optim::Optimizer& optimizer) {
    if constexpr (shards_optimizer_state) {
      precision.agree_found_inf(optimizer, [&](at::Tensor& found) { this->backend().all_reduce_(found, Reduce::max); });
    }
    const bool stepped = precision.optimizer_step(optimizer);
    if (stepped) each<role::steps_pieces>([&](auto& h) { h.holder.after_step(h.group); });
    return stepped;
  }
  /// Collective: the optimizer's archive for rank zero's checkpoint, in the layout of an unsharded run.
  at::Tensor optimizer_state(torch::optim::Optimizer& optimizer);
  /// Loads an archive of any layout and world size (refused, unchanged, when it does not fit).
  void load_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& bytes, const std::string& path);
  /// Each sharded part's root unit gathered for the forward (FSDP); nothing where no part gathers units.
  ForwardScope forward_scope(Stage stage);
  /// After a fit that completed: every sharded part gathered back whole.
  void finish_fit() {
    router_.uninstall();
    each<role::gathers_units>([&](auto& h) { h.holder.finish_fit(h.group); });
  }
  void teardown() {
    router_.uninstall();
    each([&](auto& h) { h.holder.teardown(); });
  }

  /// Collective: the module's whole state on rank zero, each sharded part gathered unit by unit along its axis.
  c10::Dict<std::string, at::Tensor> module_state(const torch::nn::Module& module, bool on_device);
  /// Every rank keeps its shards of each sharded part's parameters and the whole of the rest.
  void load_module_state(torch::nn::Module& module, const checkpoint::Dict& state);
  /// Collective: parameter `j`'s gradients of a running accumulation window where a sharded part reduce-scattered them
  /// (their average so far over the data ranks); undefined where they are in its `.grad`.
  at::Tensor window_gradient(std::size_t j);
  /// What this rank writes of the parameters into a sharded checkpoint: the pieces of each part that steps pieces
  /// (written by the ranks at coordinate 0 off its axis), a near-equal part of what every rank holds.
  std::vector<checkpoint::Slice> state_slices() const;
  /// `optimizer`'s groups in the layout of an unsharded run (the module's parameters, not this rank's pieces).
  std::vector<std::vector<at::Tensor>> full_param_groups(torch::optim::Optimizer& optimizer) const {
    if (count<role::steps_pieces>() == 0) return detail::param_lists(optimizer);
    refuse_several(/*saving=*/true);
    std::vector<std::vector<at::Tensor>> out;
    each<role::steps_pieces>([&](auto& h) { out = h.holder.full_param_groups(optimizer); });
    return out;
  }
  /// Whether each micro-batch's gradients are reduce-scattered as it ends (a sharded part syncing every micro-batch).
  bool scatters_each_micro_batch() const {
    bool any = false;
    each<role::gathers_units>([&](auto& h) { any = any || h.group.layout().sync_every_micro_batch; });
    return any;
  }

  /// Bytes of gradients this rank holds between steps, during a fit: the module's `.grad` and the layouts' buffers.
  std::size_t gradient_bytes() const {
    std::size_t bytes = 0;
    each([&](auto& h) { bytes += h.holder.gradient_bytes(); });
    return bytes;
  }
  /// Bytes of parameters this rank holds now (FSDP: its shards and the units gathered at this moment).
  std::size_t parameter_bytes() const;
  /// The gradient buckets of the running or last fit (module parameter indices in fill order), part after part.
  std::vector<std::vector<std::size_t>> bucket_layout() const;

 private:
  /// A part held under layout `T`: what its holder is handed, and the holder.
  template <class T>
  struct Held {
    using layout = T;
    explicit Held(detail::PartGroup<B, T> g) : group(std::move(g)) {}
    detail::PartGroup<B, T> group;
    typename T::template Holder<B> holder;
  };
  /// A part of the module: where it lies, its parameters' indices in the module, whether this rank writes its pieces
  /// into a sharded checkpoint, and its holder.
  struct Part {
    template <class T, class G>
    Part(torch::nn::Module* m, std::string p, bool w, std::in_place_type_t<T> kind, G group)
        : module(m), prefix(std::move(p)), writes(w), held(kind, std::move(group)) {}
    torch::nn::Module* module;
    std::string prefix;  // its parameters' names in the module start with it ("" for the module itself)
    std::vector<std::size_t> index;
    bool writes = true;
    std::variant<Held<Layouts>...> held;
  };

  template <class F>
  void for_layouts(F&& f) {
    std::apply([&](auto&... l) { (f(l), ...); }, layouts_);
  }
  /// `f(held)` for every part (`R`: those whose layout declares role `R`), in the parts' order.
  template <class R = void, class F>
  void each(F&& f) const {
    for (const auto& part : parts_) each_of<R>(*part, f);
  }
  template <class R = void, class F>
  static void each_of(Part& part, F&& f) {
    std::visit([&](auto& h) {
      if constexpr (std::is_void_v<R> || declares_role<typename std::remove_cvref_t<decltype(h)>::layout, R>) f(h);
    }, part.held);
  }
  template <class R>
  std::size_t count() const {
    std::size_t n = 0;
    each<R>([&](auto&) { ++n; });
    return n;
  }

  void assign(torch::nn::Module& module, const ModelPlan& plan);
  void add_default_part(torch::nn::Module& module, std::vector<at::Tensor> rest,
                        const std::unordered_map<const void*, std::size_t>& index);
  void assign_units(const ModelPlan& plan, const std::unordered_map<const void*, std::size_t>& index);
  template <class T>
  void add_part(torch::nn::Module* module, const std::string& where, std::vector<at::Tensor> params,
                const std::unordered_map<const void*, std::size_t>& index, const MeshAxis& along,
                const std::vector<std::string>& covered, B* across);
  B& backend_on(const MeshAxis& axis, torch::Device device);
  B& backend_on(const MeshAxis& axis) { return backend_on(axis, this->root_device()); }
  B& data_backend() {
    if (data_ == nullptr) throw std::logic_error(std::string("volt: ") + name + "'s data axes are made at set-up.");
    return *data_;
  }
  std::string path_of(const torch::nn::Module& module, const torch::nn::Module& part) const;
  void refuse_several(bool saving) const;

  std::tuple<Layouts...> layouts_;
  std::vector<Mesh::Dim> dims_{{"data", -1}};
  std::unique_ptr<Mesh> mesh_;
  const B* mesh_world_ = nullptr;
  std::vector<std::pair<std::vector<int>, std::unique_ptr<B>>> axes_;  // backends made for axes, by their members
  B* data_ = nullptr;                                                   // on the data axes, flattened
  detail::RunPlace place_;
  ModelPlan plan_;
  const torch::nn::Module* module_ = nullptr;
  std::vector<const void*> planned_params_;  // its parameters then (a module at the same address is not the same)
  std::vector<std::unique_ptr<Part>> parts_;
  std::vector<std::pair<Part*, std::size_t>> where_;  // each module parameter's part and its index there
  std::unordered_set<const void*> stepped_;           // the parameters of parts that step pieces (clipping's)
  detail::PartRouter router_;
  StateDictType state_dict_type_ = StateDictType::full;
  bool warned_ = false;
};

/// A strategy of one layout: the whole module one part (`DDP`, `ZeRO`, `FSDP` are its names).
template <class Layout, class L = Script, class B = AutoBackend>
using DataParallel = Parallel<L, B, Layout>;

}  // namespace volt

#include "volt/strategies/parallel_impl.hpp"
