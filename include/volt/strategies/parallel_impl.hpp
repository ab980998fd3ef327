#pragma once
/// \file
/// The out-of-class members of `Parallel` (strategies/parallel.hpp, which includes this at its end): the mesh and
/// its backends, the parts laid out, and the members that gather over them.

#include "volt/strategies/parallel.hpp"

namespace volt {

/// The world's backend, then the mesh and a backend on each of its axes (kept across runs on the same processes).
template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::setup_environment(torch::Device device) {
  Base::setup_environment(device);
  place_.device = device;
  place_.global_zero = this->is_global_zero();
  B& world = this->backend();
  if (mesh_ && mesh_world_ == &world) return;
  router_.uninstall();
  parts_.clear();
  stepped_.clear();
  where_.clear();
  module_ = nullptr;
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

/// The backend on `axis` (a mesh axis, or axes of it flattened): the world's where it holds every rank, else the one
/// made for its members, made at set-up (every rank makes the same ones in the same order: a backend may split a
/// communicator over the world).
template <class L, class B, class... Ls>
B& Parallel<L, B, Ls...>::backend_on(const MeshAxis& axis, torch::Device device) {
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

/// The parts of `module`: each planned sharded part checked (on the mesh, along a data axis, inside the module, no
/// parameter in two) and held under `FullySharded`; what no sharded part holds, under the default part's layout
/// (FSDP: along the innermost data axis, replicated across the others). Kept while the plan and the module are the same.
template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::assign(torch::nn::Module& module, const ModelPlan& plan) {
  const std::vector<at::Tensor> params = module.parameters(/*recurse=*/true);
  std::vector<const void*> ids;
  for (const at::Tensor& p : params) ids.push_back(p.unsafeGetTensorImpl());
  if (module_ == &module && plan == plan_ && ids == planned_params_ && !parts_.empty()) return;
  module_ = nullptr;  // until the parts are all made
  router_.uninstall();
  parts_.clear();
  stepped_.clear();
  where_.assign(params.size(), {nullptr, 0});
  std::unordered_map<const void*, std::size_t> index;
  for (std::size_t j = 0; j < params.size(); ++j) index.emplace(ids[j], j);
  if constexpr (plans) {
    std::unordered_map<const void*, std::string> owner;  // parameter -> the part that claimed it
    for (const ModelPlan::Part& part : plan.parts()) {
      std::vector<at::Tensor> own = part.module->parameters(/*recurse=*/true);
      const std::string where = path_of(module, *part.module);
      for (const at::Tensor& p : own) {
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
                          "the mesh (" + mesh_->shape() + ") does not have; name one of its axes, or give the mesh "
                          "that axis with trainer.strategy().set_mesh.");
      }
      if (mesh_->role(part.axis) != AxisRole::data) {
        throw ConfigError("volt: configure_model shards \"" + where + "\" along the axis \"" + part.axis + "\", whose "
                          "role is " + role_name(mesh_->role(part.axis)) + " (mesh " + mesh_->shape() + "); a part is "
                          "sharded along a data axis, whose ranks train on different batches.");
      }
      const MeshAxis* rest = mesh_->data_except(part.axis);  // HSDP: the blocks averaged across the other data axes
      add_part<FullySharded>(part.module, where, std::move(own), index, mesh_->axis(part.axis), {part.axis},
                             rest != nullptr ? &backend_on(*rest) : nullptr);
    }
  }
  std::vector<at::Tensor> rest;
  for (std::size_t j = 0; j < params.size(); ++j) {
    if (where_[j].first == nullptr) rest.push_back(params[j]);
  }
  if (!rest.empty()) add_default_part(module, std::move(rest), index);
  assign_units(plan, index);
  stepped_.clear();
  each<role::steps_pieces>([&](auto& h) {
    for (const at::Tensor& p : h.group.module_parameters()) stepped_.insert(p.unsafeGetTensorImpl());
  });
  plan_ = plan;
  planned_params_ = std::move(ids);
  module_ = &module;
  if (count<role::steps_pieces>() > 1 && this->is_global_zero()) {  // said before training, not at the first save
    std::cerr << "volt: warning: configure_model plans " << count<role::steps_pieces>() << " sharded parts; " << name
              << "'s checkpoints hold the optimizer's state of one sharded part, so a checkpoint of this fit "
              << "(ModelCheckpoint, save_checkpoint, a stop signal's) will be refused. Plan one sharded part, or "
              << "save the weights only (save_weights_only)." << std::endl;
  }
}

/// What no planned part holds (`rest`), under the default part's layout: replicated, or sharded (ZeRO) over the data
/// axes flattened, or (FSDP) sharded along the innermost data axis and replicated across the others.
template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::add_default_part(torch::nn::Module& module, std::vector<at::Tensor> rest,
                                             const std::unordered_map<const void*, std::size_t>& index) {
  std::vector<std::string> data;
  for (const Mesh::Dim& d : mesh_->dims()) {
    if (d.role == AxisRole::data) data.push_back(d.name);
  }
  if (layout_type::stage == 3 && !data.empty()) {
    const MeshAxis* across = mesh_->data_except(data.back());
    add_part<layout_type>(&module, "", std::move(rest), index, mesh_->axis(data.back()), {data.back()},
                          across != nullptr ? &backend_on(*across) : nullptr);
  } else {
    add_part<layout_type>(&module, "", std::move(rest), index, mesh_->data(), std::move(data), nullptr);
  }
}

/// A part of `params` (in `index`, the module's) held under layout `T` along `along` (the mesh axes `covered`), its
/// blocks averaged across `across` (null: none).
template <class L, class B, class... Ls>
template <class T>
void Parallel<L, B, Ls...>::add_part(torch::nn::Module* module, const std::string& where, std::vector<at::Tensor> params,
                                     const std::unordered_map<const void*, std::size_t>& index, const MeshAxis& along,
                                     const std::vector<std::string>& covered, B* across) {
  bool writes = true;  // the ranks at coordinate 0 on every axis off `along` write its pieces (the others hold copies)
  for (const MeshAxis& a : mesh_->axes()) {
    if (std::find(covered.begin(), covered.end(), a.name()) == covered.end() && a.rank() != 0) writes = false;
  }
  auto part = std::make_unique<Part>(module, where.empty() ? where : where + ".", writes, std::in_place_type<Held<T>>,
                                     detail::PartGroup<B, T>(backend_on(along), across, params, std::get<T>(layouts_),
                                                             place_));
  for (std::size_t k = 0; k < params.size(); ++k) {
    const std::size_t j = index.at(params[k].unsafeGetTensorImpl());
    part->index.push_back(j);
    where_[j] = {part.get(), k};
  }
  parts_.push_back(std::move(part));
}

/// Each unit `plan` declares handed to the sharded part that holds its parameters, in the declared order (a unit of
/// another part is that part's business: a replicated part runs its units as plain calls); a unit without parameters
/// to the one sharded part where there is one part (with several, the router runs such a unit as a plain call).
template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::assign_units(const ModelPlan& plan,
                                         const std::unordered_map<const void*, std::size_t>& index) {
  std::unordered_map<const Part*, std::vector<const torch::nn::Module*>> units;
  for (const torch::nn::Module* unit : plan.declared_units()) {
    const Part* owner = nullptr;
    bool first = true;
    for (const at::Tensor& p : unit->parameters(/*recurse=*/true)) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      const Part* part = it == index.end() ? nullptr : where_[it->second].first;
      if (!first && part != owner) {
        throw ConfigError("volt: configure_model declared a " + unit->name() + " as a unit, and it holds parameters of "
                          "two parts; a unit lies inside one part.");
      }
      owner = part;
      first = false;
    }
    if (owner == nullptr && first && parts_.size() == 1) owner = parts_.front().get();
    if (owner != nullptr) units[owner].push_back(unit);
  }
  for (const auto& part : parts_) {
    each_of<role::gathers_units>(*part, [&](auto& h) { h.group.set_units(units[part.get()]); });
  }
}

/// The dotted name of `part` in `module` ("" for the module itself); refused where it is not inside it.
template <class L, class B, class... Ls>
std::string Parallel<L, B, Ls...>::path_of(const torch::nn::Module& module, const torch::nn::Module& part) const {
  if (&part == &module) return "";
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (item.value().get() == &part) return item.key();
  }
  throw ConfigError("volt: configure_model planned a " + part.name() + " that is not a submodule of the module fitted "
                    "(a " + module.name() + "); plan the module's own submodules.");
}

