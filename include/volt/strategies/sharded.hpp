#pragma once
/// \file
/// `volt::Sharded<Stage>`: the layouts of `DataParallel` in which the optimizer state is sharded across ranks (stage 1)
/// and the gradients too (stage 2), as DeepSpeed's ZeRO stages 1 and 2 (arXiv:1910.02054); `ZeRO<Stage>` is the
/// strategy (strategies/zero.hpp, which says what it does for a user). A layout's shape is in
/// strategies/layout.hpp.
///
/// At a fit's start (`setup_optimizer`, after `configure_optimizers`) the parameters that require gradients are laid
/// out in the reducer's buckets, each padded to a multiple of the world size W, each parameter a view into its
/// bucket's flat buffer (`detail::ShardLayout`); rank r owns block r of every bucket, and the optimizer's groups are
/// given this rank's pieces in place of the parameters. On the micro-batch that steps, each bucket is
/// reduce-scattered as its last gradient arrives; after the step every bucket is all-gathered in place. A checkpoint
/// gathers the pieces' states into the layout of an unsharded run, and a resume cuts any such state by this run's
/// world size (checkpoint/optimizer_state.hpp).

#include "volt/checkpoint.hpp"
#include "volt/errors.hpp"
#include "volt/optim/gradients.hpp"
#include "volt/options.hpp"
#include "volt/reduce.hpp"
#include "volt/strategies/fully_sharded.hpp"
#include "volt/strategies/reducer.hpp"
#include "volt/strategies/shard_layout.hpp"
#include "volt/strategies/concept.hpp"
#include "volt/strategies/layout.hpp"
#include "volt/checkpoint/optimizer_state.hpp"

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt {

namespace detail {

/// What one rank holds under `Sharded<Stage>`: the reducer, the layout of the parameters in its buckets and this
/// rank's pieces, and the optimizers' full parameter lists (for checkpoints). `B` is the backend; each member is
/// handed the strategy `G`.
template <int Stage, class B>
class ShardedHolder {
 public:
  /// Lays the parameters out (at each fit's start: the module was placed, broadcast and cast by then) and gives
  /// `optimizer` this rank's pieces in place of the parameters. The layout stays after the fit, so that validate,
  /// test or a save after it see the parameters and optimizer as the fit left them.
  template <class G>
  void setup_optimizer(G& g, torch::optim::Optimizer& optimizer) {
    drop_layout();  // once per fit: automatic optimization has one optimizer
    detail::with_state_codec(optimizer, [](auto) {});  // refuses an optimizer whose state is not elementwise
    if (!optimizer.state().empty()) {
      throw ConfigError("volt: ZeRO shards an optimizer before its first step; the one configure_optimizers returned "
                        "already holds state. Load state through fit(..., ckpt_path) instead.");
    }
    params_ = g.module_parameters();
    if constexpr (Stage == 3) {
      units_ = std::make_unique<UnitScheduler<B>>(g.backend(), g.layout().reshard_after_forward);
      optimizer_ = &optimizer;
      compute_dtype_ = g.compute_dtype();
      sync_every_micro_batch_ = g.layout().sync_every_micro_batch;
      full_params_[&optimizer] = param_lists(optimizer);
      if (!g.units().empty()) {  // declared (configure_model): laid out now, the first step runs sharded
        units_->declare(g.units());
        unit_reducer(g);
        lay_out(g, optimizer);
      }  // else the first forward runs whole and records the units (unit_reducer, lay_out)
      return;
    } else {
      reducer_ = std::make_unique<Reducer<B>>(params_, g.backend(), g.world_size(), g.layout().first_bucket_bytes,
                                              g.layout().bucket_bytes,
                                              Stage == 1 ? GradSync::reduce_scatter : GradSync::reduce_scatter_to_blocks);
    }
    shards_ = std::make_unique<ShardLayout>(reducer_->buckets(), params_, g.global_rank(), g.world_size());
    std::vector<std::vector<at::Tensor>> full;
    for (auto& group : optimizer.param_groups()) {
      full.push_back(group.params());
      group.params() = pieces_for(group.params());
    }
    full_params_[&optimizer] = std::move(full);
  }

  /// The pieces' gradients and the module's.
  template <class G>
  void zero_grad(G& /*part*/, torch::optim::Optimizer& optimizer) {
    detail::zero_grad(optimizer);
    detail::zero_grad(params_, /*keep_tensors=*/false);
    window_started_ = false;
  }

  /// Stage 3, once laid out, where `sync_every_micro_batch` (the default): every micro-batch's gradients are
  /// reduce-scattered, the window's first replacing the blocks and the others added to them, so that no rank ever holds
  /// the unsharded gradients of a window (FSDP2's default; off: they accumulate in `.grad` until the last, as DDP).
  template <class G>
  void pre_backward(G& /*part*/, bool sync) {
    if (!reducer_) {
      throw std::logic_error("volt: a sharded (ZeRO, FSDP) backward ran before its buckets were laid out (FSDP: a backward "
                             "without a training forward before it).");
    }
    if (units_) units_->begin_backward();
    if (sync && shards_) shards_->check_aliasing(params_);
    synced_ = sync;
    if (Stage == 3 && sync_every_micro_batch_) {
      reducer_->prepare(/*sync=*/true, /*add_to_blocks=*/std::exchange(window_started_, true));
    } else {
      reducer_->prepare(sync);
    }
  }
  /// After a synchronised backward: the pieces' gradients are this rank's averaged blocks (stage 3's first such backward
  /// lays the parameters out first).
  template <class G>
  void post_backward(G& g) {
    reducer_->finish();
    if (synced_ && g.replicas() != nullptr) {  // HSDP: the blocks averaged across the part's replicas too
      std::vector<typename B::Work> works;
      for (const at::Tensor& block : reducer_->blocks()) works.push_back(g.replicas()->iall_reduce_(block, Reduce::mean));
      for (auto& w : works) w.wait();
    }
    if (units_) units_->end_backward();
    if constexpr (Stage == 3) {
      if (synced_ && !shards_) lay_out(g, *optimizer_);  // the first step's backward is over: the parameters go
    }
    if (!synced_) return;
    synced_ = false;
    const auto& buckets = reducer_->buckets();
    for (const ShardPiece& piece : shards_->pieces()) {
      const auto& b = buckets[piece.bucket];
      at::Tensor& grad = piece.tensor.mutable_grad();
      if (!b.taking_part[piece.slot]) {
        grad = at::Tensor();
      } else if constexpr (Stage >= 2) {
        grad = alias(reducer_->blocks()[piece.bucket], piece.bucket_offset - shards_->block_start(piece.bucket),
                     piece.numel);
      } else {
        grad = alias(b.flat, piece.bucket_offset, piece.numel);
      }
    }
  }

  /// After the optimizer stepped this rank's pieces (every rank agreed on a loss-scaled step's inf check first):
  /// stages 1 and 2 gather the parameters; stage 3 gathers each unit where it runs.
  template <class G>
  void after_step(G& g) {
    if constexpr (Stage < 3) gather_parameters(g);
  }

  /// Stage 3: a forward starts (the root unit gathered: strategies/fully_sharded.hpp) and ends.
  void begin_forward(volt::Stage stage)
    requires(Stage == 3)
  {
    if (units_) units_->begin_forward(stage);
  }
  template <class G>
    requires(Stage == 3)
  void end_forward(G& g, bool backward_follows) {
    if (units_ && units_->end_forward(backward_follows)) unit_reducer(g);
  }
  /// Stage 3, during a fit: what gathers and frees the units (a strategy with several parts routes each unit to its
  /// part's); null outside a fit.
  UnitRuntime* units() const
    requires(Stage == 3)
  {
    return units_.get();
  }
  /// The tensors the optimizer steps for the laid-out parameters: this rank's pieces (none before the layout).
  std::vector<at::Tensor> piece_tensors() const {
    std::vector<at::Tensor> out;
    if (shards_ && !whole_) {
      for (const ShardPiece& piece : shards_->pieces()) out.push_back(piece.tensor);
    }
    return out;
  }
  /// Stage 3, after a fit that completed: every unit gathered back, in float32, into a whole bucket in which the module's
  /// parameters and this rank's pieces (which keep the optimizer's state, for a save after the fit) then lie, as under
  /// ZeRO<1>; the shards and the gradient blocks are dropped, so the module whole costs no more than ZeRO<1> holds.
  template <class G>
    requires(Stage == 3)
  void finish_fit(G& g) {
    if (!units_ || !shards_) return;
    units_->release_all();
    for (const ShardPiece& piece : shards_->pieces()) piece.tensor.mutable_grad() = at::Tensor();
    reducer_.reset();  // its gradient blocks: no backward follows
    for (std::size_t i = 0; i < shards_->flats().size(); ++i) {
      const at::Tensor whole = whole_bucket(g, i);
      shards_->make_whole(i, whole, params_);
    }
    units_.reset();
    whole_ = true;
  }
  /// Stage 3, collective, for a checkpoint saved inside an accumulation window whose micro-batches were each
  /// reduce-scattered (`sync_every_micro_batch`): parameter `j`'s gradients averaged over the ranks so far, which every
  /// rank then keeps as its own accumulated gradient (resumed on any layout, each rank adds its next micro-batches'
  /// to it and the ranks' average ends on the window's); undefined where the module's `.grad` holds them (as DDP's).
  template <class G>
    requires(Stage == 3)
  at::Tensor window_gradient(G& g, std::size_t j) const {
    if (!shards_ || whole_ || !sync_every_micro_batch_ || !window_started_) return at::Tensor();
    const auto& where = shards_->location(j);
    if (!where.laid_out) return at::Tensor();
    const at::Tensor whole = gathered(g, where.bucket, reducer_->blocks()[where.bucket]);
    return whole.narrow(0, where.offset, params_[j].numel()).view(params_[j].sizes()).clone();
  }
  /// Stage 3: the module's state gathered unit by unit onto rank zero (empty elsewhere); whole after the fit.
  template <class G>
    requires(Stage == 3)
  c10::Dict<std::string, at::Tensor> module_state(G& g, const torch::nn::Module& module, bool on_device);
  /// Stage 3: each rank's shards cut from the whole state `state` (its buffers and unsharded parameters copied).
  template <class G>
    requires(Stage == 3)
  void load_module_state(G& g, torch::nn::Module& module, const checkpoint::Dict& state);

  /// What this rank writes into a sharded checkpoint: its pieces (float32 shards under FSDP's bfloat16 gathers), and a
  /// near-equal part of each parameter left out of the layout (or of every one, before it).
  template <class G>
  std::vector<checkpoint::Slice> state_slices(const G& g) const {
    std::vector<checkpoint::Slice> out;
    for (std::size_t j = 0; j < params_.size(); ++j) {
      if (shards_ && shards_->location(j).laid_out) continue;
      if (auto s = checkpoint::replicated_slice(j, params_[j], g.global_rank(), g.world_size())) out.push_back(*s);
    }
    if (!shards_) return out;
    for (const ShardPiece& piece : shards_->pieces()) {
      out.push_back({piece.param, checkpoint::Box::flat(params_[piece.param].numel(), piece.param_offset, piece.numel),
                     piece.tensor.detach(), piece.tensor, 0});
    }
    return out;
  }
  /// The groups `optimizer` was given (the module's parameters, where it now steps pieces).
  std::vector<std::vector<at::Tensor>> full_param_groups(torch::optim::Optimizer& optimizer) const {
    const auto full = full_params_.find(&optimizer);
    return full != full_params_.end() ? full->second : param_lists(optimizer);
  }

  /// Collective: the optimizer's state in the layout of an unsharded run, as bytes on rank zero (empty elsewhere).
  template <class G>
  at::Tensor optimizer_state(G& g, torch::optim::Optimizer& optimizer) {
    const auto full = full_params_.find(&optimizer);
    if (!shards_ || full == full_params_.end()) {
      return g.is_global_zero() ? checkpoint::optimizer_state(optimizer) : at::Tensor();
    }
    return with_state_codec(optimizer, [&](auto codec) {
      return gathered_state<decltype(codec)>(g, optimizer, full->second);
    });
  }
  /// Loads an optimizer archive in any run's layout (unsharded, or gathered by this strategy on any world size) and
  /// keeps this rank's pieces of it. On any failure the optimizer keeps its previous state.
  template <class G>
  void load_optimizer_state(G& /*part*/, torch::optim::Optimizer& optimizer, const at::Tensor& bytes,
                            const std::string& path) {
    const auto full = full_params_.find(&optimizer);
    if (!shards_ || full == full_params_.end()) return checkpoint::load_optimizer_state(optimizer, bytes, path);
    with_state_codec(optimizer, [&](auto codec) { load_cut<decltype(codec)>(optimizer, full->second, bytes, path); });
  }

  /// After a run: the gradient hooks stay until the next fit's layout, with the pieces the optimizer holds (a save
  /// after the fit gathers them); the bucket layout stays readable.
  void teardown() {
    if constexpr (Stage == 3) units_.reset();  // after a failed fit: no more gathers where units run
  }
  /// Bytes of gradients this rank holds between steps: the module's `.grad`, the buckets' buffers and the blocks.
  std::size_t gradient_bytes() const { return reducer_ ? reducer_->gradient_bytes() : 0; }
  /// Bytes of parameters this rank holds now, counted through the layout: the buckets that hold their storage (stage 3:
  /// the units gathered), the shards (stage 3) and the parameters left out of the layout; before a layout, all.
  std::size_t parameter_bytes() const
    requires(Stage == 3)
  {
    std::size_t bytes = 0;
    for (std::size_t j = 0; j < params_.size(); ++j) {
      if (!shards_ || whole_ || !shards_->location(j).laid_out) bytes += bytes_of(params_[j]);
    }
    if (!shards_ || whole_) return bytes;
    for (std::size_t i = 0; i < shards_->flats().size(); ++i) {
      if (shards_->holds(i)) bytes += bytes_of(shards_->flats()[i]);
    }
    for (const at::Tensor& shard : shards_->shards()) bytes += bytes_of(shard);
    return bytes;
  }
  std::vector<std::vector<std::size_t>> bucket_layout() const {
    return reducer_ ? reducer_->bucket_layout() : std::vector<std::vector<std::size_t>>();
  }

 private:
  using States = std::vector<std::unique_ptr<torch::optim::OptimizerParamState>>;
  using Lists = std::vector<std::vector<at::Tensor>>;

  void drop_layout() {
    units_.reset();
    reducer_.reset();
    shards_.reset();
    full_params_.clear();
    whole_ = false;
  }
  template <class G>
  void unit_reducer(G& g);
  template <class G>
  void lay_out(G& g, torch::optim::Optimizer& optimizer);
  /// `params` with each laid-out module parameter replaced by this rank's piece of it (none: left out); a tensor that
  /// is not laid out (frozen at the fit's start, or not the module's) stays as it is, stepped whole on every rank.
  std::vector<at::Tensor> pieces_for(const std::vector<at::Tensor>& params) const {
    std::unordered_map<const void*, std::size_t> index;
    for (std::size_t i = 0; i < params_.size(); ++i) index.emplace(params_[i].unsafeGetTensorImpl(), i);
    std::vector<at::Tensor> out;
    for (const at::Tensor& p : params) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end() || !shards_->location(it->second).laid_out) {
        out.push_back(p);
      } else if (const ShardPiece* piece = shards_->piece_of(it->second)) {
        out.push_back(piece->tensor);
      }
    }
    return out;
  }
  /// All-gathers every bucket's weights, at most `kBucketsInFlight` at a time (as the reduce-scatters: a
  /// non-blocking MPI collective holds buffers of its own until it is waited for).
  template <class G>
  void gather_parameters(G& g) {
    std::deque<typename B::Work> works;
    int bucket = 0;
    for (const at::Tensor& flat : shards_->flats()) {
      if (works.size() == kBucketsInFlight) {
        works.front().wait();
        works.pop_front();
      }
      const BucketTag tag(bucket++);
      works.push_back(g.backend().iall_gather_(flat));
    }
    for (auto& w : works) w.wait();
  }
  /// Stage 3, collective: bucket `bucket` whole, gathered from every rank's shard in the shards' dtype (float32 where
  /// the forward gathers bfloat16: a checkpoint and the module after the fit get the values the optimizer steps).
  template <class G>
  at::Tensor whole_bucket(G& g, std::size_t bucket) const {
    return gathered(g, bucket, shards_->shards()[bucket]);
  }
  /// Collective: bucket `bucket` whole from every rank's block `shard` of it (a shard, or a block of gradients).
  template <class G>
  at::Tensor gathered(G& g, std::size_t bucket, const at::Tensor& shard) const {
    torch::NoGradGuard no_grad;
    at::Tensor out = torch::empty({shards_->flats()[bucket].numel()}, shard.options());
    block_of(out, g.global_rank(), g.world_size()).copy_(shard);
    const BucketTag tag(static_cast<int>(bucket));
    g.backend().all_gather_(out);
    return out;
  }
  /// Sets every group's parameters of `optimizer` to `lists`, returning the lists it had.
  static Lists swap_params(torch::optim::Optimizer& optimizer, Lists lists) {
    if (lists.size() != optimizer.param_groups().size()) {
      throw std::logic_error("volt: ZeRO's optimizer has " + std::to_string(optimizer.param_groups().size()) +
                             " parameter groups, " + std::to_string(lists.size()) + " when the fit started; add "
                             "groups in configure_optimizers, before the fit.");
    }
    Lists old;
    for (std::size_t i = 0; i < optimizer.param_groups().size(); ++i) {
      old.push_back(std::move(optimizer.param_groups()[i].params()));
      optimizer.param_groups()[i].params() = std::move(lists[i]);
    }
    return old;
  }
  /// Takes the pieces' states out of `optimizer` (to be put back with `put_back`).
  States take_piece_states(torch::optim::Optimizer& optimizer) {
    States out;
    for (const ShardPiece& piece : shards_->pieces()) out.push_back(take_state(optimizer, piece.tensor));
    return out;
  }
  void put_back(torch::optim::Optimizer& optimizer, States states) {
    for (std::size_t i = 0; i < states.size(); ++i) {
      if (states[i]) put_state(optimizer, shards_->pieces()[i].tensor, std::move(states[i]));
    }
  }
  /// Drops the states `optimizer` files under the laid-out module parameters themselves.
  void drop_full_states(torch::optim::Optimizer& optimizer) {
    for (std::size_t j = 0; j < params_.size(); ++j) {
      if (shards_->location(j).laid_out) take_state(optimizer, params_[j]);
    }
  }
  template <class Codec, class G>
  Lists gather_fields(G& g, torch::optim::Optimizer& optimizer, at::Tensor& steps);
  template <class Codec, class G>
  at::Tensor gathered_state(G& g, torch::optim::Optimizer& optimizer, const Lists& full);
  template <class Codec>
  void load_cut(torch::optim::Optimizer& optimizer, const Lists& full, const at::Tensor& bytes, const std::string& path);
  template <class Codec>
  States cut_states(torch::optim::Optimizer& optimizer, const std::string& path);

  std::vector<at::Tensor> params_;  // the module's, at the fit's start
  // stage 3: the memory units are gathered into and their gradients reduce-scattered from (on the heap: the reducer
  // and the layout point at it, and a holder may move)
  std::unique_ptr<BufferPool> pool_ = std::make_unique<BufferPool>();
  std::unique_ptr<Reducer<B>> reducer_;
  std::unique_ptr<ShardLayout> shards_;
  std::unordered_map<const torch::optim::Optimizer*, Lists> full_params_;
  std::unique_ptr<UnitScheduler<B>> units_;  // stage 3, during a fit
  torch::optim::Optimizer* optimizer_ = nullptr;  // stage 3: the fit's (automatic optimization: one)
  std::optional<torch::Dtype> compute_dtype_;  // stage 3: the dtype units are gathered in (none: the parameters')
  bool synced_ = false;
  bool window_started_ = false;          // stage 3: a backward of the accumulation window added to the blocks
  bool sync_every_micro_batch_ = true;   // stage 3: each micro-batch's gradients reduce-scattered
  bool whole_ = false;  // stage 3: the parameters were gathered back after the fit
};

