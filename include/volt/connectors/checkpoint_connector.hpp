#pragma once
/// \file
/// What a fit writes into a checkpoint and reads back to resume, as Lightning's checkpoint connector: every
/// entry's key is a named constant here, and each entry's writer sits next to its reader. It never sees the
/// Trainer's type. The file format itself (atomic writes, checked reads, the table of entries) is
/// volt/checkpoint.hpp.
///
/// Resuming is two steps: `read_for_resume` reads the file and checks every entry against this fit (module,
/// optimizer and scheduler count, training loader, gradients) and returns a `ResumeState`; the Trainer then
/// loads it (what can still refuse first, with backups), and its fit loop starts from the `ResumePoint` inside.

#include "volt/callbacks/concept.hpp"
#include "volt/checkpoint.hpp"
#include "volt/data/concept.hpp"
#include "volt/loops/progress.hpp"
#include "volt/metric_store.hpp"

#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <vector>

namespace volt::checkpoint {

// ---- the training loader's position ------------------------------------------------------------------------

namespace loader_keys {
inline constexpr const char* train = "train";
inline constexpr const char* epoch = "epoch";
inline constexpr const char* consumed = "consumed";
inline constexpr const char* dataset_size = "dataset_size";
inline constexpr const char* batch_size = "batch_size";
inline constexpr const char* seed = "seed";
inline constexpr const char* shuffle = "shuffle";
inline constexpr const char* drop_last = "drop_last";
inline constexpr const char* world_size = "world_size";
}  // namespace loader_keys

inline Dict loader_state_to_dict(const data::LoaderState& s) {
  Dict d = make_dict();
  d.insert(loader_keys::epoch, s.epoch);
  d.insert(loader_keys::consumed, s.consumed);
  d.insert(loader_keys::dataset_size, s.dataset_size);
  d.insert(loader_keys::batch_size, s.batch_size);
  d.insert(loader_keys::seed, static_cast<int64_t>(s.seed));
  d.insert(loader_keys::shuffle, s.shuffle);
  d.insert(loader_keys::drop_last, s.drop_last);
  d.insert(loader_keys::world_size, static_cast<int64_t>(s.world_size));
  return d;
}
inline data::LoaderState loader_state_from_dict(const View& d) {
  auto i = [&](const char* k) { return d.integer(k); };
  auto b = [&](const char* k) { return d.flag(k); };
  return data::LoaderState{i(loader_keys::epoch), i(loader_keys::consumed), i(loader_keys::dataset_size),
                           i(loader_keys::batch_size), static_cast<uint64_t>(i(loader_keys::seed)),
                           b(loader_keys::shuffle), b(loader_keys::drop_last),
                           static_cast<int>(i(loader_keys::world_size))};
}

// ---- the training epoch's metric sums ----------------------------------------------------------------------

namespace metric_keys {
inline constexpr const char* name = "name";
inline constexpr const char* on_step = "on_step";
inline constexpr const char* on_epoch = "on_epoch";
inline constexpr const char* prog_bar = "prog_bar";
inline constexpr const char* logger = "logger";
inline constexpr const char* sync_dist = "sync_dist";
inline constexpr const char* reduce = "reduce";
inline constexpr const char* accumulated = "accumulated";
inline constexpr const char* weight = "weight";
}  // namespace metric_keys

inline c10::impl::GenericList metrics_to_state(volt::detail::MetricStore& store) {
  c10::impl::GenericList out(c10::AnyType::get());
  for (const auto& e : store.entries()) {
    Dict d = make_dict();
    d.insert(metric_keys::name, e.name);
    d.insert(metric_keys::on_step, e.on_step);
    d.insert(metric_keys::on_epoch, e.on_epoch);
    d.insert(metric_keys::prog_bar, e.prog_bar);
    d.insert(metric_keys::logger, e.logger);
    d.insert(metric_keys::sync_dist, e.sync_dist);
    d.insert(metric_keys::reduce, static_cast<int64_t>(e.reduce));
    d.insert(metric_keys::accumulated, e.accumulated.defined() ? c10::IValue(e.accumulated.cpu()) : c10::IValue());
    d.insert(metric_keys::weight, e.weight);
    out.push_back(d);
  }
  return out;
}

/// The `metrics` entry: every rank's running sums, in rank order (a collective: every rank calls it). `gather` is the
/// strategy's `host_all_gather`: each rank's list crosses as LibTorch pickles it.
template <class Gather>
c10::impl::GenericList metrics_of_ranks(volt::detail::MetricStore& store, int world_size, Gather&& gather) {
  c10::impl::GenericList out(c10::AnyType::get());
  const c10::impl::GenericList mine = metrics_to_state(store);
  if (world_size == 1) {
    out.push_back(mine);
    return out;
  }
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(mine));
  for (const std::string& b : gather(std::string(bytes.begin(), bytes.end()))) {
    out.push_back(torch::pickle_load(std::vector<char>(b.begin(), b.end())));
  }
  return out;
}

