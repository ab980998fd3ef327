#pragma once
/// \file
/// `volt::ModelParallel<Launcher, Backend>`: data parallelism whose layout the module chooses part by part, on a
/// process mesh, as Lightning's `ModelParallelStrategy` (the composition of the design discussion it answers: "wrap
/// parts of their models in DDP and partition other parts with techniques like FSDP"). The module's
/// `configure_model(volt::ModelPlan&)` (volt/model_plan.hpp) names its parts:
/// \code
///   auto trainer = volt::make_trainer<volt::ModelParallel<volt::Script, volt::Mpi>>({.devices = 4});
///   trainer.strategy().set_mesh({{"replicate", 2}, {"shard", 2}});
///   // in the module:
///   void configure_model(volt::ModelPlan& plan) { plan.shard(blocks, "shard"); plan.replicate(head); }
/// \endcode
///
/// | part | what each rank holds and does |
/// |---|---|
/// | `plan.shard(m, axis)` | FSDP of `m` along the mesh's data axis `axis` (the layout of `FSDP`, strategies/sharded.hpp and fully_sharded.hpp, over that axis's communicator): each rank on the axis keeps its shard of each unit of `m`; gradients reduce-scattered along the axis as each unit's backward ends. Where the mesh has other data axes, replicated along them (hybrid sharding, FSDP2's HSDP): after the step's last backward the blocks are averaged across them |
/// | `plan.replicate(m)`, and what no part holds | DDP over the data axes (strategies/replicated.hpp) |
///
/// Each axis has a role (`AxisRole`, comm/mesh.hpp). Along a data axis each rank trains on its own share of every
/// batch: the loaders are split over the data axes flattened (`Mesh::data()`), logged values with `sync_dist` are
/// reduced over them, and every gradient ends averaged over them, so a fit equals a one-process fit on the global
/// batches whatever the plan. The ranks along a tensor or pipe axis share each batch; no layout uses such an axis yet
/// (tensor and pipeline parallelism will), so they hold the same parts and train alike.
///
/// One optimizer steps every part (automatic optimization): each sharded part gives it its pieces in place of its
/// parameters. Clipping by norm takes the norm over every part (each sharded part's pieces summed along its axis);
/// a loss-scaled step's inf check is agreed by every rank. Checkpoints: the full form (one file from rank zero, each
/// sharded part gathered along its axis), which resumes under any strategy; with more than one sharded part the
/// optimizer's state can be neither written nor read yet (refused, with nothing written or loaded).

#include "volt/comm/mesh.hpp"
#include "volt/errors.hpp"
#include "volt/model_plan.hpp"
#include "volt/optim/gradients.hpp"
#include "volt/strategies/data_parallel.hpp"
#include "volt/strategies/parts.hpp"
#include "volt/strategies/replicated.hpp"
#include "volt/strategies/sharded.hpp"
#include "volt/units.hpp"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstddef>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace volt {

template <class L = Script, class B = AutoBackend>
class ModelParallel : public detail::ProcessGroupStrategy<L, B> {
  using Base = detail::ProcessGroupStrategy<L, B>;
  using View = detail::PartView<ModelParallel, B>;

 public:
  static constexpr const char* name = "ModelParallel";
  /// Its sharded parts' optimizer steps their pieces (rules.hpp: no manual optimization, agreed inf checks).
  static constexpr bool shards_optimizer_state = true;
  template <class A>
  using with_accelerator = ModelParallel<L, resolve_backend_t<B, A>>;

  ModelParallel() : Base(name) {}

  /// The mesh's axes, outermost first (Mesh's layout; one of them may be -1: what the others leave), each with its role
  /// (`AxisRole`, default data). Parts are sharded along data axes; the ranks along a tensor or pipe axis share each
  /// batch (no layout uses those axes yet, so their ranks hold the same parts and train alike). Default:
  /// `{{"data", -1}}`. Takes effect at the next run's set-up.
  void set_mesh(std::vector<Mesh::Dim> dims) {
    if (dims.empty()) throw ConfigError("volt: ModelParallel takes a mesh of one axis or more, got none.");
    dims_ = std::move(dims);
    mesh_world_ = nullptr;
  }
  /// The mesh of the running or last run.
  const Mesh& mesh() const {
    if (!mesh_) throw std::logic_error("volt: ModelParallel's mesh is made at a run's set-up; there was none yet.");
    return *mesh_;
  }
  /// Whether a sharded part's units are freed after their forward (default) or kept to their backward.
  void set_reshard_after_forward(bool reshard) { reshard_after_forward_ = reshard; }
  bool reshard_after_forward() const { return reshard_after_forward_; }
  /// The dtype sharded units are gathered in for each forward (the Trainer sets the precision's).
  void set_compute_dtype(std::optional<torch::Dtype> dtype) { compute_dtype_ = dtype; }
  std::optional<torch::Dtype> compute_dtype() const { return compute_dtype_; }
  /// Whether each micro-batch's gradients are reduce-scattered as it ends: where a part is sharded.
  bool scatters_each_micro_batch() const { return !shards_.empty(); }

