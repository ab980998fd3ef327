#pragma once
/// \file
/// The sharded strategy's layout (volt/strategies/zero.hpp): the module's parameters copied into the gradient
/// reducer's buckets, each a flat buffer padded to a multiple of the world size W, every parameter a view into its
/// bucket; rank r owns block r of every bucket, and its pieces are the parts of parameters inside its blocks.

#include "volt/comm/concept.hpp"
#include "volt/errors.hpp"
#include "volt/strategies/buffer_pool.hpp"

#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace volt {

namespace detail {

/// `numel` elements of the flat tensor `flat` from `offset`, as a tensor of its own sharing the storage (not an
/// autograd view: LibTorch 1.x's zero_grad detaches gradients in place, which views refuse).
inline at::Tensor alias(const at::Tensor& flat, int64_t offset, int64_t numel) {
  torch::NoGradGuard no_grad;
  return torch::empty({0}, flat.options()).set_(flat.storage(), flat.storage_offset() + offset, {numel}, {1});
}

/// `t`'s storage given `nbytes` bytes (0: freed), in place: every tensor that shares it (views, the parameters laid
/// out in it, autograd's saved tensors) sees the new bytes, as FSDP2 frees and remakes its unsharded parameters.
inline void resize_storage(const at::Tensor& t, std::size_t nbytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == nbytes) return;
  at::DataPtr data = nbytes == 0 ? at::DataPtr(nullptr, t.device()) : storage->allocator()->allocate(nbytes);
  storage->set_data_ptr_noswap(std::move(data));
  storage->set_nbytes(nbytes);
}

/// The elements of one parameter that fall in this rank's block of its bucket: what the sharded optimizer steps.
struct ShardPiece {
  std::size_t param = 0;       // index among the module's parameters
  std::size_t bucket = 0;      // the reducer's bucket
  std::size_t slot = 0;        // the parameter's place in that bucket
  int64_t param_offset = 0;    // its first element within the flattened parameter
  int64_t bucket_offset = 0;   // and within the bucket
  int64_t numel = 0;
  at::Tensor tensor;           // shares the bucket's parameter buffer
};

