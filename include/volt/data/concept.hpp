#pragma once
/// \file
/// The Loader kind: what the Trainer asks of the loaders it is given. Anything with `begin()` and `end()` that
/// yields batches is a loader (a torch::data loader, a `std::vector` of batches, volt::data's loaders), or a
/// pointer to one (the `std::unique_ptr` that `torch::data::make_data_loader` returns). Each further member is
/// optional and adds a capability:
///
/// | member | capability | used for |
/// |---|---|---|
/// | `size() -> integer` | `SizedLoader` | fractions in `limit_*_batches` and `val_check_interval`; knowing the last batch without reading ahead |
/// | `shard(int rank, int world_size) -> loader` | `ShardableLoader` | DDP gives each rank its training share (volt::data's loaders: one permutation, padded as DistributedSampler) |
/// | `shard(int rank, int world_size, Split) -> loader` | `SplittableLoader` | evaluation and prediction under DDP: `Split::whole_batches` deals the one-process batches out in turn, no sample twice (predict's results are gathered back in order) |
/// | `set_epoch(int64_t)` | | called before each training epoch (the shuffle's seed) |
/// | `state_dict() const -> LoaderState`, `check_state(const LoaderState&) const` (throws `std::invalid_argument` naming each difference), `load_state_dict(const LoaderState&)`, `batches_done() const -> integer` | `PositionedLoader` | a checkpoint records where the training loader stands, and a resumed fit starts from there, on any number of ranks |
///
/// A loader without a position is resumed by skipping the batches already trained on in that epoch.

#include "volt/data/loaders.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace volt::data {

/// Where a loader stands, with what it must match to be loaded again.
struct LoaderState {
  int64_t epoch = 0;
  /// Positions of the epoch's order consumed by the whole run; `dataset_size` once the epoch is done.
  int64_t consumed = 0;
  int64_t dataset_size = 0;
  int64_t batch_size = 0;
  uint64_t seed = 0;
  bool shuffle = false;
  bool drop_last = false;
  /// The number of ranks of the run that saved it (for messages; any number may resume it).
  int world_size = 1;

  bool operator==(const LoaderState&) const = default;
};

/// How a loader is split across the ranks of a run.
enum class Split {
  /// Training: rank r of W takes positions r, r + W, ... of the epoch's order, the order padded with its first
  /// samples (as PyTorch's DistributedSampler) so that every rank has as many batches.
  padded_samples,
  /// Evaluation and prediction: the batches one process would read, dealt out in turn (rank r takes batches
  /// r, r + W, ...); no sample twice and no padding, so ranks may differ by one batch.
  whole_batches,
};

/// Iterable for batches: `begin()` and `end()`.
template <class L>
concept Loader = requires(L& l) {
  l.begin();
  l.end();
};

/// Knows its number of batches.
template <class L>
concept SizedLoader = requires(L& l) {
  { l.size() } -> std::convertible_to<int64_t>;
};

/// Gives the part of itself that one rank of `world_size` iterates.
template <class L>
concept ShardableLoader = requires(const L& l) { l.shard(0, 1); };

/// Splits itself either way (see `Split`).
template <class L>
concept SplittableLoader = requires(const L& l) {
  l.shard(0, 1, Split::whole_batches);
  { l.split() } -> std::same_as<Split>;
};

/// Keeps its position: its next pass starts where a loaded state says.
template <class L>
concept PositionedLoader = requires(L& l, const L& cl, const LoaderState& s) {
  { cl.state_dict() } -> std::same_as<LoaderState>;
  cl.check_state(s);
  l.load_state_dict(s);
  { cl.batches_done() } -> std::convertible_to<int64_t>;
};

}  // namespace volt::data

namespace volt {
/// Passed where no loader is given (fit without validation).
struct NoLoader {};
}  // namespace volt

namespace volt::detail {

/// The loader itself, or what a pointer-like loader points to.
template <class L>
decltype(auto) deref_loader(L& loader) {
  if constexpr (data::Loader<L> || data::is_loaders_v<std::remove_cv_t<L>>) {
    return (loader);
  } else {
    static_assert(requires { (*loader).begin(); },
                  "volt: a loader must have begin() and end() yielding batches (a torch::data loader, a std::vector "
                  "of batches, volt::data::TensorLoader, ...) or point to one.");
    return (*loader);
  }
}

/// The batch type a loader (or what it points to) yields.
template <class L>
using batch_t = std::remove_cvref_t<decltype(*deref_loader(std::declval<L&>()).begin())>;
/// `batch_t<L>` as a type trait (`::type`), to name it only where it is needed.
template <class L>
struct batch_of {
  using type = batch_t<L>;
};
/// The batch types of several loaders (`data::Loaders`), in order.
template <class... B>
struct Batches {};
template <class... L>
struct batch_of<data::Loaders<L...>> {
  using type = Batches<batch_t<L>...>;
};

template <class L>
int64_t loader_size(L& loader);

/// `count(loader)` summed over several loaders (`data::Loaders`), or of a single one; -1 when one count is -1 (a
/// loader that cannot tell).
template <class L, class Count>
int64_t sum_over_loaders(L& loader, Count&& count) {
  if constexpr (data::is_loaders_v<std::remove_cv_t<L>>) {
    int64_t total = 0;
    loader.for_each([&](auto& one, std::size_t) {
      const int64_t n = count(one);
      total = total < 0 || n < 0 ? -1 : total + n;
    });
    return total;
  } else {
    return count(loader);
  }
}

/// Its number of batches, or -1 when it cannot tell (several loaders: their sum, -1 when one cannot tell).
template <class L>
int64_t loader_size(L& loader) {
  if constexpr (data::is_loaders_v<std::remove_cv_t<L>>) {
    return sum_over_loaders(loader, [](auto& one) { return loader_size(one); });
  } else if constexpr (data::SizedLoader<L>) {
    return static_cast<int64_t>(loader.size());
  } else {
    return -1;
  }
}

}  // namespace volt::detail
