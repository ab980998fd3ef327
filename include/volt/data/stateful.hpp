#pragma once
/// \file
/// `volt::data::StatefulLoader<Derived>`: the CRTP base of volt's loaders. It owns everything about *which*
/// samples come next — the epoch's seeded permutation, the sharding across ranks, the batching, and the
/// position — and asks the derived class only how to fetch a batch of samples by index:
///
/// | the derived class provides | meaning |
/// |---|---|
/// | `int64_t num_items() const` | samples in the data set |
/// | `Batch fetch(const torch::Tensor& indices) const` | the batch of these samples (int64 indices, in order) |
/// | `Batch fetch_range(int64_t start, int64_t length) const` (optional) | samples start..start+length-1, used when the order is the identity (no shuffle, one rank) |
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
/// A state that does not fit the loader (another data set size, batch size, seed, shuffle or drop_last)
/// is refused with every difference named; iterating a `const` loader reads the same batches without
/// recording a position.

#include "volt/data/concept.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
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
};

template <class Derived>
class StatefulLoader {
 public:
  using Options = LoaderOptions;

  explicit StatefulLoader(Options options) : options_(options) {
    if (options_.batch_size < 1) {
      throw std::invalid_argument("volt: loader batch_size=" + std::to_string(options_.batch_size) +
                                  " is not allowed: give a number >= 1.");
    }
  }

  /// The loader rank `rank` of `world_size` iterates: the same order, every world_size-th position.
  Derived shard(int rank, int world_size) const {
    if (world_size < 1 || rank < 0 || rank >= world_size) {
      throw std::invalid_argument("volt: loader shard(rank=" + std::to_string(rank) + ", world_size=" +
                                  std::to_string(world_size) + ") needs 0 <= rank < world_size.");
    }
    Derived out = derived();
    out.rank_ = rank;
    out.world_size_ = world_size;
    return out;
  }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const Options& options() const { return options_; }

  /// Samples in the whole data set.
  int64_t dataset_size() const { return derived().num_items(); }
  /// Samples this rank yields in a whole epoch.
  int64_t num_samples() const { return per_rank(dataset_size()); }
  /// Batches this rank yields in a whole epoch.
  int64_t size() const { return batches_of(num_samples()); }

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
    auto differ = [&](const char* what, auto saved, auto here) {
      if (saved != here) diff << " " << what << " " << saved << " in the state vs " << here << " here;";
    };
    differ("dataset size", state.dataset_size, dataset_size());
    differ("batch_size", state.batch_size, options_.batch_size);
    differ("seed", state.seed, options_.seed);
    differ("shuffle", state.shuffle, options_.shuffle);
    differ("drop_last", state.drop_last, options_.drop_last);
    if (!diff.str().empty()) {
      throw std::invalid_argument("volt: this loader state does not fit the loader:" + diff.str() +
                                  " build the loader as it was when the state was saved.");
    }
    if (state.epoch < 0 || state.consumed < 0 || state.consumed > state.dataset_size) {
      throw std::invalid_argument("volt: loader state epoch=" + std::to_string(state.epoch) + " consumed=" +
                                  std::to_string(state.consumed) + " is out of range (consumed must lie in [0, " +
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

  template <bool Records>
  class basic_iterator {
    using Owner = std::conditional_t<Records, Derived, const Derived>;

   public:
    using value_type = std::remove_cvref_t<decltype(std::declval<const Derived&>().fetch(std::declval<const torch::Tensor&>()))>;
    using difference_type = std::ptrdiff_t;
    basic_iterator() = default;  // the end
    basic_iterator(Owner* loader, int64_t count, int64_t start, torch::Tensor seq)
        : loader_(loader), count_(count), start_(start), seq_(std::move(seq)) {}

    value_type operator*() const {
      if constexpr (Records) loader_->yielded_ = batch_ + 1;
      return loader_->fetch_batch(batch_, start_, seq_);
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
    int64_t start_ = 0;
    torch::Tensor seq_;  // undefined when the order is the identity
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
    return iterator(&derived(), pass_batches(from), from, identity() ? torch::Tensor() : sequence(epoch, from));
  }
  iterator end() { return iterator(); }

  /// The same batches, without recording a position.
  const_iterator begin() const {
    const auto [epoch, from] = next_pass();
    return const_iterator(&derived(), pass_batches(from), from, identity() ? torch::Tensor() : sequence(epoch, from));
  }
  const_iterator end() const { return const_iterator(); }

 private:
  friend Derived;
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
  Derived& derived() { return static_cast<Derived&>(*this); }

  bool identity() const { return !options_.shuffle && world_size_ == 1; }

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
  int64_t pass_batches(int64_t from) const { return batches_of(per_rank_from(from)); }

  // Positions consumed by the whole run: a finished pass counts as the whole epoch.
  int64_t consumed() const {
    if (!passing_ || resume_pending_) return start_;
    if (yielded_ >= pass_batches(start_)) return dataset_size();
    return start_ + yielded_ * options_.batch_size * world_size_;
  }

  // The epoch and position the next begin() starts from.
  std::pair<int64_t, int64_t> next_pass() const {
    if (resume_pending_) {
      if (start_ >= dataset_size()) return {epoch_ + 1, 0};
      return {epoch_, start_};
    }
    if (passing_ && consumed() >= dataset_size()) return {epoch_ + 1, 0};
    return {epoch_, 0};
  }

  // This rank's indices of `epoch` from global position `from`: the rest of the order, padded from the
  // order's beginning (or trimmed, with drop_last) to a multiple of the world size, every world_size-th.
  torch::Tensor sequence(int64_t epoch, int64_t from) const {
    const int64_t n = dataset_size();
    torch::Tensor global;
    if (options_.shuffle) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed + static_cast<uint64_t>(epoch));
      global = torch::randperm(n, gen, torch::TensorOptions().dtype(torch::kLong));
    } else {
      global = torch::arange(n, torch::kLong);
    }
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

  auto fetch_batch(int64_t b, int64_t from, const torch::Tensor& seq) const {
    const int64_t start = b * options_.batch_size;
    const int64_t len = std::min(options_.batch_size, per_rank_from(from) - start);
    if (!seq.defined()) {
      if constexpr (requires { derived().fetch_range(int64_t{}, int64_t{}); }) {
        return derived().fetch_range(from + start, len);
      } else {
        return derived().fetch(torch::arange(from + start, from + start + len, torch::kLong));
      }
    }
    return derived().fetch(seq.narrow(0, start, len));
  }

  Options options_;
  int64_t epoch_ = 0;
  int64_t start_ = 0;    // global position the current (or pending) pass starts from
  int64_t yielded_ = 0;  // batches of the current pass yielded on this rank
  bool resume_pending_ = false;
  bool passing_ = false;
  int rank_ = 0;
  int world_size_ = 1;
};

}  // namespace volt::data