  /// The world's backend, then the mesh and a backend on each of its axes (kept across runs on the same processes).
  void setup_environment(torch::Device device) {
    Base::setup_environment(device);
    B& world = this->backend();
    if (mesh_ && mesh_world_ == &world) return;
    shards_.clear();
    replicas_.reset();
    data_ = nullptr;
    axes_.clear();
    mesh_.reset();
    mesh_ = std::make_unique<Mesh>(world.axis().group(), dims_);
    for (const MeshAxis& axis : mesh_->axes()) backend_on(axis, device);
    data_ = &backend_on(mesh_->data(), device);
    for (const Mesh::Dim& d : mesh_->dims()) {  // where a part sharded along a data axis is replicated
      if (const MeshAxis* rest = d.role == AxisRole::data ? mesh_->data_except(d.name) : nullptr) backend_on(*rest, device);
    }
    mesh_world_ = &world;
  }
  /// The world ranks whose batches are every batch once (the data line through rank zero), whose results predict
  /// gathers (data/predict_gather.hpp); the ranks along a tensor or pipe axis predict the same batches.
  std::vector<int> data_line() const { return mesh().data_line_of_rank_zero(); }
  /// `t` reduced over the data axes (flattened: the ranks whose batches differ), as `sync_dist` reduces logged values.
  torch::Tensor data_all_reduce(const torch::Tensor& t, Reduce op) {
    View view(*this, data_backend(), {}, nullptr);
    return view.all_reduce(t, op);
  }

  /// As DDP: the module moved, every rank starting from rank 0's parameters and buffers.
  void setup_module(torch::nn::Module& module) { this->replicate_from_rank_zero(module); }
  /// The parts of `module` as `plan` (its configure_model's) names them; kept while the plan and the module are the
  /// same, so that a run after a fit sees the layout the fit left.
  void apply_plan(torch::nn::Module& module, const ModelPlan& plan);

  template <class Loader>
  decltype(auto) process_dataloader(Loader&& loader, Stage stage) {
    const MeshAxis& data = mesh().data();  // ranks that differ only along a tensor or pipe axis see the same batches
    return detail::data_parallel_loader(std::forward<Loader>(loader), stage, data.rank(), data.size(),
                                        /*pad_evaluation=*/!shards_.empty(), name, warned_);
  }

  void setup_optimizer(torch::optim::Optimizer& optimizer);
  void zero_grad(torch::optim::Optimizer& optimizer) {
    for (auto& s : shards_) s->holder.zero_grad(s->view, optimizer);
    if (replicas_) replicas_->holder.zero_grad(replicas_->view, optimizer);
    if (shards_.empty() && !replicas_) detail::zero_grad(optimizer);
  }
  void pre_backward(bool sync) {
    for (auto& s : shards_) s->holder.pre_backward(s->view, sync);
    if (replicas_) replicas_->holder.pre_backward(replicas_->view, sync);
  }
  void post_backward() {
    for (auto& s : shards_) s->holder.post_backward(s->view);
    if (replicas_) replicas_->holder.post_backward(replicas_->view);
  }
  void clip_gradients(const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm);
  /// Every rank agrees on a loss-scaled step's inf check; the one optimizer steps every part.
  template <class P>
  bool optimizer_step(P& precision, torch::optim::Optimizer& optimizer) {
    precision.agree_found_inf(optimizer, [&](at::Tensor& found) { this->backend().all_reduce_(found, Reduce::max); });
    return precision.optimizer_step(optimizer);
  }
  /// Each sharded part's root unit gathered for the forward.
  ForwardScope forward_scope(Stage stage) {
    if (shards_.empty()) return ForwardScope();
    router_.reset();
    for (auto& s : shards_) s->holder.begin_forward(stage);
    return ForwardScope([this](bool backward_follows) {
      for (auto& s : shards_) s->holder.end_forward(s->view, backward_follows);
    });
  }
  /// After a fit that completed: every sharded part gathered back whole.
  void finish_fit() {
    router_.uninstall();
    for (auto& s : shards_) s->holder.finish_fit(s->view);
  }
  void teardown() {
    router_.uninstall();
    for (auto& s : shards_) s->holder.teardown();
    if (replicas_) replicas_->holder.teardown();
  }