/// Every rank's pieces of each state tensor, gathered one bucket at a time into flat buffers laid out as the
/// parameters', kept on rank zero only ([field][bucket]; no buckets for a field no rank has; elsewhere none at all,
/// so a rank other than zero holds one bucket of one field at a time); `steps` becomes each parameter's step count,
/// -1 where no rank holds state for it.
template <int Stage, class B>
template <class Codec, class G>
auto ShardedHolder<Stage, B>::gather_fields(G& g, torch::optim::Optimizer& optimizer, at::Tensor& steps) -> Lists {
  using State = typename Codec::State;
  const auto& pieces = shards_->pieces();
  steps = torch::full({static_cast<int64_t>(params_.size())}, -1, torch::kLong);
  at::Tensor defined = torch::zeros({static_cast<int64_t>(Codec::fields)}, torch::kLong);
  for (const ShardPiece& piece : pieces) {
    if (const auto* s = find_state(optimizer, piece.tensor)) {
      steps[static_cast<int64_t>(piece.param)] = Codec::step(static_cast<const State&>(*s));
      const auto t = Codec::tensors(static_cast<const State&>(*s));
      for (std::size_t f = 0; f < t.size(); ++f) {
        if (t[f].defined()) defined[static_cast<int64_t>(f)] = 1;
      }
    }
  }
  steps = g.all_reduce(steps, Reduce::max).cpu();
  defined = g.all_reduce(defined, Reduce::max).cpu();
  Lists fields(Codec::fields);
  torch::NoGradGuard no_grad;
  for (std::size_t f = 0; f < Codec::fields; ++f) {
    if (defined[static_cast<int64_t>(f)].template item<int64_t>() == 0) continue;
    for (std::size_t i = 0; i < shards_->flats().size(); ++i) {
      at::Tensor buffer = torch::zeros({shards_->flats()[i].numel()}, shards_->piece_options(i));
      for (const ShardPiece& piece : pieces) {
        const auto* s = piece.bucket == i ? find_state(optimizer, piece.tensor) : nullptr;
        if (s == nullptr) continue;
        const at::Tensor t = Codec::tensors(static_cast<const State&>(*s))[f];
        if (t.defined()) buffer.narrow(0, piece.bucket_offset, piece.numel).copy_(t.reshape(-1));
      }
      g.backend().all_gather_(buffer);
      if (g.is_global_zero()) fields[f].push_back(std::move(buffer));
    }
  }
  return fields;
}

