#pragma once
/// \file
/// `predict` across ranks: each rank predicts the one-process batches dealt to it (data::Split::whole_batches),
/// and the results are gathered on every rank in the loader's order: batch k of one process is rank k % W's
/// result k / W. Every rank gets them all (not rank zero alone) because every rank runs the program after
/// `predict` returns, and code that reads the results should not have to ask which rank it is on; results too
/// large to hold W times are for a callback's `on_predict_batch_end` to write as they come.
///
/// A result crosses processes as LibTorch pickles it (`torch::pickle_save`): a tensor, or anything `c10::IValue`
/// holds (tuples, vectors and dicts of tensors, numbers, strings). Gathered tensors are on the CPU (results volt
/// cannot look inside, see volt/batch.hpp, are pickled as they are: keep their tensors on the CPU).
///
/// With `limit_predict_batches` = L, each rank predicts its first L dealt batches: the first L * W batches of the
/// one-process order (fewer where the loader ends first).

#include "volt/batch.hpp"
#include "volt/context.hpp"
#include "volt/data/concept.hpp"
#include "volt/errors.hpp"

#include <ATen/core/ivalue.h>
#include <c10/util/Type.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize.h>

#include <concepts>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace volt::detail {

/// A predict result that can cross processes (see the file comment).
template <class R>
concept GatherableResult = requires(const R& r, const c10::IValue& v) {
  c10::IValue(r);
  v.to<R>();
};

/// Whether predict's results on `world_size` ranks are gathered: each rank predicted the batches dealt to it
/// (data::Split::whole_batches). Throws a ConfigError, before anything runs, where they cannot cross processes.
template <class R, class L>
bool predict_gathers(const L& processed, int world_size) {
  bool gathers = false;
  if constexpr (data::SplittableLoader<L>) gathers = world_size > 1 && processed.split() == data::Split::whole_batches;
  if (gathers && !GatherableResult<R>) {
    throw ConfigError("volt: predict on " + std::to_string(world_size) + " ranks gathers every rank's results, and "
                      "predict_step's result type (" + c10::demangle(typeid(R).name()) + ") cannot cross processes: "
                      "return a torch::Tensor, or a tuple, vector or dict of them, or pass return_predictions = false "
                      "and write them with a callback.");
  }
  return gathers;
}

/// The world ranks whose batches are every batch once: those a strategy of `role::shares_batches` (volt/context.hpp)
/// names; under any other, every rank.
template <class S>
std::vector<int> data_line(const S& strategy) {
  if constexpr (declares_role<S, role::shares_batches>) {
    return strategy.data_line();
  } else {
    std::vector<int> all(static_cast<std::size_t>(strategy.world_size()));
    for (std::size_t r = 0; r < all.size(); ++r) all[r] = static_cast<int>(r);
    return all;
  }
}

/// Every rank's `mine` (the results of the batches dealt to it), in the one-process batch order, on every rank: the
/// results of the data line's ranks (`data_line`), interleaved.
template <class R, class S>
std::vector<R> gather_dealt_results(std::vector<R>&& mine, S& strategy) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (R& r : mine) {
    if constexpr (MappableBatch<R>) {
      list.push_back(c10::IValue(map_tensors(r, [](const torch::Tensor& t) { return t.cpu(); })));
    } else {
      list.push_back(c10::IValue(std::move(r)));
    }
  }
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(list));
  const std::vector<std::string> all = strategy.host_all_gather(std::string(bytes.begin(), bytes.end()));
  std::vector<c10::impl::GenericList> per_rank;
  std::size_t total = 0;
  for (const int r : data_line(strategy)) {
    const std::string& b = all.at(static_cast<std::size_t>(r));
    per_rank.push_back(torch::pickle_load(std::vector<char>(b.begin(), b.end())).toList());
    total += per_rank.back().size();
  }
  const std::size_t world = per_rank.size();
  if (world == 0) throw std::logic_error("volt: predict's gather returned no rank's results.");
  std::vector<R> out;
  out.reserve(total);
  for (std::size_t k = 0; k < total; ++k) {
    const c10::impl::GenericList& from = per_rank[k % world];
    if (k / world >= from.size()) {
      throw std::logic_error("volt: predict's gathered results do not interleave: rank " + std::to_string(k % world) +
                             " has " + std::to_string(from.size()) + " batches, batch " + std::to_string(k) +
                             " of " + std::to_string(total) + " is missing.");
    }
    out.push_back(from.get(k / world).to<R>());
  }
  return out;
}

}  // namespace volt::detail
