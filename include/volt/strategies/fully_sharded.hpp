#pragma once
/// \file
/// What stage 3 of the sharded layout (`FSDP`, `ZeRO<3>`: strategies/zero.hpp) does around the module's forward and
/// backward: `UnitScheduler` gathers each unit's parameters before the unit runs and frees them after, as FSDP2's
/// hooks do, driven by the calls volt/units.hpp makes where the model runs its units.
///
/// The first training forward of a fit runs with the parameters whole and records which units run in which order
/// (every rank must agree: each rank's record, its units named by their first parameter, is summed into a table every
/// rank compares, so a rank that ran another unit or order is refused on every rank with the call that differs); as
/// it ends, the gradient buckets are made: one per unit
/// in the reverse of that order (backward's order) and the root unit (what no unit holds) last, each padded to a
/// multiple of the world size W, so that the first backward already reduce-scatters each unit's gradients into this
/// rank's blocks and drops them (the first step holds the parameters whole, never every gradient). Once that backward
/// is over, the parameters are laid out in the buckets: rank r keeps block r of each (its shard, which the optimizer
/// steps), and the bucket's storage is freed. From then on, per step:
///  - forward: the root is gathered as the step's forward starts (all-gather in place into the bucket); each unit is
///    gathered as it is entered (or was, ahead: entering unit k starts unit k+1's all-gather, at most
///    `kBucketsInFlight` gathers travelling) and freed as it is left (`reshard_after_forward`; off: kept to its
///    backward). A unit that runs out of the recorded order is refused;
///  - backward: a node on each unit's outputs gathers the unit again before its backward runs and starts the gather
///    of the unit before it; each unit's gradients are reduce-scattered into this rank's block as its last gradient
///    arrives (the reducer's buckets are the units), and the unit is freed then; the root and anything still held
///    are freed when backward ends;
///  - evaluation (gradients off, or validation): each unit gathered, run and freed; the root for the forward's time.
/// Freeing resizes the bucket's storage to nothing: the parameters and autograd's saved views of them keep pointing
/// at it and see the gathered bytes again once it is refilled (FSDP2's rule).

#include "volt/comm/concept.hpp"
#include "volt/errors.hpp"
#include "volt/reduce.hpp"
#include "volt/stage.hpp"
#include "volt/strategies/reducer.hpp"
#include "volt/strategies/shard_layout.hpp"
#include "volt/units.hpp"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt::detail {

/// The first act of a unit's backward: `gather` (the unit's parameters gathered again), then the gradients passed on.
class UnitPreBackward final : public torch::autograd::Node {
 public:
  explicit UnitPreBackward(std::function<void()> gather) : gather_(std::move(gather)) {}
  std::string name() const override { return "volt::UnitPreBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    gather_();
    return std::move(grads);
  }

 private:
  std::function<void()> gather_;
};

/// Stage 3's runtime over backend `B`: the trace of the first step, then the gathers and frees of every unit.
template <class B>
class UnitScheduler final : public UnitRuntime {
 public:
  UnitScheduler(B& backend, bool reshard_after_forward)
      : backend_(&backend), reshard_after_forward_(reshard_after_forward) {
    unit_runtime() = this;
  }
  UnitScheduler(const UnitScheduler&) = delete;
  UnitScheduler& operator=(const UnitScheduler&) = delete;
  ~UnitScheduler() override {
    if (unit_runtime() == this) unit_runtime() = nullptr;
  }