/// On rank zero, for the time of one save: the pieces' states aside, each laid-out parameter's whole state filed
/// under it, the groups holding the module's parameters; LibTorch's archive of that; then everything put back.
template <int Stage, class B>
template <class Codec, class G>
at::Tensor ShardedHolder<Stage, B>::gathered_state(G& g, torch::optim::Optimizer& optimizer, const Lists& full) {
  at::Tensor steps;
  const auto fields = gather_fields<Codec>(g, optimizer, steps);
  if (!g.is_global_zero()) return at::Tensor();
  auto kept = take_piece_states(optimizer);
  auto pieces = swap_params(optimizer, full);
  struct Restore {
    ShardedHolder* h;
    torch::optim::Optimizer& o;
    Lists& pieces;
    States& kept;
    ~Restore() {
      h->drop_full_states(o);
      swap_params(o, std::move(pieces));
      h->put_back(o, std::move(kept));
    }
  } restore{this, optimizer, pieces, kept};
  for (std::size_t j = 0; j < params_.size(); ++j) {
    const auto& where = shards_->location(j);
    const int64_t step = steps[static_cast<int64_t>(j)].template item<int64_t>();
    if (!where.laid_out || step < 0) continue;
    const at::Tensor& p = params_[j];
    std::vector<at::Tensor> t(Codec::fields);
    for (std::size_t f = 0; f < Codec::fields; ++f) {
      if (!fields[f].empty()) t[f] = fields[f][where.bucket].narrow(0, where.offset, p.numel()).view(p.sizes());
    }
    put_state(optimizer, p, Codec::make(t, step));
  }
  return checkpoint::optimizer_state(optimizer);
}

