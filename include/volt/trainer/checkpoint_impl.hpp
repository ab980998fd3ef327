#pragma once
/// \file
/// Part of volt/trainer.hpp, included at its end: the Trainer's side of checkpoints — gathering every rank's
/// share of a save, resolving `"last"`/`"best"` through the callbacks, and loading a checked `ResumeState`
/// (connectors/checkpoint_connector.hpp) with backups. Not a header of its own: include volt/trainer.hpp.

#include <algorithm>
#include <exception>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace volt {

namespace detail {

/// What a sharded save hands the checkpoint writer (checkpoint/sharded.hpp): the module's parameters by name, this rank's
/// slices of them from the strategy, and each optimizer whose state is elementwise with its groups as the module's
/// parameter indices in the layout of an unsharded run (the others' whole archives go into meta.ckpt).
template <class S>
checkpoint::ShardedSave sharded_save_of(S& strategy, const torch::nn::Module& module, const std::vector<at::Tensor>& params,
                                        std::vector<ScheduledOptimizer>& optimizers, bool weights_only) {
  checkpoint::ShardedSave s;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    s.names.push_back(p.key());
    s.shapes.push_back(p.value().sizes().vec());
  }
  s.slices = strategy.state_slices();
  std::unordered_map<const void*, std::size_t> index;
  for (std::size_t j = 0; j < params.size(); ++j) index.emplace(params[j].unsafeGetTensorImpl(), j);
  for (auto& o : optimizers) {
    if (weights_only) break;
    checkpoint::ShardedOptimizer so;
    if (has_state_codec(o.optimizer())) {
      so.optimizer = &o.optimizer();
      for (const auto& group : strategy.full_param_groups(o.optimizer())) {
        so.groups.emplace_back();
        for (const at::Tensor& p : group) {
          const auto it = index.find(p.unsafeGetTensorImpl());
          if (it == index.end()) {
            throw ConfigError("volt: a sharded checkpoint names each optimizer's tensors by the module's parameter "
                              "names, and an optimizer steps a tensor that is not one of the module's parameters; "
                              "save the full form (set_state_dict_type(volt::StateDictType::full)).");
          }
          so.groups.back().push_back(it->second);
        }
      }
    }
    s.optimizers.push_back(std::move(so));
  }
  s.rank = strategy.global_rank();
  s.world = strategy.world_size();
  s.all_gather = [&strategy](const std::string& b) { return strategy.host_all_gather(b); };
  return s;
}

}  // namespace detail

