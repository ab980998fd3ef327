#pragma once
/// \file
/// `volt::data::StatefulLoader<Derived>`: the CRTP base of volt's loaders. It owns everything about *which*
/// samples come next — the epoch's seeded permutation, the sharding across ranks, the batching, and the
/// position — and asks the derived class only how to fetch a batch of samples by index:
///
/// | the derived class provides | meaning |
/// |---|---|
/// | `int64_t num_items() const` | samples in the data set |
/// | `Batch fetch(const torch::Tensor& indices) const`, or `Batch fetch(const torch::Tensor& indices, const FetchContext& ctx) const` | the batch of these samples (int64 indices, in order); `ctx` (data/fetch.hpp) gives per-sample generators, the worker and a stop flag |
/// | `Batch fetch_range(int64_t start, int64_t length) const` (optional) | samples start..start+length-1, used when the order is the identity (no shuffle, one rank) |
///
/// **Workers.** With `num_workers` > 0 a pass's batches are fetched ahead on that many threads, at most
/// `num_workers * prefetch_factor` batches ahead, and delivered in order (data/workers.hpp): the same batches in
/// the same order as with no workers, so `fetch` must depend on its indices (and `ctx`'s generators) only, and
/// may be called from several threads at once. The position below counts delivered batches only: batches
/// fetched ahead and not delivered are dropped and fetched again after a resume. A fetch that throws ends the
/// pass at that batch with a `LoaderError` naming the batch, the epoch and the sample indices.
///
/// **Position, in global samples.** Every rank of a run walks the same epoch order (a permutation seeded by
/// `seed + epoch`, or the identity); rank r of W takes positions r, r + W, ... So after each rank has yielded
/// k full batches of b samples, the run as a whole has consumed exactly the first k·b·W positions of the
/// epoch's order, whatever W is. `state_dict()` records that number (not a per-rank batch count), so a state
/// saved on N ranks resumes on M ranks: the rest of the epoch's order is dealt out again among M ranks and
/// every remaining sample is seen exactly once (plus, as in DistributedSampler, at most M - 1 padding
/// repeats when the rest does not divide by M; drop_last trims instead). Resuming on the same number of
/// ranks reproduces the uninterrupted run's batches exactly, padding included.
///
/// **When the position moves.** Dereferencing the iterator at batch i records "i + 1 batches yielded", so a
/// state taken while a batch is being processed (in a training step, in `on_train_batch_end`) resumes with
/// the next batch, as torchdata's StatefulDataLoader. A state taken after the last batch of an epoch resumes
/// with the next epoch. `load_state_dict` takes effect at the next `begin()`; `set_epoch(e)` with the
/// loaded epoch keeps it (the Trainer calls set_epoch before each epoch), any other epoch starts that epoch
/// from its first batch. A `begin()` with no loaded state starts the current epoch from its beginning,
/// except after a pass that reached the epoch's end, which moves on to the next epoch.
///
/// **Evaluation shards** (`shard(rank, W, Split::whole_batches)`) deal the one-process batches out in turn
/// instead; they have no position of their own (the Trainer never checkpoints an evaluation loader).
///
/// A state that does not fit the loader (another data set size, batch size, seed, shuffle or drop_last)
/// is refused with every difference named; iterating a `const` loader reads the same batches without
/// recording a position.

#include "volt/batch.hpp"
#include "volt/data/concept.hpp"
#include "volt/data/fetch.hpp"
#include "volt/data/workers.hpp"
#include "volt/errors.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace volt::data {

struct LoaderOptions {
  int64_t batch_size = 32;
  bool shuffle = false;
  /// Drop each rank's last, incomplete batch (and, across ranks, trim the epoch to a multiple of the
  /// world size instead of padding it).
  bool drop_last = false;
  uint64_t seed = 0;
  /// Threads fetching batches ahead of the training thread (0: fetched on the training thread when needed).
  int num_workers = 0;
  /// Batches in flight per worker.
  int prefetch_factor = 2;
  /// Page-locked batches (their copy to a GPU is asynchronous); ignored, with a note, where CUDA is absent.
  bool pin_memory = false;
};