/// The archive loaded into the optimizer in the unsharded layout (its own checks refuse a state that does not fit),
/// then each piece's part of its parameter's state kept. On any failure the optimizer is as it was (its own archive,
/// taken first, loaded back).
template <int Stage, class B>
template <class Codec>
void ShardedHolder<Stage, B>::load_cut(torch::optim::Optimizer& optimizer, const Lists& full, const at::Tensor& bytes,
                                       const std::string& path) {
  const at::Tensor backup = checkpoint::optimizer_state(optimizer);  // the pieces' layout
  auto kept = take_piece_states(optimizer);
  auto pieces = swap_params(optimizer, full);
  try {
    checkpoint::load_optimizer_state(optimizer, bytes, path);
    auto cut = cut_states<Codec>(optimizer, path);
    drop_full_states(optimizer);
    swap_params(optimizer, std::move(pieces));
    put_back(optimizer, std::move(cut));
  } catch (...) {
    drop_full_states(optimizer);
    if (!pieces.empty()) swap_params(optimizer, std::move(pieces));
    checkpoint::load_optimizer_state(optimizer, backup, path);
    throw;
  }
}

/// Each piece's part of the whole state the optimizer holds for its parameter (none where it holds none); a state
/// tensor of another size than its parameter is refused.
template <int Stage, class B>
template <class Codec>
auto ShardedHolder<Stage, B>::cut_states(torch::optim::Optimizer& optimizer, const std::string& path) -> States {
  using State = typename Codec::State;
  torch::NoGradGuard no_grad;
  States cut;
  for (const ShardPiece& piece : shards_->pieces()) {
    const at::Tensor& p = params_[piece.param];
    const auto* s = find_state(optimizer, p);
    if (s == nullptr) {
      cut.emplace_back();
      continue;
    }
    auto t = Codec::tensors(static_cast<const State&>(*s));
    for (auto& x : t) {
      if (!x.defined()) continue;
      if (x.numel() != p.numel()) {
        throw CheckpointError("volt: the optimizer state in " + path + " holds a tensor of " +
                              std::to_string(x.numel()) + " elements for parameter " + std::to_string(piece.param) +
                              ", which has " + std::to_string(p.numel()) + "; nothing was loaded.");
      }
      x = x.reshape(-1).narrow(0, piece.param_offset, piece.numel).clone();
    }
    cut.push_back(Codec::make(t, Codec::step(static_cast<const State&>(*s))));
  }
  return cut;
}