template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::refuse_several(bool saving) const {
  const std::size_t n = count<role::steps_pieces>();
  if (n <= 1) return;
  throw CheckpointError(std::string("volt: ") + name + " " + (saving ? "writes" : "reads") + " the optimizer's state "
                        "of one sharded part, and this module plans " + std::to_string(n) + " of them; " +
                        (saving ? "nothing was written. Plan one sharded part, or save the weights only "
                                  "(save_weights_only)."
                                : "nothing was loaded. Plan one sharded part to resume it."));
}

/// Each part's holder sees the optimizer (ZeRO gives it its pieces); where several parts hold units, each unit is
/// routed to its part's scheduler.
template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::setup_optimizer(torch::optim::Optimizer& optimizer) {
  each([&](auto& h) { h.holder.setup_optimizer(h.group, optimizer); });
  std::vector<std::vector<at::Tensor>> params;
  std::vector<detail::UnitRuntime*> runtimes;
  each<role::gathers_units>([&](auto& h) {
    params.push_back(h.group.module_parameters());
    runtimes.push_back(h.holder.units());
  });
  if (!runtimes.empty() && parts_.size() > 1) router_.install(params, runtimes);
}

/// By value: every gradient this rank steps, clamped. By norm: the total over every part, the squares of each part
/// that steps pieces summed along its axis (each rank on it holds other pieces), the rest counted once.
template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::clip_gradients(const std::vector<at::Tensor>& params, double value, ClipAlgorithm algorithm) {
  if (count<role::steps_pieces>() == 0) return detail::clip_gradients(params, value, algorithm);
  std::vector<at::Tensor> tensors;
  detail::PartNorms<B> total{{}, this->root_device(), detail::squares_dtype(params)};
  const auto with_grad = [](const at::Tensor& t) { return t.grad().defined(); };
  each<role::steps_pieces>([&](auto& h) {
    const std::vector<at::Tensor> pieces = h.holder.piece_tensors();
    total.groups.emplace_back(static_cast<std::size_t>(std::count_if(pieces.begin(), pieces.end(), with_grad)),
                              &h.group.backend());
    tensors.insert(tensors.end(), pieces.begin(), pieces.end());
  });
  std::size_t whole = 0;
  for (const at::Tensor& p : params) {
    if (stepped_.count(p.unsafeGetTensorImpl()) != 0) continue;
    tensors.push_back(p);
    whole += with_grad(p) ? 1 : 0;
  }
  total.groups.emplace_back(whole, nullptr);
  detail::clip_gradients(tensors, value, algorithm, std::move(total));
}