/// The metric sums `file` holds, per saving rank. Files of volt 0.x before every rank's were kept hold rank zero's
/// list alone (a list of entries, not of lists): read as one rank's.
inline std::vector<std::vector<volt::detail::MetricEntry>> metrics_from_state(const View& file) {
  auto entries_of = [&](const c10::IValue& list) {
    std::vector<volt::detail::MetricEntry> out;
    for (const auto& item : list.toListRef()) {
      const View d = file.of(item);
      auto b = [&](const char* k) { return d.flag(k); };
      volt::detail::MetricEntry e;
      e.name = d.at(metric_keys::name).toStringRef();
      e.on_step = b(metric_keys::on_step);
      e.on_epoch = b(metric_keys::on_epoch);
      e.prog_bar = b(metric_keys::prog_bar);
      e.logger = b(metric_keys::logger);
      e.sync_dist = b(metric_keys::sync_dist);
      const int64_t reduce = d.integer(metric_keys::reduce);
      if (reduce < 0 || reduce > static_cast<int64_t>(Reduce::min)) {
        file.fail(" has a metric \"" + e.name + "\" with reduction " + std::to_string(reduce) +
                  "; volt writes 0 to 3.");
      }
      e.reduce = static_cast<Reduce>(reduce);
      const c10::IValue acc = d.at(metric_keys::accumulated);
      if (acc.isTensor()) e.accumulated = acc.toTensor();
      e.weight = d.at(metric_keys::weight).toDouble();
      out.push_back(std::move(e));
    }
    return out;
  };
  const c10::IValue& all = file.at(keys::metrics);
  const auto ranks = all.toListRef();
  if (!ranks.empty() && !ranks[0].isList()) return {entries_of(all)};
  std::vector<std::vector<volt::detail::MetricEntry>> out;
  for (const auto& r : ranks) out.push_back(entries_of(r));
  return out;
}

// ---- learning-rate schedulers --------------------------------------------------------------------------------

inline constexpr const char* kSchedulerStepCount = "step_count";
/// The index of the scheduler's optimizer in configure_optimizers' order (files without it: the order of the list).
inline constexpr const char* kSchedulerOptimizer = "optimizer";

namespace detail {
/// LibTorch's schedulers keep their step count protected and have no save/load; a checkpoint needs it.
struct SchedulerAccess : torch::optim::LRScheduler {
  static unsigned& step_count(torch::optim::LRScheduler& s) { return s.*(&SchedulerAccess::step_count_); }
};
}  // namespace detail

/// A scheduler and the index of its optimizer.
struct SchedulerOf {
  torch::optim::LRScheduler* scheduler = nullptr;
  int64_t optimizer = 0;
};

/// `lr_schedulers`: one entry per scheduler, in the order of the optimizers that have one, each naming its optimizer.
inline c10::impl::GenericList schedulers_to_state(const std::vector<SchedulerOf>& schedulers) {
  c10::impl::GenericList out(c10::AnyType::get());
  for (const SchedulerOf& s : schedulers) {
    Dict d = make_dict();
    d.insert(kSchedulerStepCount, static_cast<int64_t>(detail::SchedulerAccess::step_count(*s.scheduler)));
    d.insert(kSchedulerOptimizer, s.optimizer);
    out.push_back(d);
  }
  return out;
}
inline void load_scheduler_step_count(torch::optim::LRScheduler& scheduler, int64_t step_count) {
  detail::SchedulerAccess::step_count(scheduler) = static_cast<unsigned>(step_count);
}

// ---- random generators, every rank's ---------------------------------------------------------------------

inline constexpr const char* kRngCpu = "cpu";
inline constexpr const char* kRngCuda = "cuda";

/// `rng`: each generator's states of every rank, stacked in rank order (CPU first, then each CUDA device).
inline Dict rng_to_state(const std::vector<at::Tensor>& gathered) {
  Dict r = make_dict();
  r.insert(kRngCpu, gathered.at(0));
  c10::List<at::Tensor> cuda;
  for (std::size_t i = 1; i < gathered.size(); ++i) cuda.push_back(gathered[i]);
  r.insert(kRngCuda, cuda);
  return r;
}

