#pragma once
/// \file
/// `volt::data::SampleLoader<Dataset>`: a `StatefulLoader` over a data set read one sample at a time, the shape of
/// data on disk (one file per sample, records in a few files) and of per-sample augmentation. The data set gives
///
/// | member | meaning |
/// |---|---|
/// | `int64_t size() const` | samples in it |
/// | `Sample get(int64_t index, at::Generator& gen) const`, or `Sample get(int64_t index) const` | sample `index`, read and decoded; random augmentation draws from `gen` only |
/// | `Batch collate(std::vector<Sample>&&) const` (optional) | the batch of samples; by default tensors are stacked, and `Example`s field by field |
/// | `bool draws_random() const` (optional) | false: this `get` leaves its generator alone, which is then not seeded (an undefined `at::Generator` is passed; seeding costs about a microsecond a sample) |
///
/// `gen` is seeded by (loader seed, epoch, index) (data/fetch.hpp), so the augmented batches are the same for any
/// `num_workers`, on any number of ranks and after a resume. `get` is `const` and runs on several worker threads at
/// once: read, decode and transform without touching shared state. Between samples a worker checks whether its
/// batch is still wanted, so stopping a pass waits for at most one sample's read per worker.
/// \code
///   struct Noisy {
///     torch::Tensor x;
///     int64_t size() const { return x.size(0); }
///     torch::Tensor get(int64_t i, at::Generator& gen) const { return x[i] + 0.1 * torch::randn(x[i].sizes(), gen); }
///   };
///   volt::data::SampleLoader train(Noisy{x}, {.batch_size = 64, .shuffle = true, .num_workers = 2});
/// \endcode

#include "volt/data/stateful.hpp"

#include <ATen/core/Generator.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt::data {

namespace detail {
template <class D>
auto read_sample(const D& d, int64_t index, at::Generator& gen) {
  if constexpr (requires { d.get(index, gen); }) {
    return d.get(index, gen);
  } else {
    static_assert(requires { d.get(index); },
                  "volt: a SampleLoader's data set needs `Sample get(int64_t index, at::Generator& gen) const` (or "
                  "`get(int64_t index) const`) and `int64_t size() const`.");
    return d.get(index);
  }
}

/// Checks that the tensors of one field of a batch have one shape before they are stacked; otherwise says which
/// sample differs, by `name(i)` (its data set index, and its file where the data set names one).
template <class Name>
void check_stackable(const std::vector<torch::Tensor>& tensors, const char* field, Name&& name) {
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].sizes() == tensors[0].sizes()) continue;
    std::ostringstream s;
    s << "volt: SampleLoader cannot stack a batch: the " << field << " of " << name(i) << " is " << tensors[i].sizes()
      << " where that of " << name(0) << ", the batch's first, is " << tensors[0].sizes()
      << ". Give every sample one shape (resize or crop in the data set's transform), or give the data set a "
         "collate(std::vector<Sample>&&) const of its own.";
    throw std::invalid_argument(s.str());
  }
}

/// Stacks tensors, and `Example`s field by field; `name(i)` names the batch's i-th sample in an error.
template <class Sample, class Name>
auto stack_samples(std::vector<Sample>&& samples, Name&& name) {
  if constexpr (std::is_same_v<Sample, torch::Tensor>) {
    check_stackable(samples, "tensor", name);
    return torch::stack(samples);
  } else if constexpr (std::is_same_v<Sample, torch::data::Example<>>) {
    std::vector<torch::Tensor> data, target;
    data.reserve(samples.size());
    target.reserve(samples.size());
    for (auto& s : samples) {
      data.push_back(std::move(s.data));
      target.push_back(std::move(s.target));
    }
    check_stackable(data, "data", name);
    check_stackable(target, "target", name);
    return torch::data::Example<>{torch::stack(data), torch::stack(target)};
  } else {
    static_assert(std::is_same_v<Sample, torch::Tensor>,
                  "volt: SampleLoader stacks samples that are torch::Tensor or torch::data::Example<>; give the data "
                  "set a `collate(std::vector<Sample>&&) const` for other sample types.");
    return samples;
  }
}
}  // namespace detail

template <class Dataset>
class SampleLoader : public StatefulLoader<SampleLoader<Dataset>> {
 public:
  using Options = LoaderOptions;
  using dataset_type = Dataset;

  SampleLoader(Dataset dataset, Options options)
      : StatefulLoader<SampleLoader<Dataset>>(options), dataset_(std::make_shared<const Dataset>(std::move(dataset))) {
    size_ = static_cast<int64_t>(dataset_->size());
  }

  int64_t num_items() const { return size_; }
  /// The batch of samples `idx`, each read with its own generator; stops between samples when asked.
  auto fetch(const torch::Tensor& idx, const FetchContext& ctx) const {
    const torch::Tensor contiguous = idx.to(torch::kLong).contiguous();
    const int64_t* p = contiguous.data_ptr<int64_t>();
    using Sample = decltype(read_one(int64_t{}, ctx));
    std::vector<Sample> samples;
    samples.reserve(static_cast<std::size_t>(contiguous.numel()));
    for (int64_t i = 0; i < contiguous.numel(); ++i) {
      ctx.check_stop();
      samples.push_back(read_one(p[i], ctx));
    }
    if constexpr (requires { dataset_->collate(std::move(samples)); }) {
      return dataset_->collate(std::move(samples));
    } else {
      return detail::stack_samples(std::move(samples), [&](std::size_t i) {
        std::string n = "sample " + std::to_string(p[i]);
        if constexpr (requires { dataset_->path(int64_t{}); }) n += " (" + std::string(dataset_->path(p[i])) + ")";
        return n;
      });
    }
  }
  const Dataset& dataset() const { return *dataset_; }

 private:
  auto read_one(int64_t index, const FetchContext& ctx) const {
    at::Generator gen;
    if constexpr (requires { dataset_->draws_random(); }) {
      if (dataset_->draws_random()) gen = ctx.generator(index);
    } else {
      gen = ctx.generator(index);
    }
    return detail::read_sample(*dataset_, index, gen);
  }

  std::shared_ptr<const Dataset> dataset_;
  int64_t size_ = 0;
};

}  // namespace volt::data
