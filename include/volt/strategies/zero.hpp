#pragma once
/// \file
/// `volt::ZeRO<Stage, Launcher, Backend>`: data parallelism with the optimizer state sharded across ranks (stage 1)
/// and the gradients too (stage 2), as DeepSpeed's ZeRO stages 1 and 2 (arXiv:1910.02054). DDP keeps a whole copy of
/// the weights, gradients and optimizer state on every rank; with Adam the state is twice the weights. Here each rank
/// keeps the state of 1/W of the elements, and the gradients travel as a reduce-scatter plus an all-gather of the
/// weights: the bytes of one all-reduce, so the memory comes at no communication cost.
///
///  - set-up, data, logging, decisions: as DDP (it derives from it);
///  - layout, at the fit's start (after `configure_optimizers`): the parameters that require gradients are laid out in
///    DDP's buckets (reverse order, so communication starts during backward; by dtype and device), each padded to a
///    multiple of the world size W, and each parameter becomes a view into its bucket's flat buffer. Rank r owns block
///    r of every bucket. The optimizer's parameter groups are given, in place of each parameter, the piece of it that
///    falls in this rank's blocks, before its first step: its state (made at its first step) covers those pieces only;
///  - gradients: on the micro-batch that steps, each bucket is reduce-scattered (averaged) as soon as its last
///    gradient arrives, in bucket order on every rank; the pieces' gradients are this rank's reduced block, and each
///    module `.grad` is dropped as its bucket takes it. Stage 1 keeps every bucket's full gradient buffer, stage 2
///    only its block: a bucket's buffer lives from its first gradient to the end of its reduce-scatter, so its
///    backward holds the blocks and a few buckets. Both run at most two collectives at once
///    (`detail::kBucketsInFlight`). Micro-batches that only accumulate do so in
///    `.grad`, locally, as under DDP. So `on_before_optimizer_step` finds no `.grad` on the module's parameters (the
///    averages are in the pieces: `optimizer.param_groups()`), and zero_grad drops every module parameter's `.grad`;
///  - the step: gradient clipping reduces the squared norm across ranks (Fp16Mixed's inf check likewise, so every rank
///    skips the same steps); each rank steps its pieces, then every bucket is all-gathered in place;
///  - checkpoints: the pieces' states are gathered and written in the layout of an unsharded run (`torch.load` reads
///    it; DDP and one process resume it), and a resume cuts the file's state by this run's world size, so a run saved
///    on N ranks resumes on M.
/// What it is not (refused at compile time): manual optimization and graph mode.
///
/// \code
///   volt::Trainer<volt::ZeRO<2, volt::Spawn>, volt::Bf16Mixed, volt::GPU> trainer({.devices = 8});
///   volt::Trainer<volt::ZeRO<1, volt::Script, volt::Mpi>, volt::Fp32, volt::CPU> cpu({.devices = 2});
/// \endcode