/// Row `rank` of a tensor stacked in rank order (row 0 when the file has fewer ranks).
inline at::Tensor rank_row(const at::Tensor& all, int rank) {
  return all.select(0, rank < all.size(0) ? rank : 0).clone();
}

/// This rank's generator states, in `rng_states()` order.
inline std::vector<at::Tensor> rng_from_state(const View& r, int rank) {
  std::vector<at::Tensor> out{rank_row(r.at(kRngCpu).toTensor(), rank)};
  for (const auto& t : r.at(kRngCuda).toListRef()) out.push_back(rank_row(t.toTensor(), rank));
  // Each state tried on a copy of its generator now, so a damaged one is refused before anything is loaded.
  auto generators = default_generators();
  for (std::size_t i = 0; i < std::min(out.size(), generators.size()); ++i) {
    try {
      at::Generator copy = generators[i].clone();
      copy.set_state(out[i]);
    } catch (const std::exception& e) {
      r.fail(" holds a random generator state that does not fit generator " + std::to_string(i) + " (" +
             volt::checkpoint::detail::first_line(e.what()) + ").");
    }
  }
  return out;
}

// ---- gradients accumulated mid-window, every rank's -------------------------------------------------------

inline constexpr const char* kGradDefined = "defined";
inline constexpr const char* kGrad = "grad";

/// One parameter's entry: every rank's gradient stacked (`gathered`), with which ranks have one
/// (`defined`, uint8 per rank); `None` when no rank has one.
inline c10::IValue grad_to_state(const at::Tensor& defined, const std::function<at::Tensor()>& gathered) {
  if (!defined.any().item<bool>()) return c10::IValue();
  Dict g = make_dict();
  g.insert(kGradDefined, defined);
  g.insert(kGrad, gathered());
  return g;
}
/// This rank's gradient in such an entry, if it had one.
inline std::optional<at::Tensor> grad_from_state(const c10::IValue& v, int rank) {
  if (!v.isGenericDict()) return std::nullopt;
  const auto g = v.toGenericDict();
  if (rank_row(g.at(kGradDefined).toTensor(), rank).item<uint8_t>() == 0) return std::nullopt;
  return rank_row(g.at(kGrad).toTensor(), rank);
}

// ---- callbacks ----------------------------------------------------------------------------------------------

/// A callback with state in checkpoints (callbacks/concept.hpp).
template <class C>
concept StatefulCallback = requires(const C& c) { c.state_dict(); };

/// The key of a callback's state: its `state_key()`, else its type's name.
template <class C>
std::string callback_key(const C& cb) {
  if constexpr (requires { { cb.state_key() } -> std::convertible_to<std::string>; }) {
    return cb.state_key();
  } else {
    return c10::demangle(typeid(C).name());
  }
}

template <class C>
c10::IValue callback_state(const C& cb) {
  auto st = cb.state_dict();
  if constexpr (std::is_same_v<decltype(st), std::map<std::string, double>>) {
    return from_map(st);
  } else {
    return c10::IValue(st);
  }
}
template <class C>
void load_callback_state(C& cb, const View& state) {
  if constexpr (requires(const std::map<std::string, double>& m) { cb.load_state_dict(m); }) {
    cb.load_state_dict(state.numbers());
  } else {
    cb.load_state_dict(state.dict());
  }
}

/// `callbacks`: each stateful callback's state under its key; a second callback with the same key gets `#2`, ...
template <class... Cs>
Dict callbacks_to_state(const std::tuple<Cs...>& callbacks) {
  Dict cbs = make_dict();
  ::volt::detail::for_each_callback(callbacks, [&](const auto& c) {
    if constexpr (StatefulCallback<std::remove_cvref_t<decltype(c)>>) {
      std::string key = callback_key(c);
      for (int n = 2; cbs.contains(key); ++n) key = callback_key(c) + "#" + std::to_string(n);
      cbs.insert(key, callback_state(c));
    }
  });
  return cbs;
}
/// Gives each stateful callback the state saved under its key (none saved: left as it is). For each one loaded,
/// `undo` receives a function that puts its previous state back.
template <class... Cs>
void load_callbacks_state(std::tuple<Cs...>& callbacks, const View& states, std::vector<std::function<void()>>& undo) {
  std::map<std::string, int> seen;
  ::volt::detail::for_each_callback(callbacks, [&](auto& c) {
    if constexpr (StatefulCallback<std::remove_cvref_t<decltype(c)>>) {
      std::string key = callback_key(c);
      if (const int n = ++seen[key]; n > 1) key += "#" + std::to_string(n);
      if (!states.has(key)) return;
      const View backup = states.of(callback_state(c));
      load_callback_state(c, states.sub(key));
      undo.push_back([&c, backup] { load_callback_state(c, backup); });
    }
  });
}

