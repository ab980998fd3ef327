#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>

namespace volt::data {

/// Batches of in-memory tensors: `data[i]` and `targets[i]` form sample i. Knows its size, so every batch
/// limit works with it, and shuffles with its own generator seeded by `seed + epoch`, so the order of an
/// epoch depends on nothing but those two numbers (the Trainer calls `set_epoch` before each epoch).
/// Contiguous batches without shuffling are views (no copy); shuffled batches gather with index_select.
///
/// `shard(rank, world_size)` gives the loader one rank of a distributed run iterates, as PyTorch's
/// DistributedSampler: the epoch's order (the same permutation on every rank) is padded with its first
/// samples to a multiple of world_size (unless drop_last, which trims it instead), and rank r takes
/// positions r, r + world_size, ... So every sample is seen once per epoch across ranks (padding repeats
/// at most world_size - 1), and every rank has the same number of batches.
class TensorLoader {
 public:
  struct Options {
    int64_t batch_size = 32;
    bool shuffle = false;
    bool drop_last = false;
    uint64_t seed = 0;
  };

  TensorLoader(torch::Tensor data, torch::Tensor targets, Options options)
      : data_(std::move(data)), targets_(std::move(targets)), options_(options) {
    if (options_.batch_size < 1) {
      throw std::invalid_argument("volt: TensorLoader batch_size=" + std::to_string(options_.batch_size) +
                                  " is not allowed: give a number >= 1.");
    }
    if (!data_.defined() || data_.dim() == 0) {
      throw std::invalid_argument("volt: TensorLoader needs data with a first (sample) dimension.");
    }
    if (targets_.defined() && targets_.size(0) != data_.size(0)) {
      throw std::invalid_argument("volt: TensorLoader got " + std::to_string(data_.size(0)) + " samples of data but " +
                                  std::to_string(targets_.size(0)) + " targets; they must match.");
    }
  }

  /// The loader rank `rank` of `world_size` iterates (see above).
  TensorLoader shard(int rank, int world_size) const {
    if (world_size < 1 || rank < 0 || rank >= world_size) {
      throw std::invalid_argument("volt: TensorLoader::shard(rank=" + std::to_string(rank) + ", world_size=" +
                                  std::to_string(world_size) + ") needs 0 <= rank < world_size.");
    }
    TensorLoader out = *this;
    out.rank_ = rank;
    out.world_size_ = world_size;
    return out;
  }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  /// Samples in the whole data set.
  int64_t dataset_size() const { return data_.size(0); }
  /// Samples this loader yields per epoch (its shard's).
  int64_t num_samples() const {
    const int64_t n = dataset_size();
    if (world_size_ == 1) return n;
    return options_.drop_last ? n / world_size_ : (n + world_size_ - 1) / world_size_;
  }
  /// Batches per epoch.
  int64_t size() const {
    const int64_t n = num_samples();
    return options_.drop_last ? n / options_.batch_size : (n + options_.batch_size - 1) / options_.batch_size;
  }
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  const Options& options() const { return options_; }

  /// The sample indices this loader yields in the current epoch, in order.
  torch::Tensor order() const {
    torch::Tensor global;
    if (options_.shuffle) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed + static_cast<uint64_t>(epoch_));
      global = torch::randperm(dataset_size(), gen, torch::TensorOptions().dtype(torch::kLong));
    } else {
      global = torch::arange(dataset_size(), torch::kLong);
    }
    if (world_size_ == 1) return global;
    const int64_t total = num_samples() * world_size_;
    if (total > dataset_size()) {  // pad with the order's first samples (repeating it if needed)
      const int64_t reps = (total + dataset_size() - 1) / dataset_size();
      global = global.repeat({reps});
    }
    return global.narrow(0, 0, total).slice(0, rank_, total, world_size_).contiguous();
  }

  class iterator {
   public:
    using value_type = torch::data::Example<>;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    iterator(const TensorLoader* loader, int64_t batch, torch::Tensor order)
        : loader_(loader), batch_(batch), order_(std::move(order)) {}
    value_type operator*() const { return loader_->batch(batch_, order_); }
    iterator& operator++() {
      ++batch_;
      return *this;
    }
    bool operator==(const iterator& other) const { return batch_ == other.batch_; }

   private:
    const TensorLoader* loader_ = nullptr;
    int64_t batch_ = 0;
    torch::Tensor order_;
  };

  iterator begin() const { return iterator(this, 0, options_.shuffle || world_size_ > 1 ? order() : torch::Tensor()); }
  iterator end() const { return iterator(this, size(), {}); }

 private:
  torch::data::Example<> batch(int64_t b, const torch::Tensor& order) const {
    const int64_t start = b * options_.batch_size;
    const int64_t len = std::min(options_.batch_size, num_samples() - start);
    if (!order.defined()) {
      return {data_.narrow(0, start, len), targets_.defined() ? targets_.narrow(0, start, len) : torch::Tensor()};
    }
    const torch::Tensor idx = order.narrow(0, start, len);
    return {data_.index_select(0, idx), targets_.defined() ? targets_.index_select(0, idx) : torch::Tensor()};
  }

  torch::Tensor data_, targets_;
  Options options_;
  int64_t epoch_ = 0;
  int rank_ = 0;
  int world_size_ = 1;
};

}  // namespace volt::data