#include "volt/optim/gradients.hpp"
#include "volt/strategies/ddp.hpp"
#include "volt/strategies/reducer.hpp"
#include "volt/strategies/shard_layout.hpp"
#include "volt/strategies/zero_state.hpp"

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt {

template <int Stage, class L = Script, class B = AutoBackend>
class ZeRO : public DDP<L, B> {
  static_assert(Stage == 1 || Stage == 2, "volt: ZeRO<Stage, ...> takes stage 1 (the optimizer state sharded) or 2 "
                                          "(the gradients too); stage 3 (the parameters too) is not there yet.");
  using Base = DDP<L, B>;

 public:
  static constexpr const char* name = Stage == 1 ? "ZeRO<1>" : "ZeRO<2>";
  static constexpr int stage = Stage;
  static constexpr bool shards_optimizer_state = true;
  /// The strategy the Trainer runs for accelerator `A` (the backend resolved).
  template <class A>
  using with_accelerator = ZeRO<Stage, L, resolve_backend_t<B, A>>;

  ZeRO() { this->spec_.strategy = name; }

  /// Lays the parameters out (at each fit's start: the module was placed, broadcast and cast by then) and gives
  /// `optimizer` this rank's pieces in place of the parameters. The layout stays after the fit, so that validate,
  /// test or a save after it see the parameters and optimizer as the fit left them.
  void setup_optimizer(torch::optim::Optimizer& optimizer) {
    drop_layout();  // once per fit: automatic optimization has one optimizer
    detail::with_state_codec(optimizer, [](auto) {});  // refuses an optimizer whose state is not elementwise
    if (!optimizer.state().empty()) {
      throw ConfigError("volt: ZeRO shards an optimizer before its first step; the one configure_optimizers returned "
                        "already holds state. Load state through fit(..., ckpt_path) instead.");
    }
    if (!this->reducer_) {
      this->reducer_ = std::make_unique<detail::Reducer<B>>(this->params_, this->backend(), this->world_size(),
                                                      this->first_bucket_bytes_, this->bucket_bytes_,
                                                      Stage == 1 ? detail::GradSync::reduce_scatter
                                                                 : detail::GradSync::reduce_scatter_to_blocks);
      shards_ = std::make_unique<detail::ShardLayout>(this->reducer_->buckets(), this->params_, this->global_rank(),
                                                      this->world_size());
    }
    std::vector<std::vector<at::Tensor>> full;
    for (auto& group : optimizer.param_groups()) {
      full.push_back(group.params());
      group.params() = pieces_for(group.params());
    }
    full_params_[&optimizer] = std::move(full);
  }

  /// The pieces' gradients and the module's.
  void zero_grad(torch::optim::Optimizer& optimizer) {
    detail::zero_grad(optimizer);
    detail::zero_grad(this->params_, /*keep_tensors=*/false);
  }

  void pre_backward(bool sync) {
    require_layout();
    if (sync) shards_->check_aliasing(this->params_);
    synced_ = sync;
    this->reducer_->prepare(sync);
  }
  /// After a synchronised backward: the pieces' gradients are this rank's averaged blocks.
  void post_backward() {
    this->reducer_->finish();
    if (!synced_) return;
    synced_ = false;
    const auto& buckets = this->reducer_->buckets();
    for (const detail::ShardPiece& piece : shards_->pieces()) {
      const auto& b = buckets[piece.bucket];
      at::Tensor& g = piece.tensor.mutable_grad();
      if (!b.taking_part[piece.slot]) {
        g = at::Tensor();
      } else if constexpr (Stage == 2) {
        g = detail::alias(this->reducer_->blocks()[piece.bucket], piece.bucket_offset - shards_->block_start(piece.bucket),
                          piece.numel);
      } else {
        g = detail::alias(b.flat, piece.bucket_offset, piece.numel);
      }
    }
  }

  /// Clips this rank's pieces' gradients (detail::clip_gradients): by value elementwise, by norm with the norm over
  /// every rank's pieces (the module's parameters, given, hold no gradients between a synchronised backward and the
  /// step).
  void clip_gradients(const std::vector<at::Tensor>& /*module_params*/, double value, ClipAlgorithm algorithm) {
    std::vector<at::Tensor> pieces;
    for (const detail::ShardPiece& piece : shards_->pieces()) pieces.push_back(piece.tensor);
    detail::clip_gradients(pieces, value, algorithm, NormOverRanks{this});
  }

  /// Every rank agrees on a loss-scaled step's inf check, steps its pieces, then gathers the parameters.
  template <class P>
  bool optimizer_step(P& precision, torch::optim::Optimizer& optimizer) {
    precision.agree_found_inf(optimizer, [&](at::Tensor& found) { this->backend().all_reduce_(found, Reduce::max); });
    const bool stepped = precision.optimizer_step(optimizer);
    if (stepped) gather_parameters();
    return stepped;
  }

  /// Collective: the optimizer's state in the layout of an unsharded run, as bytes on rank zero (empty elsewhere).
  at::Tensor optimizer_state(torch::optim::Optimizer& optimizer);
  /// Loads an optimizer archive in any run's layout (unsharded, or gathered by this strategy on any world size) and
  /// keeps this rank's pieces of it. On any failure the optimizer keeps its previous state.
  void load_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& bytes, const std::string& path);

  /// After a run: the gradient hooks stay until the next fit's layout, with the pieces the optimizer holds (a save
  /// after the fit gathers them); the bucket layout stays readable.
  void teardown() {
    if (this->reducer_) this->layout_ = this->reducer_->bucket_layout();
  }
 private:
  void require_layout() const {
    if (!shards_) throw std::logic_error("volt: ZeRO's backward ran before setup_optimizer laid the parameters out.");
  }
  void drop_layout() {
    this->reducer_.reset();
    shards_.reset();
    full_params_.clear();
  }
  /// `params` with each laid-out module parameter replaced by this rank's piece of it (none: left out); a tensor that
  /// is not laid out (frozen at the fit's start, or not the module's) stays as it is, stepped whole on every rank.
  std::vector<at::Tensor> pieces_for(const std::vector<at::Tensor>& params) const {
    std::unordered_map<const void*, std::size_t> index;
    for (std::size_t i = 0; i < this->params_.size(); ++i) index.emplace(this->params_[i].unsafeGetTensorImpl(), i);
    std::vector<at::Tensor> out;
    for (const at::Tensor& p : params) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end() || !shards_->location(it->second).laid_out) {
        out.push_back(p);
      } else if (const detail::ShardPiece* piece = shards_->piece_of(it->second)) {
        out.push_back(piece->tensor);
      }
    }
    return out;
  }
  /// All-gathers every bucket's weights, at most `detail::kBucketsInFlight` at a time (as the reduce-scatters: a
  /// non-blocking MPI collective holds buffers of its own until it is waited for).
  void gather_parameters() {
    std::deque<typename B::Work> works;
    int bucket = 0;
    for (const at::Tensor& flat : shards_->flats()) {
      if (works.size() == detail::kBucketsInFlight) {
        works.front().wait();
        works.pop_front();
      }
      const detail::BucketTag tag(bucket++);
      works.push_back(this->backend().iall_gather_(flat));
    }
    for (auto& w : works) w.wait();
  }
  /// Sets every group's parameters of `optimizer` to `lists`, returning the lists it had.
  static std::vector<std::vector<at::Tensor>> swap_params(torch::optim::Optimizer& optimizer,
                                                          std::vector<std::vector<at::Tensor>> lists) {
    if (lists.size() != optimizer.param_groups().size()) {
      throw std::logic_error("volt: ZeRO's optimizer has " + std::to_string(optimizer.param_groups().size()) +
                             " parameter groups, " + std::to_string(lists.size()) + " when the fit started; add "
                             "groups in configure_optimizers, before the fit.");
    }
    std::vector<std::vector<at::Tensor>> old;
    for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      old.push_back(std::move(optimizer.param_groups()[g].params()));
      optimizer.param_groups()[g].params() = std::move(lists[g]);
    }
    return old;
  }
  /// Takes the pieces' states out of `optimizer` (to be put back with `put_back`).
  std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> take_piece_states(torch::optim::Optimizer& optimizer) {
    std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> out;
    for (const detail::ShardPiece& piece : shards_->pieces()) out.push_back(detail::take_state(optimizer, piece.tensor));
    return out;
  }
  void put_back(torch::optim::Optimizer& optimizer, std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> states) {
    for (std::size_t i = 0; i < states.size(); ++i) {
      if (states[i]) detail::put_state(optimizer, shards_->pieces()[i].tensor, std::move(states[i]));
    }
  }
  /// Drops the states `optimizer` files under the laid-out module parameters themselves.
  void drop_full_states(torch::optim::Optimizer& optimizer) {
    for (std::size_t j = 0; j < this->params_.size(); ++j) {
      if (shards_->location(j).laid_out) detail::take_state(optimizer, this->params_[j]);
    }
  }
  template <class Codec>
  std::vector<std::vector<at::Tensor>> gather_fields(torch::optim::Optimizer& optimizer, at::Tensor& steps);
  template <class Codec>
  at::Tensor gathered_state(torch::optim::Optimizer& optimizer, const std::vector<std::vector<at::Tensor>>& full);
  template <class Codec>
  void load_cut(torch::optim::Optimizer& optimizer, const std::vector<std::vector<at::Tensor>>& full,
                const at::Tensor& bytes, const std::string& path);
  template <class Codec>
  std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> cut_states(torch::optim::Optimizer& optimizer,
                                                                             const std::string& path);

  /// The total norm of every rank's pieces: each rank's squares summed in float32 across ranks (clip_gradients).
  struct NormOverRanks {
    static constexpr bool coefficient_in_grad_dtype = true;
    ZeRO* z;
    at::Tensor operator()(const std::vector<at::Tensor>& norms) const {
      at::Tensor squares = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat32).device(z->device_));
      for (const auto& n : norms) squares += n.to(torch::kFloat32).square().to(squares.device());
      z->backend().all_reduce_(squares, Reduce::sum);
      return squares.sqrt();
    }
  };

  std::unique_ptr<detail::ShardLayout> shards_;
  std::unordered_map<const torch::optim::Optimizer*, std::vector<std::vector<at::Tensor>>> full_params_;
  bool synced_ = false;
};