// ---- a whole fit --------------------------------------------------------------------------------------------

/// What a full checkpoint holds besides the weights and the accumulated gradients: `write_fit_state` writes it.
struct FitState {
  /// Every optimizer's archive (the strategy's `optimizer_state`), in configure_optimizers' order, and the schedulers
  /// of those that have one, in that order.
  std::vector<at::Tensor> optimizers;
  std::vector<SchedulerOf> schedulers;
  std::map<std::string, double> precision;
  Dict loops = make_dict();
  std::optional<data::LoaderState> train_loader;
  /// Every rank's training-epoch metric sums (`metrics_of_ranks`).
  c10::impl::GenericList metrics{c10::AnyType::get()};
  /// Every generator's states of every rank (see `rng_to_state`).
  std::vector<at::Tensor> rng;
  Dict callbacks = make_dict();
};

inline void write_fit_state(Dict& d, const FitState& s) {
  c10::List<at::Tensor> optimizers;
  for (const at::Tensor& o : s.optimizers) optimizers.push_back(o);
  d.insert(keys::optimizer_states, optimizers);
  d.insert(keys::lr_schedulers, schedulers_to_state(s.schedulers));
  d.insert(keys::precision, from_map(s.precision));
  d.insert(keys::loops, s.loops);
  if (s.train_loader) {
    Dict loaders = make_dict();
    loaders.insert(loader_keys::train, loader_state_to_dict(*s.train_loader));
    d.insert(keys::loaders, loaders);
  }
  d.insert(keys::metrics, s.metrics);
  d.insert(keys::rng, rng_to_state(s.rng));
  d.insert(keys::callbacks, s.callbacks);
}

/// A checkpoint read for resuming, every entry checked against the fit that resumes.
struct ResumeState {
  /// The whole file (the module's on_load_checkpoint sees it).
  View file;
  Dict weights = make_dict();
  /// Where the fit loop goes on (with this rank's generator states).
  volt::detail::ResumePoint point;
  /// The training loader's saved position, when the file and the loader both have one (checked to fit).
  std::optional<data::LoaderState> train_loader;
  /// Each optimizer's archive, and each scheduler's step count (in the order of the optimizers that have one).
  std::vector<at::Tensor> optimizers;
  std::vector<int64_t> scheduler_step_counts;
  std::map<std::string, double> precision;
  /// The training epoch's metric sums of each saving rank (`volt::detail::resumed_entries` gives this rank's).
  std::vector<std::vector<volt::detail::MetricEntry>> metrics;
  /// The callbacks' states (a view of `file`).
  View callbacks;
  /// This rank's gradients accumulated so far in the saved window, one per parameter (empty: none saved).
  std::vector<std::optional<at::Tensor>> grads;
};

/// What a resuming fit has: its parameter count, and per optimizer whether it has a scheduler.
struct FitShape {
  std::size_t num_params = 0;
  std::vector<bool> has_scheduler;
};

/// Reads `path` and checks everything in it against this fit: the module's names and shapes, the optimizer and
/// scheduler counts, the training loader's position (for a loader that keeps one), the gradients' count. Throws
/// `CheckpointError` naming the file and the fault; changes nothing.
template <class TrainLoader>
ResumeState resume_state_of(const View& file, const torch::nn::Module& module, const TrainLoader& train_loader,
                            const FitShape& fit, int rank);

template <class TrainLoader>
ResumeState read_for_resume(const std::string& path, const torch::nn::Module& module, const TrainLoader& train_loader,
                            const FitShape& fit, int rank) {
  return resume_state_of(View::read(path), module, train_loader, fit, rank);
}