  /// The buckets of the layout, from the first step's trace: each unit's parameters among `params` (those that require
  /// gradients, in reverse index order), the units in reverse order of their first run, the root last. Every rank
  /// must have run the same units in the same order: `reduce(tensor, op)` all-reduces over the ranks the units are
  /// sharded across, of which this is rank `rank` of `size` (agree_on_trace).
  template <class Reduce_>
  std::vector<std::vector<std::size_t>> groups(const std::vector<at::Tensor>& params, Reduce_&& reduce, int rank,
                                               int size) {
    std::unordered_map<const void*, std::size_t> index;
    for (std::size_t j = 0; j < params.size(); ++j) index.emplace(params[j].unsafeGetTensorImpl(), j);
    std::vector<int64_t> claimed(params.size(), -1);
    std::vector<const torch::nn::Module*> units;
    std::vector<std::vector<std::size_t>> members;
    for (const torch::nn::Module* m : trace_) {
      if (unit_of_module_.count(m) != 0) continue;
      std::vector<std::size_t> own;
      for (const at::Tensor& p : m->parameters(/*recurse=*/true)) {
        const auto it = index.find(p.unsafeGetTensorImpl());
        if (it == index.end() || !p.requires_grad()) continue;
        if (claimed[it->second] >= 0) {
          throw ConfigError("volt: parameter " + std::to_string(it->second) + " belongs to two units (a " +
                            units[static_cast<std::size_t>(claimed[it->second])]->name() + " and a " + m->name() +
                            "): a unit inside another, or a module shared by two; make them one unit.");
        }
        claimed[it->second] = static_cast<int64_t>(units.size());
        own.push_back(it->second);
      }
      unit_of_module_[m] = units.size();
      first_param_[m] = own.empty() ? -1 : static_cast<int64_t>(*std::min_element(own.begin(), own.end()));
      units.push_back(m);
      members.push_back(std::move(own));
    }
    number_units();
    agree_on_trace(reduce, rank, size);
    return order_buckets(params, claimed, units, std::move(members));
  }

  /// The units as `configure_model` declared them (volt/model_plan.hpp), in the order the forward runs them: they are
  /// the trace, so that `groups()` lays the parameters out before the fit's first step, which then runs sharded and is
  /// checked against them as every later step is.
  void declare(const std::vector<const torch::nn::Module*>& units) {
    trace_ = units;
    trace_done_ = true;
    declared_ = true;
  }

  /// The layout made from `groups()`'s buckets: from now on units are gathered and freed.
  void attach(ShardLayout& layout) {
    layout_ = &layout;
    works_.assign(layout.flats().size(), typename B::Work());
    travelling_.assign(layout.flats().size(), 0);
    for (std::size_t i = 0; i < layout.flats().size(); ++i) release(i);
  }

  /// A forward starts (`stage`; training with gradients: the units' order is checked and backward follows).
  void begin_forward(Stage stage) {
    phase_ = stage == Stage::train && at::GradMode::is_enabled() ? Phase::forward : Phase::evaluate;
    position_ = 0;
    if (layout_ != nullptr && root_ >= 0) gather(static_cast<std::size_t>(root_));
  }
  /// It ended: an evaluation's root is freed, and a training forward's where no backward follows (training keeps it
  /// to the end of backward). True where it was the fit's first training forward, whose units are the trace.
  bool end_forward(bool backward_follows) {
    const bool traced = phase_ == Phase::forward && !trace_done_;
    trace_done_ = trace_done_ || traced;
    if (phase_ == Phase::evaluate || !backward_follows) {
      release_all();
      phase_ = Phase::idle;
    }
    return traced;
  }
  /// Backward starts: every recorded unit must have run.
  void begin_backward() {
    if (layout_ != nullptr && phase_ == Phase::forward && position_ != sequence_.size()) {
      throw ConfigError("volt: this step's forward ran " + std::to_string(position_) + " units where " + reference() +
                        " " + std::to_string(sequence_.size()) + "; a fully sharded model runs the same units in every "
                        "step.");
    }
    phase_ = Phase::backward;
  }
  /// Backward ended: everything still gathered is freed.
  void end_backward() {
    release_all();
    phase_ = Phase::idle;
  }
  /// The reducer's bucket `bucket` has all its gradients: a unit's backward is over, it is freed.
  void bucket_done(std::size_t bucket) {
    if (layout_ != nullptr && static_cast<int64_t>(bucket) != root_) release(bucket);
  }

  int64_t enter(const torch::nn::Module& unit) override;
  void leave(int64_t token, std::vector<at::Tensor>& outputs) override;