/// See the declaration. Every rank gathers its share (collectives); in the full form rank zero writes (or hands the copy
/// to the writer's thread), in the sharded form every rank writes its pieces; all wait.
template <class S, class P, class A, class... Cs>
void Trainer<S, P, A, Cs...>::save_checkpoint(const std::vector<std::string>& paths, const SaveOptions& options) {
  const std::string path = paths.empty() ? std::string() : paths.front();
  if (module_ == nullptr) {
    throw std::logic_error("volt: save_checkpoint(\"" + path + "\") was called, but no fit has run in this process, so "
                           "there is nothing to save yet. (With DDP<Spawn>, fit runs in worker processes: save from "
                           "inside fit, with ModelCheckpoint or a callback.)");
  }
  if (std::any_of(paths.begin(), paths.end(), [](const std::string& p) { return p.empty(); }) || paths.empty()) {
    throw std::invalid_argument("volt: save_checkpoint needs a file path; got an empty string.");
  }
  bool sharded = false;
  if constexpr (declares_role<strategy_type, role::writes_shards>) sharded = strategy_.state_dict_type() == StateDictType::sharded;
  if (sharded && options.safetensors) {
    throw ConfigError("volt: a weights file beside each checkpoint (ModelCheckpoint's save_safetensors) needs the "
                      "full checkpoint form, and the strategy writes sharded ones; drop one of the two.");
  }
  // The module's state, from the strategy that holds it (collective; ManualParallel refuses on several ranks); in the
  // sharded form the parameters are each rank's pieces and the contents keep the buffers. Likewise the optimizers'.
  const c10::Dict<std::string, at::Tensor> weights =
      !sharded ? strategy_.module_state(*module_, /*on_device=*/options.async_save)
               : (strategy_.is_global_zero() ? checkpoint::buffer_state(*module_) : c10::Dict<std::string, at::Tensor>());
  std::vector<at::Tensor> optimizers;
  for (auto& o : optim_) {
    if (options.weights_only) break;
    if constexpr (declares_role<strategy_type, role::writes_shards>) {
      if (sharded && detail::has_state_codec(o.optimizer())) {
        optimizers.push_back(strategy_.is_global_zero()
                                 ? checkpoint::optimizer_skeleton(o.optimizer(), strategy_.full_param_groups(o.optimizer()))
                                 : at::Tensor());
        continue;
      }
    }
    optimizers.push_back(strategy_.optimizer_state(o.optimizer()));  // ZeRO gathers its pieces
  }
  checkpoint::Dict d = checkpoint::make_dict();
  if (strategy_.is_global_zero()) d.insert(checkpoint::keys::state_dict, weights);
  d = checkpoint_contents(std::move(d), optimizers, options.weights_only);  // collective
  // The loggers hear of the files once they are all in place (after the caller's `done`).
  std::function<void()> done = options.done;
  if constexpr (detail::hears_saves<Cs...>) {
    if (strategy_.is_global_zero()) {
      std::vector<std::string> files = paths;
      for (const auto& p : paths) {
        if (options.safetensors) files.push_back(checkpoint::weights_beside(p));
      }
      done = [this, first = std::move(done), files = std::move(files)] {
        if (first) first();
        try {  // the files are in place: a logger that fails to take them costs a warning, not the save
          detail::after_save_checkpoint(callbacks_, true, files);
        } catch (const std::exception& e) {
          std::cerr << "volt: a logger's after_save_checkpoint failed: " << e.what() << "\n";
        }
      };
    }
  }
  if constexpr (declares_role<strategy_type, role::writes_shards>) {
    if (sharded) {
      writer_.wait();  // files land in the order they were saved
      checkpoint::ShardedSave s = detail::sharded_save_of(strategy_, *module_, params_, optim_, options.weights_only);
      s.meta = std::move(d);
      checkpoint::save_sharded(paths, s);
      if (done && strategy_.is_global_zero()) done();
    }
  }
  if (!sharded && strategy_.is_global_zero()) {
    if (options.async_save) {
      writer_.submit(paths, d, options.safetensors, done);
    } else {
      writer_.wait();  // files land in the order they were saved
      checkpoint::save(paths, std::move(d), options.safetensors);
      if (done) done();
    }
  }
  strategy_.barrier();
}

/// The contents of a checkpoint on rank zero (elsewhere empty): `d` (its state_dict) and the optimizers' archives given,
/// every rank's share of the rest gathered (collectives: generator states, the metrics' sums, mid-window gradients),
/// the loops' and callbacks' states, and the on_save_checkpoint hooks run.
template <class S, class P, class A, class... Cs>
checkpoint::Dict Trainer<S, P, A, Cs...>::checkpoint_contents(checkpoint::Dict d, const std::vector<at::Tensor>& optimizers,
                                                             bool weights_only) {
  std::vector<at::Tensor> rng;
  c10::impl::GenericList grads(c10::AnyType::get()), metrics(c10::AnyType::get());
  if (!weights_only) {
    metrics = checkpoint::metrics_of_ranks(train_store_, strategy_.world_size(),
                                           [this](const std::string& b) { return strategy_.host_all_gather(b); });
    for (const at::Tensor& t : checkpoint::rng_states()) rng.push_back(gather_ranks(t));
    // Gradients accumulated so far in this window, or (manual optimization) the module's gradients.
    // (FSDP, whose window's micro-batches were reduce-scattered as they came: their average, the same on every rank.)
    if (progress_.keeps_grads || (progress_.in_train_batch && progress_.mid_window)) {
      for (std::size_t j = 0; j < params_.size(); ++j) {
        at::Tensor g = params_[j].grad();
        if constexpr (declares_role<strategy_type, role::keeps_window_gradients>) {
          if (at::Tensor w = strategy_.window_gradient(j); w.defined()) g = std::move(w);
        }
        const at::Tensor defined = gather_ranks(torch::tensor({g.defined() ? 1 : 0}, torch::kUInt8)).flatten();
        grads.push_back(checkpoint::grad_to_state(defined, [&] {
          return gather_ranks(g.defined() ? g.detach() : torch::zeros_like(params_[j]));
        }));
      }
    }
  }
  if (!strategy_.is_global_zero()) return d;
  d.insert(checkpoint::keys::epoch, state_.current_epoch);  // at the top level too, where Lightning's tools read them
  d.insert(checkpoint::keys::global_step, state_.global_step);
  if (!hparams_.effective.empty()) d.insert(checkpoint::keys::hyper_parameters, detail::to_ivalue(hparams_.effective));
  if (!weights_only) {
    checkpoint::FitState fit;
    std::vector<int64_t> optimizer_steps;
    for (std::size_t i = 0; i < optim_.size(); ++i) {
      const detail::ScheduledOptimizer& o = optim_[i];
      fit.optimizers.push_back(optimizers[i]);
      if (o.config.scheduler) fit.schedulers.push_back({o.config.scheduler.get(), static_cast<int64_t>(i)});
      optimizer_steps.push_back(o.steps);
    }
    fit.precision = precision_.state_dict();
    fit.loops = progress_.state_dict(state_.current_epoch, state_.global_step,
                                     should_check_val(progress_.train_batch_idx, progress_.train_is_last),
                                     strategy_.world_size(), optimizer_steps);
    if (train_loader_state_) {
      fit.train_loader = train_loader_state_();
    } else if (!fitting_ && final_loader_state_) {
      fit.train_loader = *final_loader_state_;
    }
    fit.metrics = std::move(metrics);
    fit.rng = std::move(rng);
    fit.callbacks = checkpoint::callbacks_to_state(callbacks_);
    checkpoint::write_fit_state(d, fit);
    d.insert(checkpoint::keys::accumulated_grads, grads);
  }
  if (save_hooks_) save_hooks_(d, weights_only);
  return d;
}