template <int Stage, class L, class B>
at::Tensor ZeRO<Stage, L, B>::optimizer_state(torch::optim::Optimizer& optimizer) {
  const auto full = full_params_.find(&optimizer);
  if (!shards_ || full == full_params_.end()) {
    return this->is_global_zero() ? checkpoint::optimizer_state(optimizer) : at::Tensor();
  }
  return detail::with_state_codec(optimizer, [&](auto codec) {
    return gathered_state<decltype(codec)>(optimizer, full->second);
  });
}

/// Every rank's pieces of each state tensor, gathered one bucket at a time into flat buffers laid out as the
/// parameters', kept on rank zero only ([field][bucket]; no buckets for a field no rank has; elsewhere none at all,
/// so a rank other than zero holds one bucket of one field at a time); `steps` becomes each parameter's step count,
/// -1 where no rank holds state for it.
template <int Stage, class L, class B>
template <class Codec>
std::vector<std::vector<at::Tensor>> ZeRO<Stage, L, B>::gather_fields(torch::optim::Optimizer& optimizer,
                                                                      at::Tensor& steps) {
  using State = typename Codec::State;
  const auto& pieces = shards_->pieces();
  steps = torch::full({static_cast<int64_t>(this->params_.size())}, -1, torch::kLong);
  at::Tensor defined = torch::zeros({static_cast<int64_t>(Codec::fields)}, torch::kLong);
  for (const detail::ShardPiece& piece : pieces) {
    if (const auto* s = detail::find_state(optimizer, piece.tensor)) {
      steps[static_cast<int64_t>(piece.param)] = Codec::step(static_cast<const State&>(*s));
      const auto t = Codec::tensors(static_cast<const State&>(*s));
      for (std::size_t f = 0; f < t.size(); ++f) {
        if (t[f].defined()) defined[static_cast<int64_t>(f)] = 1;
      }
    }
  }
  steps = this->all_reduce(steps, Reduce::max).cpu();
  defined = this->all_reduce(defined, Reduce::max).cpu();
  std::vector<std::vector<at::Tensor>> fields(Codec::fields);
  torch::NoGradGuard no_grad;
  for (std::size_t f = 0; f < Codec::fields; ++f) {
    if (defined[static_cast<int64_t>(f)].item<int64_t>() == 0) continue;
    for (std::size_t i = 0; i < shards_->flats().size(); ++i) {
      at::Tensor buffer = torch::zeros_like(shards_->flats()[i]);
      for (const detail::ShardPiece& piece : pieces) {
        const auto* s = piece.bucket == i ? detail::find_state(optimizer, piece.tensor) : nullptr;
        if (s == nullptr) continue;
        const at::Tensor t = Codec::tensors(static_cast<const State&>(*s))[f];
        if (t.defined()) buffer.narrow(0, piece.bucket_offset, piece.numel).copy_(t.reshape(-1));
      }
      this->backend().all_gather_(buffer);
      if (this->is_global_zero()) fields[f].push_back(std::move(buffer));
    }
  }
  return fields;
}