  /// Gathers bucket `bucket` (waits for it): its parameters hold every rank's values.
  void gather(std::size_t bucket) {
    start(bucket);
    if (travelling_[bucket]) {
      travelling_[bucket] = 0;
      works_[bucket].wait();
    }
  }
  /// Bucket `bucket`'s storage freed (its gather waited for first).
  void release(std::size_t bucket) {
    if (travelling_[bucket]) {
      travelling_[bucket] = 0;
      works_[bucket].wait();
    }
    layout_->free(bucket);
  }
  void release_all() {
    if (layout_ == nullptr) return;
    for (std::size_t i = 0; i < works_.size(); ++i) release(i);
  }

 private:
  enum class Phase { idle, forward, backward, evaluate };

  /// Starts bucket `bucket`'s all-gather unless it holds its storage already.
  void start(std::size_t bucket) {
    if (layout_->holds(bucket)) return;
    layout_->fill(bucket);
    const BucketTag tag(static_cast<int>(bucket));  // named in the flight recorder
    works_[bucket] = backend_->iall_gather_(layout_->flats()[bucket]);
    travelling_[bucket] = 1;
  }
  /// Starts bucket `bucket`'s gather ahead of its use when fewer than `kBucketsInFlight` travel.
  void prefetch(std::size_t bucket) {
    std::size_t n = 0;
    for (char t : travelling_) n += t != 0;
    if (n < kBucketsInFlight) start(bucket);
  }
  /// Backward reached the unit entered at `position`: gathered again, the one before it started.
  void backward_gather(std::size_t position) {
    gather(sequence_[position]);
    for (std::size_t before = position; before-- > 0;) {  // the unit before it that has parameters
      if (sequence_[before] == SIZE_MAX) continue;
      prefetch(sequence_[before]);
      break;
    }
  }

  /// Units are numbered in the model's order (by their first parameter among the strategy's parameters: the same
  /// numbers on every rank), those without parameters left out.
  void number_units() {
    std::vector<int64_t> firsts;
    for (const auto& [m, first] : first_param_) {
      if (first >= 0) firsts.push_back(first);
    }
    std::sort(firsts.begin(), firsts.end());
    for (const auto& [m, first] : first_param_) {
      number_[m] = first < 0 ? -1 : std::lower_bound(firsts.begin(), firsts.end(), first) - firsts.begin();
    }
  }
  /// What a step's units are checked against: "configure_model declared", or "the fit's first step ran".
  std::string reference() const { return declared_ ? "configure_model declared" : "the fit's first step ran"; }
  /// "unit 3 (a BlockImpl)", or "a unit without parameters (a Tanh)".
  std::string describe(const torch::nn::Module* m) const {
    const auto it = number_.find(m);
    if (it == number_.end() || it->second < 0) return "a unit without parameters (a " + m->name() + ")";
    return "unit " + std::to_string(it->second) + " (a " + m->name() + ")";
  }
  template <class Reduce_>
  void agree_on_trace(Reduce_&& reduce, int rank, int size);
  std::vector<std::vector<std::size_t>> order_buckets(const std::vector<at::Tensor>& params,
                                                      const std::vector<int64_t>& claimed,
                                                      const std::vector<const torch::nn::Module*>& units,
                                                      std::vector<std::vector<std::size_t>> members);

  B* backend_;
  bool reshard_after_forward_;
  ShardLayout* layout_ = nullptr;
  std::vector<const torch::nn::Module*> trace_;  // the first training forward's unit calls
  std::unordered_map<const torch::nn::Module*, std::size_t> unit_of_module_;  // module -> unit (trace order)
  std::unordered_map<const torch::nn::Module*, int64_t> first_param_;  // module -> its first parameter (-1: none)
  std::unordered_map<const torch::nn::Module*, int64_t> number_;       // module -> unit number in the model's order
  std::unordered_map<const torch::nn::Module*, int64_t> bucket_of_module_;    // module -> bucket (-1: no parameters)
  std::vector<std::size_t> sequence_;  // the buckets of the trace's calls, in forward order
  int64_t root_ = -1;
  std::vector<typename B::Work> works_;
  std::vector<char> travelling_;
  Phase phase_ = Phase::idle;
  bool trace_done_ = false;
  bool declared_ = false;  // the trace is configure_model's declaration
  std::size_t position_ = 0;
};