/// Every rank's copy of `t` stacked in rank order ([world_size, ...]), on the CPU.
template <class S, class P, class A, class... Cs>
at::Tensor Trainer<S, P, A, Cs...>::gather_ranks(const at::Tensor& t) {
  if (strategy_.world_size() > 1) return strategy_.all_gather(t).cpu();
  return t.unsqueeze(0).cpu();
}

/// `"last"` and `"best"` through the callbacks that find checkpoints (callbacks/concept.hpp); any other path
/// as it is. "" for a "last" that finds nothing yet (a fresh start, as Lightning; for `run` validate, test or
/// predict: the module's own weights). `run` names the call in messages.
template <class S, class P, class A, class... Cs>
std::string Trainer<S, P, A, Cs...>::resolve_ckpt_path(const std::string& path, const char* run) const {
  if (path != "last" && path != "best") return path;
  const std::string call = std::string(run) + "(..., ckpt_path=\"" + path + "\")";
  bool any = false;
  const std::string found = detail::first_answer<std::string>(callbacks_, [&](const auto& c)
    requires requires { c.find_last_checkpoint(*this); c.find_best_checkpoint(*this); }
  {
    any = true;  // the first that can find checkpoints is always asked
    return path == "last" ? c.find_last_checkpoint(*this) : c.find_best_checkpoint(*this);
  });
  if (!any) {
    throw ConfigError("volt: " + call + " looks for checkpoints through a ModelCheckpoint callback, and this Trainer "
                      "has none. Add one, or give the checkpoint's file path.");
  }
  if (found.empty() && path == "best") {
    throw CheckpointError("volt: " + call + ": no best checkpoint is known yet (no ModelCheckpoint has saved one "
                          "with a monitor, and its folder holds no checkpoint naming one).");
  }
  if (found.empty() && strategy_.is_global_zero()) {
    std::cerr << "volt: " << call << ": no checkpoint was found yet; "
              << (std::string(run) == "fit" ? "training starts from the beginning.\n"
                                            : "the module's own weights are used.\n");
  }
  return found;
}

/// validate/test/predict's `ckpt_path`, as Lightning's `restore_model`: the file read and its weights checked against
/// the module (nothing changes when they do not fit), the module's on_load_checkpoint given the file, then the weights
/// copied in. Optimizers and loops are not taken (they are a fit's), nor callbacks' states, which Lightning restores
/// too (a ModelCheckpoint's bookkeeping belongs to the fits that write its folder).
template <class S, class P, class A, class... Cs>
template <class Impl>
void Trainer<S, P, A, Cs...>::load_for_evaluation(Impl& module, const std::string& ckpt_path, const char* run) {
  if (ckpt_path.empty()) return;
  const std::string path = resolve_ckpt_path(ckpt_path, run);
  if (path.empty()) return;  // "last" found nothing (said)
  const checkpoint::View file = checkpoint::View::read(path);
  const checkpoint::View weights = file.sub(checkpoint::keys::state_dict);
  checkpoint::check_module_state(module, weights);
  if constexpr (requires(const checkpoint::Dict& c) { module.on_load_checkpoint(c); }) {
    module.on_load_checkpoint(file.dict());
  }
  strategy_.load_module_state(module, weights.dict());
}