/// On rank zero, for the time of one save: the pieces' states aside, each laid-out parameter's whole state filed
/// under it, the groups holding the module's parameters; LibTorch's archive of that; then everything put back.
template <int Stage, class L, class B>
template <class Codec>
at::Tensor ZeRO<Stage, L, B>::gathered_state(torch::optim::Optimizer& optimizer,
                                              const std::vector<std::vector<at::Tensor>>& full) {
  at::Tensor steps;
  const auto fields = gather_fields<Codec>(optimizer, steps);
  if (!this->is_global_zero()) return at::Tensor();
  auto kept = take_piece_states(optimizer);
  auto pieces = swap_params(optimizer, full);
  struct Restore {
    ZeRO* z;
    torch::optim::Optimizer& o;
    std::vector<std::vector<at::Tensor>>& pieces;
    std::vector<std::unique_ptr<torch::optim::OptimizerParamState>>& kept;
    ~Restore() {
      z->drop_full_states(o);
      swap_params(o, std::move(pieces));
      z->put_back(o, std::move(kept));
    }
  } restore{this, optimizer, pieces, kept};
  for (std::size_t j = 0; j < this->params_.size(); ++j) {
    const auto& where = shards_->location(j);
    const int64_t step = steps[static_cast<int64_t>(j)].template item<int64_t>();
    if (!where.laid_out || step < 0) continue;
    const at::Tensor& p = this->params_[j];
    std::vector<at::Tensor> t(Codec::fields);
    for (std::size_t f = 0; f < Codec::fields; ++f) {
      if (!fields[f].empty()) t[f] = fields[f][where.bucket].narrow(0, where.offset, p.numel()).view(p.sizes());
    }
    detail::put_state(optimizer, p, Codec::make(t, step));
  }
  return checkpoint::optimizer_state(optimizer);
}