/// Every rank's trace, gathered through sums (each rank its row of a [size, calls + 1] table: how many calls, then each
/// call's first parameter, -1 for a unit without parameters), compared with rank zero's: where any rank differs,
/// every rank refuses with the same line, naming the first call that differs, what each rank ran there and which
/// ranks ran it. Units are named by their number in the model's order, the same on every rank.
template <class B>
template <class Reduce_>
void UnitScheduler<B>::agree_on_trace(Reduce_&& reduce, int rank, int size) {
  const auto calls = static_cast<int64_t>(trace_.size());
  const int64_t most = reduce(torch::tensor({calls}, torch::kLong), Reduce::max)[0].template item<int64_t>();
  at::Tensor table = torch::full({size, most + 1}, 0, torch::kLong);
  table[rank][0] = calls;
  for (int64_t c = 0; c < most; ++c) table[rank][c + 1] = c < calls ? first_param_.at(trace_[c]) : -2;
  table = reduce(table, Reduce::sum).contiguous();
  const auto* rows = table.template data_ptr<int64_t>();
  const auto row = [&](int r) { return rows + static_cast<int64_t>(r) * (most + 1); };
  int64_t at = -1;  // the first call where some rank differs from rank zero (a shorter trace: -2 past its end)
  for (int64_t c = 1; c <= most && at < 0; ++c) {
    for (int r = 1; r < size && at < 0; ++r) at = row(r)[c] != row(0)[c] ? c : -1;
  }
  if (at < 0) return;
  std::vector<int64_t> firsts;  // every rank's units, numbered in the model's order
  for (int r = 0; r < size; ++r) {
    for (int64_t c = 1; c <= row(r)[0]; ++c) {
      if (row(r)[c] >= 0) firsts.push_back(row(r)[c]);
    }
  }
  std::sort(firsts.begin(), firsts.end());
  firsts.erase(std::unique(firsts.begin(), firsts.end()), firsts.end());
  const auto what = [&](int64_t v) -> std::string {
    if (v == -2) return "no unit (its forward ended)";
    if (v == -1) return "a unit without parameters";
    return "unit " + std::to_string(std::lower_bound(firsts.begin(), firsts.end(), v) - firsts.begin());
  };
  std::vector<std::pair<int64_t, std::vector<int>>> ran;  // each value at `at`, and the ranks that had it
  for (int r = 0; r < size; ++r) {
    const int64_t v = row(r)[at];
    auto it = std::find_if(ran.begin(), ran.end(), [&](const auto& e) { return e.first == v; });
    if (it == ran.end()) it = ran.insert(ran.end(), {v, {}});
    it->second.push_back(r);
  }
  std::string said;
  for (std::size_t i = 0; i < ran.size(); ++i) {
    std::string ranks;
    for (std::size_t k = 0; k < ran[i].second.size(); ++k) {
      ranks += (k == 0 ? "" : k + 1 == ran[i].second.size() ? " and " : ", ") + std::to_string(ran[i].second[k]);
    }
    said += (i == 0 ? "" : i + 1 == ran.size() ? " and " : ", ") + what(ran[i].first) + " on rank" +
            (ran[i].second.size() > 1 ? "s " : " ") + ranks;
  }
  throw ConfigError(std::string("volt: the ranks ") + (declared_ ? "declared" : "ran") + " different units " +
                    (declared_ ? "in configure_model: declared unit " : "in the fit's first step: unit call ") +
                    std::to_string(at) + (declared_ ? " is " : " ran ") + said +
                    " (units numbered in the model's order); a fully sharded model must run the same units in the "
                    "same order on every rank.");
}