/// The optimizers' and schedulers' entries of `d`, checked against the fit's counts.
inline void read_optimizers(const View& d, const FitShape& fit, ResumeState& r) {
  const auto optimizers = d.at(keys::optimizer_states).toListRef();
  const std::size_t n = fit.has_scheduler.size();
  if (optimizers.size() != n) {
    d.fail(" holds " + std::to_string(optimizers.size()) + " optimizer states; this fit has " + std::to_string(n) +
           " optimizer" + (n == 1 ? "" : "s") + ". Resume with the configure_optimizers that wrote it.");
  }
  for (const auto& o : optimizers) r.optimizers.push_back(o.toTensor());
  const auto schedulers = d.at(keys::lr_schedulers).toListRef();
  const auto wanted = static_cast<std::size_t>(std::count(fit.has_scheduler.begin(), fit.has_scheduler.end(), true));
  if (schedulers.size() != wanted) {
    d.fail(" holds " + std::to_string(schedulers.size()) + " learning-rate scheduler states; this fit has " +
           (wanted == 0 ? std::string("none") : std::to_string(wanted)) +
           ". Resume with the configure_optimizers that wrote it.");
  }
  std::vector<int64_t> owners;  // the optimizers that have a scheduler, in order
  for (std::size_t i = 0; i < n; ++i) {
    if (fit.has_scheduler[i]) owners.push_back(static_cast<int64_t>(i));
  }
  for (std::size_t k = 0; k < schedulers.size(); ++k) {
    const View sch = d.of(schedulers[k]);
    const int64_t owner = sch.has(kSchedulerOptimizer) ? sch.integer(kSchedulerOptimizer) : owners[k];
    if (owner != owners[k]) {
      d.fail(" holds a learning-rate scheduler of optimizer " + std::to_string(owner) + " where this fit's scheduler "
             "belongs to optimizer " + std::to_string(owners[k]) + ". Resume with the configure_optimizers that wrote "
             "it.");
    }
    r.scheduler_step_counts.push_back(sch.integer(kSchedulerStepCount));
  }
}

/// The checks of `read_for_resume` on a checkpoint already read and checked as a file (`View::read`, `decode`).
template <class TrainLoader>
ResumeState resume_state_of(const View& d, const torch::nn::Module& module, const TrainLoader& train_loader,
                            const FitShape& fit, int rank) {
  ResumeState r{d, make_dict(), {}, {}, {}, {}, {}, {}, d};
  try {
    const View weights = d.sub(keys::state_dict);
    check_module_state(module, weights);
    r.weights = weights.dict();
    if (!d.has(keys::loops)) {
      d.fail(" holds weights only (saved with weights_only), which cannot resume a fit. Load them with "
             "volt::load_weights(module, path), or resume from a full checkpoint.");
    }
    r.point = volt::detail::ResumePoint::from_state_dict(d.sub(keys::loops));
    if constexpr (data::PositionedLoader<TrainLoader>) {
      if (d.has(keys::loaders) && d.sub(keys::loaders).has(loader_keys::train)) {
        r.train_loader = loader_state_from_dict(d.sub(keys::loaders).sub(loader_keys::train));
        try {
          train_loader.check_state(*r.train_loader);
        } catch (const std::invalid_argument& e) {
          throw CheckpointError("volt: the training loader cannot resume from " + d.path() + ": " +
                                std::string(e.what()).substr(6));
        }
      }
    }
    read_optimizers(d, fit, r);
    if (!r.point.optimizer_steps.empty() && r.point.optimizer_steps.size() != fit.has_scheduler.size()) {
      d.fail(" counts the steps of " + std::to_string(r.point.optimizer_steps.size()) + " optimizers but holds " +
             std::to_string(r.optimizers.size()) + " optimizer states.");
    }
    r.metrics = metrics_from_state(d);
    r.point.rng = rng_from_state(d.sub(keys::rng), rank);
    r.point.loader_positioned = r.train_loader.has_value();
    r.precision = d.sub(keys::precision).numbers();
    r.callbacks = d.sub(keys::callbacks);
    const auto grads = d.at(keys::accumulated_grads).toListRef();
    if (!grads.empty() && grads.size() != fit.num_params) {
      d.fail(" holds accumulated gradients of " + std::to_string(grads.size()) + " parameters; the module has " +
             std::to_string(fit.num_params) + ".");
    }
    for (const auto& g : grads) r.grads.push_back(grad_from_state(g, rank));
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {  // an entry of another kind than volt wrote (LibTorch's message says which)
    const std::string what = e.what();
    const std::size_t at = what.find("xpected ");
    const std::string fault = at != std::string::npos ? "e" + what.substr(at, what.find('\n', at) - at)
                                                       : volt::checkpoint::detail::first_line(what);
    d.fail(" has an entry of another kind than volt writes (" + fault + "): the file was damaged or edited after it "
           "was written; nothing was loaded.");
  }
  return r;
}

}  // namespace volt::checkpoint