namespace detail {
/// The batch type a derived loader's fetch returns.
template <class D>
auto fetched(const D& d, const torch::Tensor& idx, const FetchContext& ctx) {
  if constexpr (requires { d.fetch(idx, ctx); }) {
    return d.fetch(idx, ctx);
  } else {
    return d.fetch(idx);
  }
}
template <class D>
using fetched_t = decltype(fetched(std::declval<const D&>(), std::declval<const torch::Tensor&>(),
                                   std::declval<const FetchContext&>()));

/// "12, 40, 7" (the first `max` of them, then how many more).
inline std::string describe_indices(const torch::Tensor& idx, int64_t max = 8) {
  std::ostringstream o;
  const int64_t n = idx.numel();
  for (int64_t i = 0; i < std::min(n, max); ++i) o << (i ? ", " : "") << idx[i].item<int64_t>();
  if (n > max) o << " and " << (n - max) << " more";
  return o.str();
}
}  // namespace detail

template <class Derived>
class StatefulLoader {
 public:
  using Options = LoaderOptions;

  explicit StatefulLoader(Options options) : options_(options) {
    auto check = [](const char* name, int64_t value, int64_t least) {
      if (value < least) {
        throw std::invalid_argument("volt: loader " + std::string(name) + "=" + std::to_string(value) +
                                    " is not allowed: give a number >= " + std::to_string(least) + ".");
      }
    };
    check("batch_size", options_.batch_size, 1);
    check("num_workers", options_.num_workers, 0);
    check("prefetch_factor", options_.prefetch_factor, 1);
  }

