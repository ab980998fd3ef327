#pragma once
/// \file
/// Gradient averaging for data parallelism, in the manner of PyTorch's DDP Reducer: parameters are grouped
/// into flat buckets in reverse order (the order backward produces gradients), the first bucket capped at
/// 1 MiB so communication starts early and the others at 25 MiB; a bucket's all-reduce starts as soon as its
/// last gradient arrives (a hook that runs after each parameter's gradient accumulator, as PyTorch's), buckets are
/// started in index order on every rank (so the collectives match), and at the end of backward every bucket is
/// waited for and copied back into `.grad`.
///
/// Gradient accumulation: on micro-batches that do not step, the hooks stay disarmed and gradients accumulate
/// locally; on the last one, each bucket takes the accumulated gradient plus the new one. A parameter that
/// received no gradient this backward contributes its `.grad` (or zeros), so ranks that skip a parameter
/// still agree on every bucket.
///
/// Which parameters take part is read at each synchronised backward: those that require gradients then (the same on
/// every rank, since every rank runs the same code). A frozen parameter, or one of another optimizer under manual
/// optimization's `toggle_optimizer`, keeps its `.grad` untouched, and a bucket with no such parameter is not
/// reduced at all. A parameter that starts to require gradients after the reducer was built is adopted: it gets its
/// hook and the buckets are laid out again (the same way on every rank).
///
/// The sharded strategy (ZeRO) reduce-scatters the buckets instead: each bucket is padded to a multiple of the world
/// size, and after `finish` this rank's block of each bucket holds the averaged gradients of the elements it owns;
/// the module's `.grad` of the parameters that took part are dropped as each is copied into its bucket (so a backward
/// never holds every gradient twice). Stage 1 (`GradSync::reduce_scatter`) keeps the buckets whole, the blocks inside
/// them; stage 2 (`GradSync::reduce_scatter_to_blocks`) keeps only this rank's blocks (`blocks()`): a bucket's buffer
/// is made when its first gradient arrives and freed once its reduce-scatter is done and its block copied out, so a
/// backward holds the blocks plus a few buckets rather than every gradient. In both, when a bucket starts with
/// `kBucketsInFlight` before it still in flight, the oldest is finished first: a non-blocking MPI collective holds
/// buffers of its own until it is waited for (on 4 ranks, 13 buckets: stage 1's memory rise 0.89 -> 0.46 of DDP's,
/// bench/zero). Its layout is fixed once made: a parameter that
/// starts to require gradients later is refused.

#include "volt/comm/concept.hpp"
#include "volt/comm/watchdog.hpp"
#include "volt/errors.hpp"
#include "volt/reduce.hpp"
#include "volt/stage.hpp"
#include "volt/strategies/buffer_pool.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace volt::detail {

inline constexpr std::size_t kFirstBucketBytes = std::size_t{1} << 20;
inline constexpr std::size_t kBucketBytes = std::size_t{25} << 20;
/// ZeRO: buckets whose collective may run at once: the reduce-scatters during backward (stage 2's buffers exist until
/// then), and the parameters' all-gathers after the step (strategies/zero.hpp's `gather_parameters`).
inline constexpr std::size_t kBucketsInFlight = 2;

/// The bytes `t` holds (none when undefined).
inline std::size_t bytes_of(const torch::Tensor& t) {
  return t.defined() ? static_cast<std::size_t>(t.numel()) * t.element_size() : 0;
}

/// Runs `fn` after a gradient accumulator ran: the parameter's `.grad` then holds this backward's gradient added to
/// what it accumulated before.
struct AfterAccumulation final : torch::autograd::FunctionPostHook {
  explicit AfterAccumulation(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }
  std::function<void()> fn_;
};

/// What a bucket's collective leaves: every rank the whole average (DDP), or each rank its block of it, in the bucket
/// kept whole (ZeRO stage 1) or copied out of it, the bucket freed (stage 2).
enum class GradSync { all_reduce, reduce_scatter, reduce_scatter_to_blocks };

template <class Backend>
class Reducer {
 public:
  /// A bucket of gradients: its parameters' indices, where each starts in `flat`, and the flat buffer itself
  /// (reduce-scatter: padded to a multiple of the world size; to blocks: defined only while its gradients travel).
  struct Bucket {
    std::vector<std::size_t> members;
    std::vector<int64_t> offsets;
    std::vector<char> arrived;
    /// Which members require gradients in this backward, and whether any does (else the bucket is not reduced).
    std::vector<char> taking_part;
    bool active = true;
    torch::Tensor flat;
    torch::TensorOptions options;  // the flat buffer's dtype and device
    int64_t numel = 0;             // its length, padding included
    std::size_t pending = 0;
    bool ready = false;
    typename Backend::Work work;
  };