/// The module's parameters laid out in the reducer's buckets, and this rank's pieces of them.
class ShardLayout {
 public:
  /// Copies every bucket's parameters into one flat buffer and makes each parameter a view into it. With a `pool`
  /// (stage 3; it must outlive the layout): this rank's block of each bucket is copied into a shard of its own, which
  /// the pieces share, and the bucket holds no storage until it is gathered (`fill`, with memory from the pool; `free`
  /// gives it back): laying out never holds the parameters twice. The bucket (and so the parameters) may then be of
  /// another dtype than the shards (`gathered`: the dtype the forward computes in), filled by casting them.
  template <class Bucket>
  ShardLayout(const std::vector<Bucket>& buckets, const std::vector<at::Tensor>& params, int rank, int world,
              BufferPool* pool = nullptr, std::optional<torch::Dtype> gathered = std::nullopt)
      : rank_(rank), world_(world), locations_(params.size()), pool_(pool) {
    const bool apart = pool != nullptr;
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      const Bucket& b = buckets[i];
      const at::TensorOptions options = params[b.members.front()].options().requires_grad(false);
      const Blocks blocks{b.numel, world};
      at::Tensor flat;
      if (apart) {  // this rank's block copied straight into its shard; the bucket made without touching its memory
        at::Tensor shard = torch::zeros({blocks.size()}, options);
        for (std::size_t k = 0; k < b.members.size(); ++k) {
          const at::Tensor p = params[b.members[k]].detach().reshape(-1);
          const int64_t lo = std::max(b.offsets[k], blocks.start(rank));
          const int64_t hi = std::min(b.offsets[k] + p.numel(), blocks.end(rank));
          if (lo < hi) shard.narrow(0, lo - blocks.start(rank), hi - lo).copy_(p.narrow(0, lo - b.offsets[k], hi - lo));
        }
        shards_.push_back(std::move(shard));
        flat = torch::empty({b.numel}, options.dtype(gathered.value_or(options.dtype().toScalarType())));
      } else {
        flat = torch::zeros({b.numel}, options);
        for (std::size_t k = 0; k < b.members.size(); ++k) {
          flat.narrow(0, b.offsets[k], params[b.members[k]].numel()).copy_(params[b.members[k]].detach().reshape(-1));
        }
      }
      const at::Tensor& base = apart ? shards_.back() : flat;
      const int64_t base_start = apart ? blocks.start(rank) : 0;
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        add_piece(i, k, b.members[k], b.offsets[k], params[b.members[k]].numel(), base, base_start, blocks);
      }
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        at::Tensor p = params[b.members[k]];
        p.set_data(flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes()));
        locations_[b.members[k]] = Location{i, b.offsets[k], true};
      }
      if (apart) resize_storage(flat, 0);  // (its memory never touched) gathered where used: fill
      flats_.push_back(std::move(flat));
    }
  }

  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  /// Every bucket's parameters, flat (padded).
  const std::vector<at::Tensor>& flats() const { return flats_; }
  /// This rank's piece of parameter `param`, or null.
  const ShardPiece* piece_of(std::size_t param) const {
    const auto it = piece_index_.find(param);
    return it == piece_index_.end() ? nullptr : &pieces_[it->second];
  }
  int64_t block_start(std::size_t bucket) const { return Blocks{flats_[bucket].numel(), world_}.start(rank_); }
  /// Throws unless every laid-out parameter still lives in its bucket (a `module.to()` or `set_data` during the fit
  /// would have moved it out, and the optimizer's pieces would step a copy no forward reads).
  void check_aliasing(const std::vector<at::Tensor>& params) const {
    for (std::size_t j = 0; j < params.size(); ++j) {
      const Location& where = locations_[j];
      if (!where.laid_out) continue;
      const at::Tensor& flat = flats_[where.bucket];
      if (!params[j].defined() || !params[j].has_storage() ||
          params[j].storage().unsafeGetStorageImpl() != flat.storage().unsafeGetStorageImpl() ||
          params[j].storage_offset() != flat.storage_offset() + where.offset) {
        throw ConfigError("volt: parameter " + std::to_string(j) + " was moved, cast or replaced during a ZeRO fit "
                          "(module.to(), set_data): ZeRO lays the parameters out at the fit's start and steps them "
                          "there; place and cast the module before fit.");
      }
    }
  }
  /// Stage 3: this rank's block of every bucket, which the pieces share.
  const std::vector<at::Tensor>& shards() const { return shards_; }
  /// Stage 3: whether bucket `bucket` holds its storage (gathered, or being gathered).
  bool holds(std::size_t bucket) const { return flats_[bucket].storage().nbytes() > 0; }
  /// Stage 3: bucket `bucket`'s storage freed; the parameters and autograd's saved views of them keep pointing at it.
  void free(std::size_t bucket) { pool_->release(*flats_[bucket].storage().unsafeGetStorageImpl()); }
  /// Stage 3: bucket `bucket`'s storage made again and this rank's shard put in its block, cast to the bucket's dtype
  /// (an in-place all-gather of the bucket then fills the rest).
  void fill(std::size_t bucket) {
    const at::Tensor& flat = flats_[bucket];
    pool_->fill(*flat.storage().unsafeGetStorageImpl(), static_cast<std::size_t>(flat.numel()) * flat.element_size());
    torch::NoGradGuard no_grad;
    block_of(flat, rank_, world_).copy_(shards_[bucket]);
  }
  /// The dtype and device of the pieces of bucket `bucket` (stage 3: its shard's, which may differ from the bucket's).
  at::TensorOptions piece_options(std::size_t bucket) const {
    return (bucket < shards_.size() && shards_[bucket].defined() ? shards_[bucket] : flats_[bucket]).options();
  }
  /// Stage 3: bucket `bucket` whole again for good (`whole`: every rank's shard, in the shards' dtype): the parameters
  /// laid out in it (of `params`) and this rank's pieces become views of it, and the shard is dropped.
  void make_whole(std::size_t bucket, const at::Tensor& whole, const std::vector<at::Tensor>& params) {
    torch::NoGradGuard no_grad;
    for (std::size_t j = 0; j < params.size(); ++j) {
      const Location& where = locations_[j];
      if (!where.laid_out || where.bucket != bucket) continue;
      at::Tensor p = params[j];
      p.set_data(whole.narrow(0, where.offset, p.numel()).view(p.sizes()));
    }
    for (ShardPiece& piece : pieces_) {
      if (piece.bucket != bucket) continue;
      piece.tensor.set_(whole.storage(), whole.storage_offset() + piece.bucket_offset, {piece.numel}, {1});
    }
    flats_[bucket] = whole;
    if (bucket < shards_.size()) shards_[bucket] = at::Tensor();
    if (pool_ != nullptr) pool_->clear();  // nothing is gathered again
  }
  /// Where parameter `param` lies: its bucket and offset, if it was laid out (it required gradients at the fit's start).
  struct Location {
    std::size_t bucket = 0;
    int64_t offset = 0;
    bool laid_out = false;
  };
  const Location& location(std::size_t param) const { return locations_[param]; }

 private:
  /// The piece of parameter `param` (at `offset` in bucket `bucket`) in this rank's block, if any, sharing `base`,
  /// which holds the bucket's elements from `base_start` on.
  void add_piece(std::size_t bucket, std::size_t slot, std::size_t param, int64_t offset, int64_t numel,
                 const at::Tensor& base, int64_t base_start, const Blocks& blocks) {
    const int64_t lo = std::max(offset, blocks.start(rank_)), hi = std::min(offset + numel, blocks.end(rank_));
    if (lo >= hi) return;
    piece_index_[param] = pieces_.size();
    pieces_.push_back(ShardPiece{param, bucket, slot, lo - offset, lo, hi - lo, alias(base, lo - base_start, hi - lo)});
  }

  int rank_, world_;
  std::vector<Location> locations_;
  std::vector<at::Tensor> flats_;
  std::vector<at::Tensor> shards_;  // stage 3
  BufferPool* pool_ = nullptr;      // stage 3: where the gathered buckets' memory comes from and goes back to
  std::vector<ShardPiece> pieces_;
  std::unordered_map<std::size_t, std::size_t> piece_index_;
};

}  // namespace detail

}  // namespace volt