/// Stage 3, as the fit's first training forward ends (every rank at once): the units it recorded become the reducer's
/// buckets, so that its backward already reduce-scatters each unit's gradients into this rank's blocks as they arrive
/// (no rank holds every gradient, even in the first step, which still runs with the parameters whole).
template <int Stage, class B>
template <class G>
void ShardedHolder<Stage, B>::unit_reducer(G& g) {
  auto groups = units_->groups(
      params_, [&](const at::Tensor& t, Reduce op) { return g.all_reduce(t, op).cpu(); }, g.global_rank(),
      g.world_size());
  reducer_ = std::make_unique<Reducer<B>>(params_, g.backend(), g.world_size(), std::move(groups),
                                          GradSync::reduce_scatter_to_blocks);
  reducer_->on_bucket_ready([units = units_.get()](std::size_t bucket) { units->bucket_done(bucket); });
  reducer_->use_pool(*pool_);
}

/// Stage 3, once the fit's first synchronised backward is over: the parameters are laid out in the reducer's buckets,
/// each rank keeping its shards (the pieces' gradients are its blocks, as after every backward); the optimizer is given
/// the pieces, with its state cut likewise where a resume loaded one; every bucket's storage is freed.
template <int Stage, class B>
template <class G>
void ShardedHolder<Stage, B>::lay_out(G& g, torch::optim::Optimizer& optimizer) {
  shards_ = std::make_unique<ShardLayout>(reducer_->buckets(), params_, g.global_rank(), g.world_size(),
                                          pool_.get(), compute_dtype_);
  with_state_codec(optimizer, [&](auto codec) {
    States cut = optimizer.state().empty() ? States() : cut_states<decltype(codec)>(optimizer, "the resumed state");
    drop_full_states(optimizer);
    for (auto& group : optimizer.param_groups()) group.params() = pieces_for(group.params());
    put_back(optimizer, std::move(cut));
  });
  units_->attach(*shards_);
}