  c10::Dict<std::string, at::Tensor> module_state(const torch::nn::Module& module, bool on_device);
  void load_module_state(torch::nn::Module& module, const checkpoint::Dict& state);
  at::Tensor optimizer_state(torch::optim::Optimizer& optimizer) {
    if (shards_.empty()) return Base::optimizer_state(optimizer);
    refuse_several(/*saving=*/true);
    return shards_.front()->holder.optimizer_state(shards_.front()->view, optimizer);
  }
  void load_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& bytes, const std::string& path) {
    if (shards_.empty()) return checkpoint::load_optimizer_state(optimizer, bytes, path);
    refuse_several(/*saving=*/false);
    shards_.front()->holder.load_optimizer_state(shards_.front()->view, optimizer, bytes, path);
  }
  /// Collective: parameter `j`'s gradients of a running accumulation window where a sharded part reduce-scattered them
  /// (averaged over every rank so far); undefined where they are in its `.grad`.
  at::Tensor window_gradient(std::size_t j);

 private:
  /// A sharded part: where it lies in the module, the axes it is sharded and replicated along, and FSDP's holder.
  struct ShardPart {
    torch::nn::Module* module;
    std::string prefix;  // its parameters' names in the module start with it ("" for the module itself)
    View view;
    detail::ShardedHolder<3, B> holder;
  };
  /// What no sharded part holds: DDP's holder over the world.
  struct ReplicaPart {
    View view;
    typename Replicated::template Holder<B> holder;
  };

  /// The backend on `axis` (a mesh axis, or axes of it flattened): the world's where it holds every rank, else the one
  /// made for its members, made here at the first call (every rank makes the same ones in the same order: a backend
  /// may split a communicator over the world).
  B& backend_on(const MeshAxis& axis, torch::Device device) {
    if (axis.size() == this->world_size()) return this->backend();
    for (std::size_t k = 0; k < axes_.size(); ++k) {
      if (axes_[k].first == axis.members()) return *axes_[k].second;
    }
    if constexpr (std::is_constructible_v<B, B&, const MeshAxis&>) {
      axes_.emplace_back(axis.members(), std::make_unique<B>(this->backend(), axis));  // NCCL: split from the world's
    } else {
      axes_.emplace_back(axis.members(), std::make_unique<B>(axis, device));
    }
    return *axes_.back().second;
  }
  /// The backend of `axis`, made at set-up.
  B& backend_on(const MeshAxis& axis) { return backend_on(axis, this->root_device()); }
  B& data_backend() {
    if (data_ == nullptr) throw std::logic_error("volt: ModelParallel's data axes are made at a run's set-up.");
    return *data_;
  }
  std::string path_of(const torch::nn::Module& module, const torch::nn::Module& part) const;
  void refuse_several(bool saving) const {
    if (shards_.size() <= 1) return;
    throw CheckpointError(std::string("volt: ModelParallel ") + (saving ? "writes" : "reads") + " the optimizer's "
                          "state of one sharded part, and this module plans " + std::to_string(shards_.size()) +
                          " of them; " + (saving ? "nothing was written. Plan one sharded part, or save the weights "
                                                   "only (save_weights_only)."
                                                 : "nothing was loaded. Plan one sharded part to resume it."));
  }

  std::vector<Mesh::Dim> dims_{{"data", -1}};
  std::unique_ptr<Mesh> mesh_;
  const B* mesh_world_ = nullptr;
  std::vector<std::pair<std::vector<int>, std::unique_ptr<B>>> axes_;  // backends made for axes, by their members
  B* data_ = nullptr;                                                   // on the data axes, flattened
  ModelPlan plan_;
  const torch::nn::Module* planned_module_ = nullptr;
  std::vector<const void*> planned_params_;  // its parameters then (a module at the same address is not the same)
  std::vector<std::unique_ptr<ShardPart>> shards_;
  std::unique_ptr<ReplicaPart> replicas_;
  std::unordered_set<const void*> sharded_;  // the sharded parts' parameters
  detail::PartRouter router_;
  bool reshard_after_forward_ = true;
  std::optional<torch::Dtype> compute_dtype_;
  bool warned_ = false;
};