/// Reads and checks `path` (checkpoint_connector.hpp), then loads all of it: on any error nothing is changed.
/// Returns where the fit loop goes on.
template <class S, class P, class A, class... Cs>
template <class Impl, class TL>
detail::ResumePoint Trainer<S, P, A, Cs...>::restore(Impl& module, TL& train_loader, const std::string& path) {
  checkpoint::FitShape shape{params_.size(), {}};
  for (const auto& o : optim_) shape.has_scheduler.push_back(o.config.scheduler != nullptr);
  checkpoint::ResumeState r = checkpoint::read_for_resume(path, module, train_loader, shape, strategy_.global_rank());

  // What can still refuse the state (the optimizers, the precision, callbacks, the module) goes first, with backups.
  const auto precision_backup = precision_.state_dict();
  std::vector<std::function<void()>> undo;
  try {
    for (std::size_t i = 0; i < optim_.size(); ++i) {
      torch::optim::Optimizer& o = optim_[i].optimizer();
      const at::Tensor backup = checkpoint::optimizer_state(o);
      try {
        strategy_.load_optimizer_state(o, r.optimizers[i], path);  // refuses a state that does not fit, unchanged
      } catch (const CheckpointError& e) {
        if (optim_.size() == 1) throw;
        throw CheckpointError(std::string(e.what()) + " (It is optimizer " + std::to_string(i) + " of " +
                              std::to_string(optim_.size()) + ".)");
      }
      undo.push_back([&o, backup, path] { checkpoint::load_optimizer_state(o, backup, path); });
    }
    if (!r.precision.empty()) precision_.load_state_dict(r.precision);
    checkpoint::load_callbacks_state(callbacks_, r.callbacks, undo);
    if constexpr (requires(const checkpoint::Dict& c) { module.on_load_checkpoint(c); }) module.on_load_checkpoint(r.file.dict());
  } catch (const std::exception& e) {
    for (auto& u : undo) u();
    precision_.load_state_dict(precision_backup);
    if (undo.size() < optim_.size()) throw;  // an optimizer's state: its message says which file and why
    throw CheckpointError("volt: " + path + " could not be loaded (" + std::string(e.what()) + "); nothing was changed.");
  }

  // The rest cannot fail any more.
  for (std::size_t i = 0, k = 0; i < optim_.size(); ++i) {
    if (optim_[i].config.scheduler) checkpoint::load_scheduler_step_count(*optim_[i].config.scheduler, r.scheduler_step_counts[k++]);
    optim_[i].steps = r.point.optimizer_steps.empty() ? r.point.global_step : r.point.optimizer_steps[i];
  }
  strategy_.load_module_state(module, r.weights);
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < r.grads.size(); ++i) {
      if (r.grads[i]) params_[i].mutable_grad() = r.grads[i]->to(params_[i].device());
    }
  }
  if constexpr (data::PositionedLoader<TL>) {
    if (r.train_loader) train_loader.load_state_dict(*r.train_loader);
  }
  state_.current_epoch = r.point.epoch;
  state_.global_step = r.point.global_step;
  progress_.load(r.point);
  train_store_.clear();
  for (auto& e : detail::resumed_entries(r.metrics, strategy_.global_rank(), strategy_.world_size())) {
    if (e.accumulated.defined()) e.accumulated = e.accumulated.to(state_.device);
    train_store_.entries().push_back(std::move(e));
  }
  const detail::ResumePoint& p = r.point;
  if (strategy_.is_global_zero()) {  // where the fit goes on, as Lightning's "Restored all states from ..."
    std::cerr << "volt: resuming from " << path << ": epoch " << p.epoch << ", global step " << p.global_step << ", "
              << (p.epoch_finished        ? "at the end of the epoch"
                  : p.batch_in_epoch == 0 ? "at the start of the epoch"
                                          : "after batch " + std::to_string(p.batch_in_epoch - 1) + " of the epoch")
              << (p.val_pending ? " (its validation runs first)" : "") << ".\n";
  }
  if (!p.loader_positioned && p.world_size != strategy_.world_size() && p.batch_in_epoch > 0 && !p.epoch_finished &&
      strategy_.is_global_zero()) {
    std::cerr << "volt: " << path << " was saved mid-epoch on " << p.world_size << " ranks and resumes on "
              << strategy_.world_size() << "; the training loader keeps no position (use a volt::data loader), so "
              << p.batch_in_epoch << " batches of each rank's shard are skipped, which is not the same samples.\n";
  }
  return std::move(r.point);
}

}  // namespace volt