template <int Stage, class B>
template <class G>
  requires(Stage == 3)
c10::Dict<std::string, at::Tensor> ShardedHolder<Stage, B>::module_state(G& g, const torch::nn::Module& module,
                                                                         bool on_device) {
  if (!shards_ || whole_) {
    return g.is_global_zero() ? checkpoint::module_state(module, on_device) : c10::Dict<std::string, at::Tensor>();
  }
  std::vector<at::Tensor> whole(params_.size());
  for (std::size_t i = 0; i < shards_->flats().size(); ++i) {
    const at::Tensor bucket = whole_bucket(g, i);
    if (!g.is_global_zero()) continue;
    for (std::size_t j : reducer_->buckets()[i].members) {
      const at::Tensor t = bucket.narrow(0, shards_->location(j).offset, params_[j].numel()).view(params_[j].sizes());
      whole[j] = on_device ? t.clone() : t.cpu().clone();
    }
  }
  c10::Dict<std::string, at::Tensor> out;
  if (!g.is_global_zero()) return out;
  std::size_t j = 0;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = whole[j++];
    out.insert(p.key(), t.defined() ? t : (on_device ? p.value().detach() : p.value().detach().cpu()));
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.insert(b.key(), on_device ? b.value().detach() : b.value().detach().cpu());
  }
  return out;
}