template <class L, class B, class... Ls>
at::Tensor Parallel<L, B, Ls...>::optimizer_state(torch::optim::Optimizer& optimizer) {
  if (count<role::steps_pieces>() == 0) return Base::optimizer_state(optimizer);
  refuse_several(/*saving=*/true);
  at::Tensor out;
  each<role::steps_pieces>([&](auto& h) { out = h.holder.optimizer_state(h.group, optimizer); });
  return out;
}

template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::load_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& bytes,
                                                 const std::string& path) {
  if (count<role::steps_pieces>() == 0) return checkpoint::load_optimizer_state(optimizer, bytes, path);
  refuse_several(/*saving=*/false);
  each<role::steps_pieces>([&](auto& h) { h.holder.load_optimizer_state(h.group, optimizer, bytes, path); });
}

template <class L, class B, class... Ls>
ForwardScope Parallel<L, B, Ls...>::forward_scope(Stage stage) {
  bool active = false;
  each<role::gathers_units>([&](auto& h) { active = active || h.holder.units() != nullptr; });
  if (!active) return ForwardScope();
  router_.reset();
  each<role::gathers_units>([&](auto& h) { h.holder.begin_forward(stage); });
  return ForwardScope([this](bool backward_follows) {
    each<role::gathers_units>([&](auto& h) { h.holder.end_forward(h.group, backward_follows); });
  });
}