  Reducer(std::vector<torch::Tensor> params, Backend& backend, int world_size, std::size_t first_bucket_bytes = kFirstBucketBytes,
          std::size_t bucket_bytes = kBucketBytes, GradSync sync = GradSync::all_reduce)
      : params_(std::move(params)), backend_(&backend), world_size_(world_size), first_cap_(first_bucket_bytes),
        cap_(bucket_bytes), sync_(sync), hooks_(params_.size()) {
    adopt();
  }
  /// Buckets given, not sized: `groups` are each bucket's parameter indices in fill order (a fully sharded strategy's
  /// units); every parameter of a group must require gradients.
  Reducer(std::vector<torch::Tensor> params, Backend& backend, int world_size,
          std::vector<std::vector<std::size_t>> groups, GradSync sync)
      : params_(std::move(params)), backend_(&backend), world_size_(world_size), first_cap_(kFirstBucketBytes),
        cap_(kBucketBytes), sync_(sync), groups_(std::move(groups)), hooks_(params_.size()) {
    adopt();
  }
  /// Calls `f(bucket)` once a synchronised backward's bucket has every gradient it waits for (its collective started).
  void on_bucket_ready(std::function<void(std::size_t)> f) { on_ready_ = std::move(f); }
  /// To blocks: each bucket's buffer taken from `pool` (which must outlive the reducer) and given back once its block
  /// is copied out.
  void use_pool(BufferPool& pool) { pool_ = &pool; }
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;
  ~Reducer() {
    for (auto& h : hooks_) unhook(h);
  }