  /// The loader rank `rank` of `world_size` iterates (see `Split`; training uses `padded_samples`).
  Derived shard(int rank, int world_size, Split split = Split::padded_samples) const {
    if (world_size < 1 || rank < 0 || rank >= world_size) {
      throw std::invalid_argument("volt: loader shard(rank=" + std::to_string(rank) + ", world_size=" +
                                  std::to_string(world_size) + ") needs 0 <= rank < world_size.");
    }
    Derived out = derived();
    out.rank_ = rank;
    out.world_size_ = world_size;
    out.split_ = split;
    return out;
  }
  /// Turns shuffling on or off from the next epoch on (a fit with overfit_batches turns it off, then back).
  void set_shuffle(bool shuffle) { options_.shuffle = shuffle; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  Split split() const { return split_; }
  const Options& options() const { return options_; }

  /// Samples in the whole data set.
  int64_t dataset_size() const { return derived().num_items(); }
  /// Samples this rank yields in a whole epoch.
  int64_t num_samples() const {
    if (!dealt()) return per_rank(dataset_size());
    int64_t total = 0;
    for (int64_t i = 0; i < size(); ++i) total += span(0, i).second;
    return total;
  }
  /// Batches this rank yields in a whole epoch.
  int64_t size() const {
    if (!dealt()) return batches_of(num_samples());
    const int64_t all = batches_of(dataset_size());
    return all > rank_ ? (all - rank_ + world_size_ - 1) / world_size_ : 0;
  }

  /// Chooses the epoch (its permutation). Keeps a loaded position when `epoch` is the loaded epoch.
  void set_epoch(int64_t epoch) {
    if (resume_pending_ && epoch == epoch_) return;
    epoch_ = epoch;
    start_ = 0;
    yielded_ = 0;
    resume_pending_ = false;
    passing_ = false;
  }
  int64_t epoch() const { return epoch_; }

  /// Batches of the current epoch behind the position (this rank's count; after loading a state saved on
  /// as many ranks, the batch index the epoch resumes at).
  int64_t batches_done() const {
    const int64_t at = consumed();
    return at >= dataset_size() ? size() : size() - pass_batches(at);
  }

  /// Where the loader stands now.
  LoaderState state_dict() const {
    return LoaderState{epoch_, consumed(), dataset_size(), options_.batch_size, options_.seed,
                       options_.shuffle, options_.drop_last, world_size_};
  }

  /// Throws unless `state` fits this loader, naming every difference.
  void check_state(const LoaderState& state) const {
    std::ostringstream diff;
    diff << std::boolalpha;
    auto differ = [&](const char* what, auto saved, auto here) {
      if (saved != here) diff << " " << what << " " << saved << " in the state vs " << here << " here;";
    };
    differ("dataset size", state.dataset_size, dataset_size());
    differ("batch_size", state.batch_size, options_.batch_size);
    differ("seed", state.seed, options_.seed);
    differ("shuffle", state.shuffle, options_.shuffle);
    differ("drop_last", state.drop_last, options_.drop_last);
    if (!diff.str().empty()) {
      // A fit with overfit_batches runs its loaders unshuffled (set_shuffle), and its checkpoints say so.
      const std::string overfit = state.shuffle != options_.shuffle
                                      ? " (or, where one of the two fits had overfit_batches, which turns shuffling "
                                        "off, give both the same overfit_batches)"
                                      : "";
      throw std::invalid_argument("volt: this loader state does not fit the loader:" + diff.str() +
                                  " build the loader as it was when the state was saved" + overfit + ".");
    }
    // (the next pass's epoch is epoch + 1: the largest int64 has none)
    if (state.epoch < 0 || state.epoch == std::numeric_limits<int64_t>::max() || state.consumed < 0 ||
        state.consumed > state.dataset_size) {
      throw std::invalid_argument("volt: loader state epoch=" + std::to_string(state.epoch) + " consumed=" +
                                  std::to_string(state.consumed) + " is out of range (epoch must lie in [0, " +
                                  std::to_string(std::numeric_limits<int64_t>::max() - 1) + "], consumed in [0, " +
                                  std::to_string(state.dataset_size) + "]).");
    }
  }

  /// Resumes from `state` at the next `begin()` (see the file comment).
  void load_state_dict(const LoaderState& state) {
    check_state(state);
    epoch_ = state.epoch;
    start_ = state.consumed;
    yielded_ = 0;
    resume_pending_ = true;
  }

  /// The sample indices the next `begin()` yields on this rank, in order.
  torch::Tensor order() const {
    const auto [epoch, from] = next_pass();
    return sequence(epoch, from);
  }

  /// The data set indices of this rank's batch `batch` in the pass under way or last begun (before any, the next).
  torch::Tensor batch_indices(int64_t batch) const {
    const auto [epoch, from] = passing_ && !resume_pending_ ? std::pair<int64_t, int64_t>{epoch_, start_} : next_pass();
    return indices(batch, from, identity() ? torch::Tensor() : sequence(epoch, from));
  }

  template <bool Records>
  class basic_iterator {
    using Owner = std::conditional_t<Records, Derived, const Derived>;

   public:
    using value_type = detail::fetched_t<Derived>;
    using difference_type = std::ptrdiff_t;
    basic_iterator() = default;  // the end
    basic_iterator(Owner* loader, int64_t count, int64_t epoch, int64_t start, torch::Tensor seq)
        : loader_(loader), count_(count), epoch_(epoch), start_(start), seq_(std::move(seq)) {
      const Options& o = loader->options();
      if (o.num_workers > 0 && count > 0) {
        workers_ = std::make_shared<detail::Prefetcher<value_type>>(
            count, std::min<int64_t>(o.num_workers, count), int64_t{o.num_workers} * o.prefetch_factor,
            loader->context(epoch), [l = loader_, start, s = seq_](int64_t b, const FetchContext& ctx) {
              return l->fetch_batch(b, start, s, ctx);
            });
      }
    }

    value_type operator*() const {
      value_type batch = workers_ ? workers_->take(batch_)
                                  : loader_->fetch_batch(batch_, start_, seq_, loader_->context(epoch_));
      if constexpr (Records) loader_->yielded_ = batch_ + 1;
      return batch;
    }
    basic_iterator& operator++() {
      ++batch_;
      return *this;
    }
    bool operator==(const basic_iterator& other) const {
      if (loader_ == nullptr || other.loader_ == nullptr) return done() && other.done();
      return batch_ == other.batch_;
    }

   private:
    bool done() const { return loader_ == nullptr || batch_ >= count_; }
    Owner* loader_ = nullptr;
    int64_t batch_ = 0;
    int64_t count_ = 0;
    int64_t epoch_ = 0;
    int64_t start_ = 0;
    torch::Tensor seq_;  // undefined when the order is the identity
    std::shared_ptr<detail::Prefetcher<value_type>> workers_;  // shared by copies; the last one joins them
  };
  using iterator = basic_iterator<true>;
  using const_iterator = basic_iterator<false>;

  /// Starts a pass (see the file comment for where it starts) and records the position as it goes.
  iterator begin() {
    const auto [epoch, from] = next_pass();
    epoch_ = epoch;
    start_ = from;
    yielded_ = 0;
    resume_pending_ = false;
    passing_ = true;
    return iterator(&derived(), pass_batches(from), epoch, from, identity() ? torch::Tensor() : sequence(epoch, from));
  }
  iterator end() { return iterator(); }

  /// The same batches, without recording a position.
  const_iterator begin() const {
    const auto [epoch, from] = next_pass();
    return const_iterator(&derived(), pass_batches(from), epoch, from,
                          identity() ? torch::Tensor() : sequence(epoch, from));
  }
  const_iterator end() const { return const_iterator(); }

 private:
  friend Derived;
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
  Derived& derived() { return static_cast<Derived&>(*this); }

  bool dealt() const { return split_ == Split::whole_batches && world_size_ > 1; }
  bool identity() const { return !options_.shuffle && (world_size_ == 1 || dealt()); }

  // Samples per rank when `remaining` positions of the epoch are left.
  int64_t per_rank(int64_t remaining) const {
    if (world_size_ == 1) return remaining;
    return options_.drop_last ? remaining / world_size_ : (remaining + world_size_ - 1) / world_size_;
  }
  int64_t per_rank_from(int64_t from) const { return per_rank(dataset_size() - from); }
  int64_t batches_of(int64_t samples) const {
    return options_.drop_last ? samples / options_.batch_size
                              : (samples + options_.batch_size - 1) / options_.batch_size;
  }
  int64_t pass_batches(int64_t from) const { return dealt() ? size() : batches_of(per_rank_from(from)); }

  // Where this rank's batch `b` of a pass from `from` lies: (offset, length) in the pass's sequence, or, for the
  // identity order, in the data set from `from`. Dealt shards take the one-process batch rank + b * world_size.
  std::pair<int64_t, int64_t> span(int64_t from, int64_t b) const {
    if (dealt()) {
      const int64_t offset = (rank_ + b * world_size_) * options_.batch_size;
      return {offset, std::min(options_.batch_size, dataset_size() - offset)};
    }
    const int64_t offset = b * options_.batch_size;
    return {offset, std::min(options_.batch_size, per_rank_from(from) - offset)};
  }

  // Positions consumed by the whole run: a finished pass counts as the whole epoch.
  int64_t consumed() const {
    if (!passing_ || resume_pending_) return start_;
    if (yielded_ >= pass_batches(start_)) return dataset_size();
    return start_ + yielded_ * options_.batch_size * world_size_;
  }

  // The epoch and position the next begin() starts from.
  std::pair<int64_t, int64_t> next_pass() const {
    if (dealt()) return {epoch_, 0};  // every rank's evaluation pass deals from the same order
    if (resume_pending_) {
      if (start_ >= dataset_size()) return {epoch_ + 1, 0};
      return {epoch_, start_};
    }
    if (passing_ && consumed() >= dataset_size()) return {epoch_ + 1, 0};
    return {epoch_, 0};
  }

  // The epoch's order from global position `from` as this rank reads it: the rest of the order, padded from the
  // order's beginning (or trimmed, with drop_last) to a multiple of the world size, every world_size-th; a dealt
  // shard reads the whole order.
  torch::Tensor sequence(int64_t epoch, int64_t from) const {
    const int64_t n = dataset_size();
    torch::Tensor global;
    if (options_.shuffle) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed + static_cast<uint64_t>(epoch));
      global = torch::randperm(n, gen, torch::TensorOptions().dtype(torch::kLong));
    } else {
      global = torch::arange(n, torch::kLong);
    }
    if (dealt()) return global;
    torch::Tensor rest = global.narrow(0, from, n - from);
    if (world_size_ == 1) return rest;
    const int64_t total = per_rank(n - from) * world_size_;
    if (total > rest.size(0)) {  // pad with the order's first samples (repeating it if needed)
      const int64_t pad = total - rest.size(0);
      const int64_t reps = (pad + n - 1) / n;
      rest = torch::cat({rest, global.repeat({reps}).narrow(0, 0, pad)});
    }
    return rest.narrow(0, 0, total).slice(0, rank_, total, world_size_).contiguous();
  }

  FetchContext context(int64_t epoch) const {
    if (options_.pin_memory && !pin_checked_) {
      pin_checked_ = true;
      if (!torch::cuda::is_available()) {
        std::cerr << "volt: loader pin_memory=true, but LibTorch sees no CUDA device; batches stay in pageable "
                     "memory.\n";
      }
    }
    FetchContext ctx;
    ctx.epoch = epoch;
    ctx.seed = options_.seed;
    return ctx;
  }

  // The data set indices of batch `b` of a pass from `from` reading `seq` (undefined: the identity order).
  torch::Tensor indices(int64_t b, int64_t from, const torch::Tensor& seq) const {
    const auto [offset, length] = span(from, b);
    return seq.defined() ? seq.narrow(0, offset, length)
                         : torch::arange(from + offset, from + offset + length, torch::kLong);
  }

  // Batch `b` of a pass from `from`: the derived class's fetch, its failure named, pinned when asked.
  auto fetch_batch(int64_t b, int64_t from, const torch::Tensor& seq, const FetchContext& ctx) const {
    try {
      if constexpr (requires { derived().fetch_range(int64_t{}, int64_t{}); }) {
        if (!seq.defined()) {
          const auto [offset, length] = span(from, b);
          return pinned(derived().fetch_range(from + offset, length));
        }
      }
      return pinned(detail::fetched(derived(), indices(b, from, seq), ctx));
    } catch (const FetchStopped&) {
      throw;
    } catch (...) {
      std::string what = "unknown exception";
      try {
        throw;
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      const std::string where = ctx.worker >= 0 ? " on loader worker " + std::to_string(ctx.worker) : "";
      std::throw_with_nested(LoaderError("volt: reading batch " + std::to_string(b) + " of epoch " +
                                         std::to_string(ctx.epoch) + " (samples " +
                                         detail::describe_indices(indices(b, from, seq)) + ")" + where +
                                         " failed: " + what));
    }
  }

  template <class B>
  B pinned(B batch) const {
    if constexpr (MappableBatch<B>) {
      if (options_.pin_memory && torch::cuda::is_available()) {
        return map_tensors(batch, [](const torch::Tensor& t) { return t.is_pinned() ? t : t.pin_memory(); });
      }
    }
    return batch;
  }

  Options options_;
  int64_t epoch_ = 0;
  int64_t start_ = 0;    // global position the current (or pending) pass starts from
  int64_t yielded_ = 0;  // batches of the current pass delivered on this rank
  bool resume_pending_ = false;
  bool passing_ = false;
  int rank_ = 0;
  int world_size_ = 1;
  Split split_ = Split::padded_samples;
  mutable bool pin_checked_ = false;
};

}  // namespace volt::data
