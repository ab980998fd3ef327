#pragma once

#include "volt/data/stateful.hpp"

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace volt::data {

/// Batches of in-memory tensors: `data[i]` and `targets[i]` form sample i. A `StatefulLoader` (see
/// data/stateful.hpp): shuffles with its own generator seeded by `seed + epoch`, so the order of an epoch
/// depends on nothing but those two numbers; shards like PyTorch's DistributedSampler; records its position
/// for checkpoints. Contiguous batches without shuffling are views (no copy); other batches gather with
/// index_select.
class TensorLoader : public StatefulLoader<TensorLoader> {
 public:
  using Options = LoaderOptions;

  TensorLoader(torch::Tensor data, torch::Tensor targets, Options options)
      : StatefulLoader(options), data_(std::move(data)), targets_(std::move(targets)) {
    if (!data_.defined() || data_.dim() == 0) {
      throw std::invalid_argument("volt: TensorLoader needs data with a first (sample) dimension.");
    }
    if (targets_.defined() && targets_.size(0) != data_.size(0)) {
      throw std::invalid_argument("volt: TensorLoader got " + std::to_string(data_.size(0)) + " samples of data but " +
                                  std::to_string(targets_.size(0)) + " targets; they must match.");
    }
  }

  int64_t num_items() const { return data_.size(0); }
  torch::data::Example<> fetch(const torch::Tensor& idx) const {
    return {data_.index_select(0, idx), targets_.defined() ? targets_.index_select(0, idx) : torch::Tensor()};
  }
  torch::data::Example<> fetch_range(int64_t start, int64_t length) const {
    return {data_.narrow(0, start, length), targets_.defined() ? targets_.narrow(0, start, length) : torch::Tensor()};
  }

 private:
  torch::Tensor data_, targets_;
};

}  // namespace volt::data