/// Units with parameters become buckets in the reverse of their first run, in that order; the root last.
template <class B>
std::vector<std::vector<std::size_t>> UnitScheduler<B>::order_buckets(
    const std::vector<at::Tensor>& params, const std::vector<int64_t>& claimed,
    const std::vector<const torch::nn::Module*>& units, std::vector<std::vector<std::size_t>> members) {
  std::vector<std::vector<std::size_t>> groups;
  std::vector<int64_t> bucket_of_unit(units.size(), -1);
  for (std::size_t u = units.size(); u-- > 0;) {
    if (members[u].empty()) continue;
    std::sort(members[u].rbegin(), members[u].rend());
    bucket_of_unit[u] = static_cast<int64_t>(groups.size());
    groups.push_back(std::move(members[u]));
  }
  std::vector<std::size_t> root;
  for (std::size_t j = params.size(); j-- > 0;) {
    if (claimed[j] < 0 && params[j].requires_grad()) root.push_back(j);
  }
  if (!root.empty()) {
    root_ = static_cast<int64_t>(groups.size());
    groups.push_back(std::move(root));
  }
  for (std::size_t u = 0; u < units.size(); ++u) bucket_of_module_[units[u]] = bucket_of_unit[u];
  for (const torch::nn::Module* m : trace_) {
    const int64_t b = bucket_of_module_.at(m);
    sequence_.push_back(b < 0 ? SIZE_MAX : static_cast<std::size_t>(b));
  }
  return groups;
}

/// Before a unit runs. The token `leave` gets: the unit's position in the step's sequence (training), or -2 - bucket
/// (evaluation), or -1 (nothing to do: no layout yet, or a unit without parameters).
template <class B>
int64_t UnitScheduler<B>::enter(const torch::nn::Module& unit) {
  if (layout_ == nullptr) {
    if (phase_ == Phase::forward && !trace_done_ && at::GradMode::is_enabled()) trace_.push_back(&unit);
    return -1;
  }
  const auto it = bucket_of_module_.find(&unit);
  if (it == bucket_of_module_.end()) {
    throw ConfigError("volt: a " + unit.name() + " ran as a unit that " +
                      (declared_ ? "configure_model did not declare" : "did not run in the fit's first step") +
                      "; a fully sharded model runs the same units in every step.");
  }
  if (phase_ == Phase::forward && at::GradMode::is_enabled()) {
    const std::size_t bucket = it->second < 0 ? SIZE_MAX : static_cast<std::size_t>(it->second);
    if (position_ >= sequence_.size() || sequence_[position_] != bucket) {
      const std::string first = position_ < trace_.size() ? describe(trace_[position_]) : "no unit";
      throw ConfigError("volt: unit call " + std::to_string(position_ + 1) + " of this step ran " + describe(&unit) +
                        ", where " + reference() + " " + first + " (of " + std::to_string(sequence_.size()) +
                        " calls); a fully sharded model runs its units in the same order in every step.");
    }
    const std::size_t position = position_++;
    if (it->second < 0) return -1;
    gather(static_cast<std::size_t>(it->second));
    for (std::size_t next = position + 1; next < sequence_.size(); ++next) {
      if (sequence_[next] == SIZE_MAX) continue;
      prefetch(sequence_[next]);
      break;
    }
    return static_cast<int64_t>(position);
  }
  if (it->second < 0) return -1;
  gather(static_cast<std::size_t>(it->second));
  return -2 - it->second;
}

/// After a unit ran: in training, its outputs' backward gathers it again first; then it is freed (training: where
/// `reshard_after_forward`; it is kept to its backward otherwise).
template <class B>
void UnitScheduler<B>::leave(int64_t token, std::vector<at::Tensor>& outputs) {
  namespace ag = torch::autograd;
  if (token == -1) return;
  if (token <= -2) return release(static_cast<std::size_t>(-2 - token));
  const auto position = static_cast<std::size_t>(token);
  ag::edge_list edges;
  for (const at::Tensor& o : outputs) {
    if (o.defined() && o.requires_grad()) edges.push_back(ag::impl::gradient_edge(o));
  }
  if (!edges.empty()) {
    std::shared_ptr<UnitPreBackward> node(new UnitPreBackward([this, position] { backward_gather(position); }),
                                          ag::deleteNode);
    node->set_next_edges(std::move(edges));
    for (at::Tensor& o : outputs) {
      if (!o.defined() || !o.requires_grad()) continue;
      o = o.detach();
      ag::set_history(o, node);
    }
  }
  if (reshard_after_forward_) release(sequence_[position]);
}

}  // namespace volt::detail
