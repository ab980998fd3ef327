#pragma once
/// \file
/// The sharded strategy's layout (volt/strategies/zero.hpp): the module's parameters copied into the gradient
/// reducer's buckets, each a flat buffer padded to a multiple of the world size W, every parameter a view into its
/// bucket; rank r owns block r of every bucket, and its pieces are the parts of parameters inside its blocks.

#include "volt/comm/concept.hpp"
#include "volt/errors.hpp"

#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
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
  /// Copies every bucket's parameters into one flat buffer and makes each parameter a view into it.
  template <class Bucket>
  ShardLayout(const std::vector<Bucket>& buckets, const std::vector<at::Tensor>& params, int rank, int world)
      : rank_(rank), world_(world), locations_(params.size()) {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      const Bucket& b = buckets[i];
      at::Tensor flat = torch::zeros({b.numel}, params[b.members.front()].options().requires_grad(false));
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        at::Tensor p = params[b.members[k]];
        at::Tensor view = flat.narrow(0, b.offsets[k], p.numel());
        view.copy_(p.detach().reshape(-1));
        p.set_data(view.view(p.sizes()));
        locations_[b.members[k]] = Location{i, b.offsets[k], true};
        add_piece(i, k, b.members[k], b.offsets[k], p.numel(), flat, Blocks{b.numel, world});
      }
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
      const auto* want = static_cast<const char*>(flat.data_ptr()) + where.offset * flat.element_size();
      if (params[j].data_ptr() != want) {
        throw ConfigError("volt: parameter " + std::to_string(j) + " was moved, cast or replaced during a ZeRO fit "
                          "(module.to(), set_data): ZeRO lays the parameters out at the fit's start and steps them "
                          "there; place and cast the module before fit.");
      }
    }
  }
  /// Where parameter `param` lies: its bucket and offset, if it was laid out (it required gradients at the fit's start).
  struct Location {
    std::size_t bucket = 0;
    int64_t offset = 0;
    bool laid_out = false;
  };
  const Location& location(std::size_t param) const { return locations_[param]; }

 private:
  void add_piece(std::size_t bucket, std::size_t slot, std::size_t param, int64_t offset, int64_t numel,
                 const at::Tensor& flat, const Blocks& blocks) {
    const int64_t lo = std::max(offset, blocks.start(rank_)), hi = std::min(offset + numel, blocks.end(rank_));
    if (lo >= hi) return;
    piece_index_[param] = pieces_.size();
    pieces_.push_back(ShardPiece{param, bucket, slot, lo - offset, lo, hi - lo, alias(flat, lo, hi - lo)});
  }

  int rank_, world_;
  std::vector<Location> locations_;
  std::vector<at::Tensor> flats_;
  std::vector<ShardPiece> pieces_;
  std::unordered_map<std::size_t, std::size_t> piece_index_;
};

}  // namespace detail

}  // namespace volt