template <int Stage, class L, class B>
void ZeRO<Stage, L, B>::load_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& bytes,
                                             const std::string& path) {
  const auto full = full_params_.find(&optimizer);
  if (!shards_ || full == full_params_.end()) return checkpoint::load_optimizer_state(optimizer, bytes, path);
  detail::with_state_codec(optimizer, [&](auto codec) { load_cut<decltype(codec)>(optimizer, full->second, bytes, path); });
}

/// The archive loaded into the optimizer in the unsharded layout (its own checks refuse a state that does not fit),
/// then each piece's part of its parameter's state kept. On any failure the optimizer is as it was (its own archive,
/// taken first, loaded back).
template <int Stage, class L, class B>
template <class Codec>
void ZeRO<Stage, L, B>::load_cut(torch::optim::Optimizer& optimizer, const std::vector<std::vector<at::Tensor>>& full,
                                 const at::Tensor& bytes, const std::string& path) {
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
template <int Stage, class L, class B>
template <class Codec>
std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> ZeRO<Stage, L, B>::cut_states(
    torch::optim::Optimizer& optimizer, const std::string& path) {
  using State = typename Codec::State;
  torch::NoGradGuard no_grad;
  std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> cut;
  for (const detail::ShardPiece& piece : shards_->pieces()) {
    const at::Tensor& p = this->params_[piece.param];
    const auto* s = detail::find_state(optimizer, p);
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

}  // namespace volt
