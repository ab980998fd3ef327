#pragma once
/// \file
/// Gradient averaging for data parallelism, in the manner of PyTorch's DDP Reducer: parameters are grouped
/// into flat buckets in reverse order (the order backward produces gradients), the first bucket capped at
/// 1 MiB so communication starts early and the others at 25 MiB; a bucket's all-reduce starts as soon as its
/// last gradient arrives, buckets are started in index order on every rank (so the collectives match),
/// and at the end of backward every bucket is waited for and copied back into `.grad`.
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
/// The sharded strategy (ZeRO) reduce-scatters the buckets instead (`GradSync::reduce_scatter`): each bucket is padded
/// to a multiple of the world size, and after `finish` this rank's block of each bucket holds the averaged gradients
/// of the elements it owns; the module's `.grad` of the parameters that took part are dropped (their averages live in
/// the blocks). Its layout is fixed once made: a parameter that starts to require gradients later is refused.

#include "volt/context.hpp"

#include <torch/types.h>

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace volt::detail {

inline constexpr std::size_t kFirstBucketBytes = std::size_t{1} << 20;
inline constexpr std::size_t kBucketBytes = std::size_t{25} << 20;

/// The bytes `t` holds (none when undefined).
inline std::size_t bytes_of(const torch::Tensor& t) {
  return t.defined() ? static_cast<std::size_t>(t.numel()) * t.element_size() : 0;
}

/// What a bucket's collective leaves: every rank the whole average (DDP), or each rank its block of it (ZeRO).
enum class GradSync { all_reduce, reduce_scatter };

template <class Backend>
class Reducer {
 public:
  /// A bucket of gradients: its parameters' indices, where each starts in `flat`, and the flat buffer itself
  /// (reduce-scatter: padded to a multiple of the world size; undefined between backwards after `release_flats`).
  struct Bucket {
    std::vector<std::size_t> members;
    std::vector<int64_t> offsets;
    std::vector<char> arrived;
    /// Which members require gradients in this backward, and whether any does (else the bucket is not reduced).
    std::vector<char> taking_part;
    bool active = true;
    torch::Tensor flat;
    int64_t numel = 0;  // the flat buffer's length, padding included
    std::size_t pending = 0;
    bool ready = false;
    typename Backend::Work work;
  };

  Reducer(std::vector<torch::Tensor> params, Backend& backend, int world_size, std::size_t first_bucket_bytes = kFirstBucketBytes,
          std::size_t bucket_bytes = kBucketBytes, GradSync sync = GradSync::all_reduce)
      : params_(std::move(params)), backend_(&backend), world_size_(world_size), first_cap_(first_bucket_bytes),
        cap_(bucket_bytes), sync_(sync), hooks_(params_.size(), -1) {
    adopt();
  }
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;
  ~Reducer() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (hooks_[i] >= 0) params_[i].remove_hook(static_cast<unsigned>(hooks_[i]));
    }
  }

  std::size_t num_buckets() const { return buckets_.size(); }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// Bytes of gradients held: the parameters' `.grad` and the buckets' buffers.
  std::size_t gradient_bytes() const {
    std::size_t bytes = 0;
    for (const auto& p : params_) bytes += bytes_of(p.grad());
    for (const auto& b : buckets_) bytes += bytes_of(b.flat);
    return bytes;
  }
  /// Frees every bucket's flat buffer until the next synchronised backward (ZeRO stage 2 keeps only its blocks).
  void release_flats() {
    for (auto& b : buckets_) b.flat = torch::Tensor();
  }
  /// Parameter indices of each bucket, in the order they fill it.
  std::vector<std::vector<std::size_t>> bucket_layout() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) out.push_back(b.members);
    return out;
  }

  /// Before backward: `sync` arms the hooks (the micro-batch that steps); otherwise gradients only accumulate.
  void prepare(bool sync) {
    adopt();
    armed_ = sync;
    if (!armed_) return;
    next_launch_ = 0;
    for (auto& b : buckets_) {
      if (!b.flat.defined()) b.flat = torch::zeros({b.numel}, params_[b.members.front()].options().requires_grad(false));
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

  /// After backward: finishes every bucket and writes the averaged gradients into `.grad`.
  void finish() {
    if (!armed_) return;
    armed_ = false;
    for (auto& b : buckets_) {
      if (b.ready) continue;
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        if (b.arrived[k] || !b.taking_part[k]) continue;
        const torch::Tensor& g = params_[b.members[k]].grad();
        torch::Tensor slot = b.flat.narrow(0, b.offsets[k], params_[b.members[k]].numel());
        if (g.defined()) {
          slot.copy_(g.reshape(-1));
          slot.div_(world_size_);
        } else {
          slot.zero_();
        }
      }
      b.ready = true;
    }
    launch_ready();
    for (auto& b : buckets_) {
      if (!b.active) continue;
      b.work.wait();
      if (sync_ == GradSync::reduce_scatter) {  // the averages are in the blocks; the local sums are spent
        for (std::size_t k = 0; k < b.members.size(); ++k) {
          if (b.taking_part[k]) params_[b.members[k]].mutable_grad() = torch::Tensor();
        }
        continue;
      }
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
  /// Hooks the parameters that require gradients and have none yet; lays the buckets out again when there were any.
  void adopt() {
    bool adopted = false;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (hooks_[i] >= 0 || !params_[i].requires_grad()) continue;
      hooks_[i] = static_cast<int>(params_[i].register_hook([this, i](const torch::Tensor& grad) { on_grad(i, grad); }));
      adopted = true;
    }
    if (!adopted) return;
    if (sync_ == GradSync::reduce_scatter && !buckets_.empty()) {
      throw ConfigError("volt: a parameter started to require gradients during a sharded (ZeRO) fit; the shards are "
                        "laid out once, at the fit's start: unfreeze it before fit, or use DDP.");
    }
    build_buckets(first_cap_, cap_);
  }

  void build_buckets(std::size_t first_cap, std::size_t cap) {
    buckets_.clear();
    offset_ = 0;
    bucket_of_.assign(params_.size(), 0);
    slot_of_.assign(params_.size(), 0);
    Bucket* open = nullptr;
    std::size_t open_bytes = 0;
    for (std::size_t j = params_.size(); j-- > 0;) {
      const torch::Tensor& p = params_[j];
      if (hooks_[j] < 0) continue;
      if (p.is_sparse()) throw std::invalid_argument("volt: DDP does not average sparse gradients.");
      const std::size_t bytes = static_cast<std::size_t>(p.numel()) * p.element_size();
      const std::size_t limit = buckets_.size() == 1 ? first_cap : cap;  // the open bucket is the first one
      const bool fits = open != nullptr && open->flat.scalar_type() == p.scalar_type() &&
                        open->flat.device() == p.device() && open_bytes + bytes <= limit;
      if (!fits) {
        if (open != nullptr) close_bucket(*open);
        buckets_.push_back(Bucket{});
        open = &buckets_.back();
        open->flat = torch::empty({0}, p.options().requires_grad(false));
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

  /// The open bucket's buffer, once its members are known (padded for a reduce-scatter).
  void close_bucket(Bucket& b) {
    b.numel = sync_ == GradSync::reduce_scatter ? (offset_ + world_size_ - 1) / world_size_ * world_size_ : offset_;
    b.flat = torch::zeros({b.numel}, b.flat.options());
  }

  void on_grad(std::size_t i, const torch::Tensor& grad) {
    if (!armed_) return;
    Bucket& b = buckets_[bucket_of_[i]];
    const std::size_t k = slot_of_[i];
    // A parameter frozen after the forward that used it still has its hook called (autograd then adds nothing to
    // its .grad): it is not counted, so the bucket waits for the gradients it did count.
    if (b.arrived[k] || !b.taking_part[k]) return;
    torch::NoGradGuard no_grad;
    torch::Tensor slot = b.flat.narrow(0, b.offsets[k], grad.numel());
    const torch::Tensor& accumulated = params_[i].grad();
    if (accumulated.defined()) {
      torch::add_out(slot, accumulated.reshape(-1), grad.reshape(-1));
    } else {
      slot.copy_(grad.reshape(-1));
    }
    slot.div_(world_size_);
    b.arrived[k] = 1;
    if (--b.pending == 0) {
      b.ready = true;
      launch_ready();
    }
  }

  /// Starts every ready bucket whose predecessors have started: the same order on every rank.
  void launch_ready() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) {
      Bucket& b = buckets_[next_launch_++];
      if (!b.active) continue;
      b.work = sync_ == GradSync::all_reduce ? backend_->iall_reduce_(b.flat, Reduce::sum)
                                             : backend_->ireduce_scatter_(b.flat, Reduce::sum);
    }
  }

  std::vector<torch::Tensor> params_;
  Backend* backend_;
  int world_size_;
  std::size_t first_cap_, cap_;
  GradSync sync_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_, slot_of_;
  std::vector<int> hooks_;
  int64_t offset_ = 0;
  std::size_t next_launch_ = 0;
  bool armed_ = false;
};

}  // namespace volt::detail
