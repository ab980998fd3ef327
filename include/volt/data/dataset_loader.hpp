#pragma once

#include "volt/data/stateful.hpp"

#include <torch/data/datasets/base.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <stdexcept>
#include <utility>
#include <vector>

namespace volt::data {

/// A `StatefulLoader` over any `torch::data` dataset with a size: batches come from the dataset's
/// `get_batch(indices)`, so a `Dataset<Self, Example<>>` yields `std::vector<Example<>>` and the same
/// dataset `.map(torch::data::transforms::Stack<>())` yields stacked `Example<>`s. Shuffling, sharding and
/// the position are the base's (data/stateful.hpp); shards share one dataset object. With `num_workers` > 0,
/// each worker reads from its own copy of the dataset (as `torch::data`'s own workers do), so a dataset with
/// state of its own is never used by two threads at once; a dataset that cannot be copied is shared, and its
/// `get_batch` must then be safe to call from several threads.
/// \code
///   auto ds = torch::data::datasets::MNIST(root).map(torch::data::transforms::Stack<>());
///   volt::data::DatasetLoader train(std::move(ds), {.batch_size = 64, .shuffle = true, .seed = 1});
/// \endcode
template <class Dataset>
class DatasetLoader : public StatefulLoader<DatasetLoader<Dataset>> {
 public:
  using Options = LoaderOptions;
  using dataset_type = Dataset;

  DatasetLoader(Dataset dataset, Options options)
      : StatefulLoader<DatasetLoader<Dataset>>(options), dataset_(std::make_shared<Dataset>(std::move(dataset))) {
    const auto n = dataset_->size();
    if (!n) {
      throw std::invalid_argument("volt: DatasetLoader needs a dataset whose size() is known; this one returns nullopt.");
    }
    size_ = static_cast<int64_t>(*n);
    if constexpr (std::is_copy_constructible_v<Dataset>) {
      for (int w = 0; w < options.num_workers; ++w) copies_.push_back(std::make_shared<Dataset>(*dataset_));
    }
  }

  int64_t num_items() const { return size_; }
  auto fetch(const torch::Tensor& idx, const FetchContext& ctx) const {
    const torch::Tensor contiguous = idx.to(torch::kLong).contiguous();
    const int64_t* p = contiguous.data_ptr<int64_t>();
    std::vector<std::size_t> indices(p, p + contiguous.numel());
    const bool own = ctx.worker >= 0 && static_cast<std::size_t>(ctx.worker) < copies_.size();
    return (own ? copies_[static_cast<std::size_t>(ctx.worker)] : dataset_)->get_batch(indices);
  }
  auto fetch(const torch::Tensor& idx) const { return fetch(idx, FetchContext{}); }
  Dataset& dataset() { return *dataset_; }

 private:
  std::shared_ptr<Dataset> dataset_;
  std::vector<std::shared_ptr<Dataset>> copies_;  // one per worker
  int64_t size_ = 0;
};

}  // namespace volt::data