template <class L, class B, class... Ls>
c10::Dict<std::string, at::Tensor> Parallel<L, B, Ls...>::module_state(const torch::nn::Module& module, bool on_device) {
  if (count<role::gathers_units>() == 0) return Base::module_state(module, on_device);
  std::unordered_map<std::string, at::Tensor> gathered;
  for (const auto& part : parts_) {  // collective along each sharded part's axis
    each_of<role::gathers_units>(*part, [&](auto& h) {
      for (const auto& item : h.holder.module_state(h.group, *part->module, on_device)) {
        gathered.emplace(part->prefix + item.key(), item.value());
      }
    });
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

template <class L, class B, class... Ls>
void Parallel<L, B, Ls...>::load_module_state(torch::nn::Module& module, const checkpoint::Dict& state) {
  if (count<role::gathers_units>() == 0) return checkpoint::load_module_state(module, state);
  std::unordered_set<const void*> sharded;
  for (const auto& part : parts_) {
    each_of<role::gathers_units>(*part, [&](auto& h) {
      checkpoint::Dict own(state.keyType(), state.valueType());
      for (const auto& item : state) {
        const std::string key = item.key().toStringRef();
        if (key.compare(0, part->prefix.size(), part->prefix) == 0) own.insert(key.substr(part->prefix.size()), item.value());
      }
      h.holder.load_module_state(h.group, *part->module, own);
      for (const at::Tensor& p : h.group.module_parameters()) sharded.insert(p.unsafeGetTensorImpl());
    });
  }
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters(/*recurse=*/true)) {
    if (sharded.count(p.value().unsafeGetTensorImpl()) == 0) p.value().copy_(state.at(p.key()).toTensor());
  }
  for (auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) b.value().copy_(state.at(b.key()).toTensor());
  }
}

template <class L, class B, class... Ls>
at::Tensor Parallel<L, B, Ls...>::window_gradient(std::size_t j) {
  if (j >= where_.size() || where_[j].first == nullptr) return at::Tensor();
  at::Tensor g;
  each_of<role::gathers_units>(*where_[j].first, [&](auto& h) {
    g = h.holder.window_gradient(h.group, where_[j].second);
    if (g.defined() && h.group.replicas() != nullptr) h.group.replicas()->all_reduce_(g, Reduce::mean);
  });
  return g;
}

template <class L, class B, class... Ls>
std::vector<checkpoint::Slice> Parallel<L, B, Ls...>::state_slices() const {
  std::vector<checkpoint::Slice> out;
  for (const auto& part : parts_) {
    bool pieces = false;
    each_of<role::steps_pieces>(*part, [&](auto& h) {
      pieces = true;
      if (!part->writes) return;
      for (checkpoint::Slice s : h.holder.state_slices(h.group)) {
        s.param = part->index[s.param];
        out.push_back(std::move(s));
      }
    });
    if (pieces) continue;
    each_of(*part, [&](auto& h) {  // every rank holds it: a near-equal part of it each
      const std::vector<at::Tensor>& params = h.group.module_parameters();
      for (std::size_t k = 0; k < params.size(); ++k) {
        auto s = checkpoint::replicated_slice(part->index[k], params[k], this->global_rank(), this->world_size());
        if (s) out.push_back(std::move(*s));
      }
    });
  }
  return out;
}

template <class L, class B, class... Ls>
std::size_t Parallel<L, B, Ls...>::parameter_bytes() const {
  std::size_t bytes = 0;
  for (const auto& part : parts_) {
    std::visit([&](auto& h) {
      if constexpr (declares_role<typename std::remove_cvref_t<decltype(h)>::layout, role::gathers_units>) {
        bytes += h.holder.parameter_bytes();
      } else {
        for (const at::Tensor& p : h.group.module_parameters()) bytes += detail::bytes_of(p);
      }
    }, part->held);
  }
  return bytes;
}

template <class L, class B, class... Ls>
std::vector<std::vector<std::size_t>> Parallel<L, B, Ls...>::bucket_layout() const {
  std::vector<std::vector<std::size_t>> out;
  for (const auto& part : parts_) {
    each_of(*part, [&](auto& h) {
      for (std::vector<std::size_t> bucket : h.holder.bucket_layout()) {
        for (std::size_t& k : bucket) k = part->index[k];
        out.push_back(std::move(bucket));
      }
    });
  }
  return out;
}

}  // namespace volt