  std::size_t num_buckets() const { return buckets_.size(); }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// `GradSync::reduce_scatter_to_blocks`: this rank's block of every bucket, the averages after `finish`.
  const std::vector<torch::Tensor>& blocks() const { return blocks_; }
  /// Bytes of gradients held: the parameters' `.grad`, the buckets' buffers and the blocks.
  std::size_t gradient_bytes() const {
    std::size_t bytes = 0;
    for (const auto& p : params_) bytes += bytes_of(p.grad());
    for (const auto& b : buckets_) bytes += bytes_of(b.flat);
    for (const auto& b : blocks_) bytes += bytes_of(b);
    return bytes;
  }
  /// Parameter indices of each bucket, in the order they fill it.
  std::vector<std::vector<std::size_t>> bucket_layout() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) out.push_back(b.members);
    return out;
  }

  /// Before backward: `sync` arms the hooks (the micro-batch that steps); otherwise gradients only accumulate.
  /// `add_to_blocks` (to blocks): this backward's averages are added to the blocks' (a fully sharded strategy's later
  /// micro-batches of a window, each reduce-scattered) instead of replacing them.
  void prepare(bool sync, bool add_to_blocks = false) {
    adopt();
    armed_ = sync;
    add_to_blocks_ = add_to_blocks;
    if (!armed_ && !on_ready_) return;  // (a bucket's readiness is still told where asked: FSDP frees its unit then)
    next_launch_ = 0;
    in_flight_.clear();
    for (auto& b : buckets_) {
      b.pending = 0;
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        b.taking_part[k] = params_[b.members[k]].requires_grad() ? 1 : 0;
        b.pending += b.taking_part[k];
      }
      b.active = b.pending > 0;
      b.ready = !b.active;
      std::fill(b.arrived.begin(), b.arrived.end(), 0);
    }
  }

  /// After backward: finishes every bucket; DDP: writes the averaged gradients into `.grad` (ZeRO: they are in the
  /// blocks).
  void finish() {
    if (!armed_) return;
    armed_ = false;
    for (auto& b : buckets_) {
      if (b.ready) continue;
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        if (b.arrived[k] || !b.taking_part[k]) continue;
        const torch::Tensor& g = params_[b.members[k]].grad();
        torch::Tensor slot = buffer_of(b).narrow(0, b.offsets[k], params_[b.members[k]].numel());
        if (g.defined()) {
          slot.copy_(g.reshape(-1));
          slot.div_(world_size_);
        } else {
          slot.zero_();
        }
        if (sync_ != GradSync::all_reduce) params_[b.members[k]].mutable_grad() = torch::Tensor();
      }
      b.ready = true;
    }
    launch_ready();
    for (std::size_t i : in_flight_) complete(i);
    in_flight_.clear();
    if (sync_ != GradSync::all_reduce) return;
    for (auto& b : buckets_) {
      if (!b.active) continue;
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        if (!b.taking_part[k]) continue;
        torch::Tensor& p = params_[b.members[k]];
        const torch::Tensor slot = b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
        torch::Tensor& g = p.mutable_grad();
        if (g.defined()) {
          g.copy_(slot);
        } else {
          g = slot.clone();
        }
      }
    }
  }

 private:
  /// Where a parameter's hook sits: its gradient accumulator (held, as autograd holds it only weakly) and the key.
  struct Hook {
    std::shared_ptr<torch::autograd::Node> accumulator;
    std::uintptr_t key = 0;
  };
  static void unhook(Hook& h) {
    if (h.accumulator) h.accumulator->del_post_hook(h.key);
    h.accumulator.reset();
  }

  /// Hooks the parameters that require gradients and have none yet, laying the buckets out again when there were
  /// any; a parameter whose accumulator autograd made anew (its dtype or device changed) is hooked again.
  void adopt() {
    bool adopted = false;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].requires_grad()) continue;
      auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
      if (!accumulator || accumulator == hooks_[i].accumulator) continue;
      adopted = adopted || !hooks_[i].accumulator;
      unhook(hooks_[i]);
      hooks_[i].key = accumulator->add_post_hook(std::make_unique<AfterAccumulation>([this, i] { on_grad(i); }));
      hooks_[i].accumulator = std::move(accumulator);
    }
    if (!adopted) return;
    if (sync_ != GradSync::all_reduce && !buckets_.empty()) {
      throw ConfigError("volt: a parameter started to require gradients during a sharded (ZeRO) fit; the shards are "
                        "laid out once, at the fit's start: unfreeze it before fit, or use DDP.");
    }
    build_buckets(first_cap_, cap_);
  }

  void build_buckets(std::size_t first_cap, std::size_t cap) {
    buckets_.clear();
    blocks_.clear();
    offset_ = 0;
    bucket_of_.assign(params_.size(), 0);
    slot_of_.assign(params_.size(), 0);
    if (!groups_.empty()) return build_given_buckets();
    Bucket* open = nullptr;
    std::size_t open_bytes = 0;
    for (std::size_t j = params_.size(); j-- > 0;) {
      const torch::Tensor& p = params_[j];
      if (!hooks_[j].accumulator) continue;
      if (p.is_sparse()) throw std::invalid_argument("volt: DDP does not average sparse gradients.");
      const std::size_t bytes = static_cast<std::size_t>(p.numel()) * p.element_size();
      const std::size_t limit = buckets_.size() == 1 ? first_cap : cap;  // the open bucket is the first one
      const bool fits = open != nullptr && open->options.dtype() == p.dtype() && open->options.device() == p.device() &&
                        open_bytes + bytes <= limit;
      if (!fits) {
        if (open != nullptr) close_bucket(*open);
        buckets_.push_back(Bucket{});
        open = &buckets_.back();
        open->options = p.options().requires_grad(false);
        open_bytes = 0;
        offset_ = 0;
      }
      bucket_of_[j] = buckets_.size() - 1;
      slot_of_[j] = open->members.size();
      open->members.push_back(j);
      open->offsets.push_back(offset_);
      open->arrived.push_back(0);
      open->taking_part.push_back(1);
      offset_ += p.numel();
      open_bytes += bytes;
    }
    if (open != nullptr) close_bucket(*open);
  }

  /// One bucket per group of `groups_`, in their order.
  void build_given_buckets() {
    for (const auto& group : groups_) {
      buckets_.push_back(Bucket{});
      Bucket& b = buckets_.back();
      b.options = params_[group.front()].options().requires_grad(false);
      offset_ = 0;
      for (std::size_t j : group) {
        if (!hooks_[j].accumulator) {
          throw std::logic_error("volt: parameter " + std::to_string(j) + " of a unit requires no gradient.");
        }
        bucket_of_[j] = buckets_.size() - 1;
        slot_of_[j] = b.members.size();
        b.members.push_back(j);
        b.offsets.push_back(offset_);
        b.arrived.push_back(0);
        b.taking_part.push_back(1);
        offset_ += params_[j].numel();
      }
      close_bucket(b);
    }
  }

  /// The open bucket's length once its members are known (padded for a reduce-scatter), its buffer (to blocks: its
  /// block; the buffer is made as gradients arrive).
  void close_bucket(Bucket& b) {
    const bool padded = sync_ != GradSync::all_reduce;
    b.numel = padded ? Blocks::padded(offset_, world_size_).numel : offset_;
    if (sync_ == GradSync::reduce_scatter_to_blocks) {
      blocks_.push_back(torch::zeros({Blocks{b.numel, world_size_}.size()}, b.options));
    } else {
      b.flat = torch::zeros({b.numel}, b.options);
    }
  }
  torch::Tensor& buffer_of(Bucket& b) {
    if (b.flat.defined()) return b.flat;
    if (pool_ == nullptr) return b.flat = torch::zeros({b.numel}, b.options);
    b.flat = torch::empty({0}, b.options);
    pool_->fill(*b.flat.storage().unsafeGetStorageImpl(), static_cast<std::size_t>(b.numel) * b.flat.element_size());
    b.flat.set_(b.flat.storage(), 0, {b.numel}, {1});
    return b.flat.zero_();
  }
  /// Waits for bucket `i`'s collective; to blocks: copies this rank's block out and frees the bucket.
  void complete(std::size_t i) {
    Bucket& b = buckets_[i];
    b.work.wait();
    if (sync_ != GradSync::reduce_scatter_to_blocks) return;
    const torch::Tensor mine = block_of(b.flat, backend_->rank(), world_size_);
    add_to_blocks_ ? blocks_[i].add_(mine) : blocks_[i].copy_(mine);
    if (pool_ != nullptr) pool_->release(*b.flat.storage().unsafeGetStorageImpl());
    b.flat = torch::Tensor();
  }

  /// After parameter `i`'s accumulator ran: its `.grad` (the accumulated gradient) goes into the bucket, averaged.
  void on_grad(std::size_t i) {
    if (!armed_) return on_local_grad(i);
    Bucket& b = buckets_[bucket_of_[i]];
    const std::size_t k = slot_of_[i];
    // A parameter frozen after the forward that used it still has its accumulator run (which then adds nothing to
    // its .grad): it is not counted, so the bucket waits for the gradients it did count.
    if (b.arrived[k] || !b.taking_part[k]) return;
    torch::NoGradGuard no_grad;
    torch::Tensor slot = buffer_of(b).narrow(0, b.offsets[k], params_[i].numel());
    torch::Tensor& grad = params_[i].mutable_grad();
    if (grad.defined()) {
      slot.copy_(grad.reshape(-1));
      slot.div_(world_size_);
    } else {
      slot.zero_();
    }
    if (sync_ != GradSync::all_reduce) grad = torch::Tensor();  // its average will be in a block
    b.arrived[k] = 1;
    if (--b.pending == 0) {
      b.ready = true;
      launch_ready();
      if (on_ready_) on_ready_(bucket_of_[i]);
    }
  }

  /// A backward that only accumulates: parameter `i`'s gradient stays in `.grad`, in the bucket's dtype (FSDP's
  /// bfloat16 parameters have their gradients accumulated in float32, as FSDP2 does); its bucket is told ready
  /// (on_ready_) once every gradient it counts arrived.
  void on_local_grad(std::size_t i) {
    if (!on_ready_) return;
    Bucket& b = buckets_[bucket_of_[i]];
    torch::Tensor& grad = params_[i].mutable_grad();
    if (grad.defined() && grad.dtype() != b.options.dtype()) grad = grad.to(b.options.dtype());
    const std::size_t k = slot_of_[i];
    if (b.arrived[k] || !b.taking_part[k]) return;
    b.arrived[k] = 1;
    if (--b.pending == 0) on_ready_(bucket_of_[i]);
  }

  /// Starts every ready bucket whose predecessors have started: the same order on every rank. Reduce-scatters: with
  /// `kBucketsInFlight` buckets travelling, the oldest is completed before another starts.
  void launch_ready() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) {
      const std::size_t i = next_launch_++;
      Bucket& b = buckets_[i];
      if (!b.active) continue;
      if (sync_ != GradSync::all_reduce && in_flight_.size() == kBucketsInFlight) {
        complete(in_flight_.front());
        in_flight_.erase(in_flight_.begin());
      }
      const BucketTag tag(static_cast<int>(i));  // named in the flight recorder
      b.work = sync_ == GradSync::all_reduce ? backend_->iall_reduce_(b.flat, Reduce::sum)
                                             : backend_->ireduce_scatter_(b.flat, Reduce::sum);
      in_flight_.push_back(i);
    }
  }

  std::vector<torch::Tensor> params_;
  Backend* backend_;
  int world_size_;
  std::size_t first_cap_, cap_;
  GradSync sync_;
  std::vector<std::vector<std::size_t>> groups_;  // the buckets, where given
  std::function<void(std::size_t)> on_ready_;
  BufferPool* pool_ = nullptr;  // to blocks: where the buckets' buffers come from, if given
  std::vector<Bucket> buckets_;
  std::vector<torch::Tensor> blocks_;    // to blocks: this rank's block of each bucket
  std::vector<std::size_t> in_flight_;  // buckets started and not yet completed, oldest first
  std::vector<std::size_t> bucket_of_, slot_of_;
  std::vector<Hook> hooks_;
  int64_t offset_ = 0;
  std::size_t next_launch_ = 0;
  bool armed_ = false;
  bool add_to_blocks_ = false;
};

}  // namespace volt::detail