template <int Stage, class B>
template <class G>
  requires(Stage == 3)
void ShardedHolder<Stage, B>::load_module_state(G& /*part*/, torch::nn::Module& module,
                                                const checkpoint::Dict& state) {
  if (!shards_ || whole_) return checkpoint::load_module_state(module, state);
  units_->release_all();
  torch::NoGradGuard no_grad;
  std::size_t j = 0;
  for (auto& p : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor value = state.at(p.key()).toTensor();
    if (!shards_->location(j).laid_out) {
      p.value().copy_(value);
    } else if (const ShardPiece* piece = shards_->piece_of(j)) {
      piece->tensor.copy_(value.reshape(-1).narrow(0, piece->param_offset, piece->numel));
    }
    ++j;
  }
  for (auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) b.value().copy_(state.at(b.key()).toTensor());
  }
}

}  // namespace detail

/// The optimizer state sharded across ranks (stage 1), the gradients too (stage 2): ZeRO. A layout (strategies/layout.hpp)
/// with its options: `ZeRO<2>`'s default part is `Sharded<2>{}`, and `trainer.strategy().layout()` is it.
template <int Stage>
struct Sharded {
  static_assert(Stage >= 1 && Stage <= 3, "volt: ZeRO<Stage, ...> takes stage 1 (the optimizer state sharded), 2 (the "
                                          "gradients too) or 3 (the parameters too: FSDP).");
  static constexpr int stage = Stage;
  static constexpr const char* name = Stage == 1 ? "ZeRO<1>" : "ZeRO<2>";
  using volt_roles = Roles<role::steps_pieces>;
  /// The gradient buckets' sizes in bytes (PyTorch's defaults: 1 MiB for the first bucket, 25 MiB for the rest).
  std::size_t first_bucket_bytes = detail::kFirstBucketBytes;
  std::size_t bucket_bytes = detail::kBucketBytes;
  template <class Backend>
  using Holder = detail::ShardedHolder<Stage, Backend>;
};

/// The parameters sharded too: FSDP (`FullySharded`), each unit's gathered where it runs (strategies/fully_sharded.hpp)
/// and its gradients reduce-scattered into this rank's shards as its backward ends; the buckets are the units.
template <>
struct Sharded<3> {
  static constexpr int stage = 3;
  static constexpr const char* name = "FSDP";
  using volt_roles = Roles<role::steps_pieces, role::gathers_units>;
  /// Whether a unit's parameters are freed after its forward (default) or kept until its backward (more memory, one
  /// all-gather fewer per unit and step).
  bool reshard_after_forward = true;
  /// Whether every micro-batch of an accumulation window has its gradients reduce-scattered into this rank's shards
  /// (default: no rank holds a window's unsharded gradients, at one reduce-scatter per unit and micro-batch), or only
  /// the last, the others accumulating in the module's `.grad` as DDP's do (needed by `Context::weigh_loss` with
  /// accumulation). FSDP2's `set_requires_gradient_sync`.
  bool sync_every_micro_batch = true;
  template <class Backend>
  using Holder = detail::ShardedHolder<3, Backend>;
};

/// FSDP's layout.
using FullySharded = Sharded<3>;

}  // namespace volt