/// Each planned part checked (on the mesh, inside the module, no parameter in two) and given its holder.
template <class L, class B>
void ModelParallel<L, B>::apply_plan(torch::nn::Module& module, const ModelPlan& plan) {
  std::vector<const void*> params;
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) params.push_back(p.unsafeGetTensorImpl());
  if (planned_module_ == &module && plan == plan_ && params == planned_params_ && (replicas_ || !shards_.empty())) {
    return;
  }
  planned_module_ = nullptr;  // until the parts are all made
  router_.uninstall();
  shards_.clear();
  replicas_.reset();
  sharded_.clear();
  std::unordered_map<const void*, std::string> owner;  // parameter -> the part that claimed it
  for (const ModelPlan::Part& part : plan.parts()) {
    std::vector<at::Tensor> params = part.module->parameters(/*recurse=*/true);
    const std::string where = path_of(module, *part.module);
    for (const at::Tensor& p : params) {
      const auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), where);
      if (!fresh) {
        throw ConfigError("volt: configure_model planned parts that share parameters (\"" + it->second + "\" and \"" +
                          where + "\"): a part inside another, or a module shared by two; plan each parameter once.");
      }
    }
    if (part.axis.empty()) continue;
    const auto named = [&](const MeshAxis& a) { return part.axis == a.name(); };
    if (std::none_of(mesh_->axes().begin(), mesh_->axes().end(), named)) {
      throw ConfigError("volt: configure_model shards \"" + where + "\" along the axis \"" + part.axis + "\", which "
                        "the mesh (" + mesh_->shape() + ") does not have; name one of its axes, or give the mesh that "
                        "axis with trainer.strategy().set_mesh.");
    }
    if (mesh_->role(part.axis) != AxisRole::data) {
      throw ConfigError("volt: configure_model shards \"" + where + "\" along the axis \"" + part.axis + "\", whose "
                        "role is " + role_name(mesh_->role(part.axis)) + " (mesh " + mesh_->shape() + "); a part is "
                        "sharded along a data axis, whose ranks train on different batches.");
    }
    B& along = backend_on(mesh_->axis(part.axis));
    const MeshAxis* rest = mesh_->data_except(part.axis);  // HSDP: the blocks averaged across the other data axes
    B* across = rest != nullptr ? &backend_on(*rest) : nullptr;
    for (const at::Tensor& p : params) sharded_.insert(p.unsafeGetTensorImpl());
    shards_.push_back(std::unique_ptr<ShardPart>(new ShardPart{
        part.module, where.empty() ? where : where + ".", View(*this, along, std::move(params), across), {}}));
  }
  std::vector<at::Tensor> rest;
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) {
    if (sharded_.count(p.unsafeGetTensorImpl()) == 0) rest.push_back(p);
  }
  if (!rest.empty()) {
    View view(*this, data_backend(), std::move(rest), nullptr);  // averaged over the ranks whose batches differ
    replicas_ = std::unique_ptr<ReplicaPart>(new ReplicaPart{std::move(view), {}});
  }
  plan_ = plan;
  planned_params_ = std::move(params);
  planned_module_ = &module;
  if (shards_.size() > 1 && this->is_global_zero()) {  // said before training, not at the first save
    std::cerr << "volt: warning: configure_model plans " << shards_.size() << " sharded parts; ModelParallel's "
              << "checkpoints hold the optimizer's state of one sharded part, so a checkpoint of this fit "
              << "(ModelCheckpoint, save_checkpoint, a stop signal's) will be refused. Plan one sharded part, or "
              << "save the weights only (save_weights_only)." << std::endl;
  }
}

/// The dotted name of `part` in `module` ("" for the module itself); refused where it is not inside it.
template <class L, class B>
std::string ModelParallel<L, B>::path_of(const torch::nn::Module& module, const torch::nn::Module& part) const {
  if (&part == &module) return "";
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (item.value().get() == &part) return item.key();
  }
  throw ConfigError("volt: configure_model planned a " + part.name() + " that is not a submodule of the module fitted "
                    "(a " + module.name() + "); plan the module's own submodules.");
}

/// Each sharded part gives `optimizer` its pieces (at its first backward); the units are routed to their parts.
template <class L, class B>
void ModelParallel<L, B>::setup_optimizer(torch::optim::Optimizer& optimizer) {
  std::vector<std::vector<at::Tensor>> params;
  std::vector<detail::UnitRuntime*> runtimes;
  for (auto& s : shards_) {
    s->holder.setup_optimizer(s->view, optimizer);
    params.push_back(s->view.module_parameters());
    runtimes.push_back(s->holder.units());
  }
  if (!shards_.empty()) router_.install(params, runtimes);
}

/// By value: every gradient this rank steps, clamped. By norm: the total over every part, each sharded part's pieces
/// summed along its axis (each rank on the axis holds other pieces), the replicated parameters' counted once.
template <class L, class B>
void ModelParallel<L, B>::clip_gradients(const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm) {
  std::vector<at::Tensor> tensors;
  detail::PartNorms<B> total{{}, this->root_device(), detail::squares_dtype(params)};
  const auto with_grad = [](const at::Tensor& t) { return t.grad().defined(); };
  for (auto& s : shards_) {
    const std::vector<at::Tensor> pieces = s->holder.piece_tensors();
    const auto counted = std::count_if(pieces.begin(), pieces.end(), with_grad);
    total.groups.emplace_back(static_cast<std::size_t>(counted), &s->view.backend());
    tensors.insert(tensors.end(), pieces.begin(), pieces.end());
  }
  std::size_t whole = 0;
  for (const at::Tensor& p : params) {
    if (sharded_.count(p.unsafeGetTensorImpl()) != 0) continue;
    tensors.push_back(p);
    whole += with_grad(p) ? 1 : 0;
  }
  total.groups.emplace_back(whole, nullptr);
  detail::clip_gradients(tensors, value, algorithm, std::move(total));
}

/// The module's whole state on rank zero: each sharded part gathered along its axis, the rest as every rank holds it.
template <class L, class B>
c10::Dict<std::string, at::Tensor> ModelParallel<L, B>::module_state(const torch::nn::Module& module, bool on_device) {
  if (shards_.empty()) return Base::module_state(module, on_device);
  std::unordered_map<std::string, at::Tensor> gathered;
  for (auto& s : shards_) {  // collective along each part's axis
    for (const auto& item : s->holder.module_state(s->view, *s->module, on_device)) {
      gathered.emplace(s->prefix + item.key(), item.value());
    }
  }
  c10::Dict<std::string, at::Tensor> out;
  if (!this->is_global_zero()) return out;
  const auto take = [&](const std::string& key, const at::Tensor& t) {
    const auto it = gathered.find(key);
    out.insert(key, it != gathered.end() ? it->second : on_device ? t.detach() : t.detach().cpu());
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) take(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) take(b.key(), b.value());
  }
  return out;
}

/// Every rank keeps its shards of each sharded part's parameters and the whole of the rest.
template <class L, class B>
void ModelParallel<L, B>::load_module_state(torch::nn::Module& module, const checkpoint::Dict& state) {
  if (shards_.empty()) return Base::load_module_state(module, state);
  for (auto& s : shards_) {
    checkpoint::Dict part(state.keyType(), state.valueType());
    for (const auto& item : state) {
      const std::string key = item.key().toStringRef();
      if (key.compare(0, s->prefix.size(), s->prefix) == 0) part.insert(key.substr(s->prefix.size()), item.value());
    }
    s->holder.load_module_state(s->view, *s->module, part);
  }
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters(/*recurse=*/true)) {
    if (sharded_.count(p.value().unsafeGetTensorImpl()) == 0) p.value().copy_(state.at(p.key()).toTensor());
  }
  for (auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) b.value().copy_(state.at(b.key()).toTensor());
  }
}

template <class L, class B>
at::Tensor ModelParallel<L, B>::window_gradient(std::size_t j) {
  const torch::nn::Module* module = planned_module_;
  if (module == nullptr || shards_.empty()) return at::Tensor();
  const at::Tensor p = module->parameters(/*recurse=*/true).at(j);
  for (auto& s : shards_) {
    const auto& own = s->view.module_parameters();
    for (std::size_t k = 0; k < own.size(); ++k) {
      if (!own[k].is_same(p)) continue;
      at::Tensor g = s->holder.window_gradient(s->view, k);
      if (g.defined() && s->view.replicas() != nullptr) s->view.replicas()->all_reduce_(g, Reduce::mean);
      return g;
    }
  }
  return at::Tensor();
}

}  // namespace volt
