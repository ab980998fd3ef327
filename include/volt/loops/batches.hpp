#pragma once
/// \file
/// How every loop walks a loader: `for_each_batch`, with a start (a resumed epoch), a limit and the knowledge of
/// which batch is the last, read one batch ahead when the loader has no size; `with_device_batch`, the batch a
/// step sees; an evaluation run's loaders (several with `data::loaders`): their share, their limits; and
/// `ShuffleOff`, a loader's shuffling turned off for overfit_batches.

#include "volt/batch.hpp"
#include "volt/stage.hpp"
#include "volt/data/concept.hpp"
#include "volt/options.hpp"

#include <c10/core/Device.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <optional>
#include <type_traits>
#include <utility>

namespace volt::detail {

/// Calls `f(batch, batch_idx, is_last)` for batch indices `start` .. `limit` - 1 (-1: all); `f` returns
/// false to stop. A loader that resumes at batch `start` by itself (a positioned loader that loaded a
/// state) is read from its beginning; any other has its first `start` batches skipped (`skip`). A sized
/// loader knows its last batch; an unsized one is read one batch ahead.
template <class L, class F>
void for_each_batch(L& loader, int64_t limit, F&& f, int64_t start = 0, bool skip = false) {
  if (limit == 0 || (limit > 0 && start >= limit)) return;
  auto it = loader.begin();
  auto end = loader.end();
  if (skip) {
    for (int64_t i = 0; i < start && it != end; ++i) ++it;
  }
  if constexpr (data::SizedLoader<L>) {
    for (int64_t idx = start; it != end && (limit < 0 || idx < limit); ++it, ++idx) {
      auto&& batch = *it;
      if (!f(batch, idx, idx + 1 == limit)) return;
    }
  } else {
    if (it == end) return;
    using B = std::remove_cvref_t<decltype(*it)>;
    std::optional<B> current(std::in_place, *it);
    ++it;
    for (int64_t idx = start;; ++idx) {
      const bool last = it == end || (limit >= 0 && idx + 1 >= limit);
      if (!f(*current, idx, last) || last) return;
      current.emplace(*it);
      ++it;
    }
  }
}

/// Calls `f` with the batch a step sees on accelerator `A` under precision `P`: moved to `device` and cast for
/// "true" precisions, or the loader's own object when neither applies (CPU, no cast: no copy at all).
template <class A, class P, class B, class F>
decltype(auto) with_device_batch(B& batch, const c10::Device& device, F&& f) {
  constexpr bool moves = A::device_type != c10::DeviceType::CPU;
  if constexpr (moves || P::converts_inputs) {
    auto prepared = [&] {
      if constexpr (moves && P::converts_inputs) {
        return batch_to_floating_dtype(batch_to_device(batch, device), P::input_dtype);
      } else if constexpr (moves) {
        return batch_to_device(batch, device);
      } else {
        return batch_to_floating_dtype(batch, P::input_dtype);
      }
    }();
    return f(prepared);
  } else {
    return f(batch);
  }
}

/// How many batches of one loader an evaluation run goes through: `limit` (limit_val_batches, ...) against its size,
/// at most `cap` (the sanity check's num_sanity_val_steps; -1: no cap). -1: until the loader ends.
inline auto limit_of(const Limit& limit, const char* name, int64_t cap = -1) {
  return [&limit, name, cap](auto& loader) {
    const int64_t n = limit.resolve(loader_size(loader), name);
    return cap < 0 ? n : (n < 0 ? cap : std::min(n, cap));
  };
}

/// What `strategy` makes of `loader` for `stage` (its share under DDP), of each of several loaders.
template <class S, class L>
decltype(auto) process_loader(S& strategy, L& loader, Stage stage) {
  if constexpr (data::is_loaders_v<std::remove_cv_t<L>>) {
    return loader.map([&](auto& one) -> decltype(auto) { return strategy.process_dataloader(one, stage); });
  } else {
    return strategy.process_dataloader(loader, stage);
  }
}

/// While it lives, a loader that shuffles (volt's loaders: `set_shuffle`) does not, for overfit_batches: the same
/// batches every epoch, as Lightning. Rank zero says so once per loader.
template <class L>
class ShuffleOff {
 public:
  ShuffleOff(L& loader, bool overfits, bool says, const char* which) {
    if constexpr (data::is_loaders_v<L>) {
      if (overfits && says) {
        std::cerr << "volt: overfit_batches: several " << which << " loaders each keep their own order; if one "
                  << "shuffles, turn its shuffling off so that every epoch sees the same batches.\n";
      }
    } else if constexpr (requires { loader.set_shuffle(false); loader.options().shuffle; }) {
      if (!overfits || !loader.options().shuffle) return;
      loader_ = &loader;
      loader.set_shuffle(false);
      if (says) {
        std::cerr << "volt: overfit_batches: the " << which << " loader shuffles; the fit turns that off, so that "
                  << "every epoch sees the same batches.\n";
      }
    } else if (overfits && says) {
      std::cerr << "volt: overfit_batches: the " << which << " loader has no set_shuffle(bool) (volt::data's loaders "
                << "have it); if it shuffles, each epoch sees other batches: turn its shuffling off.\n";
    }
  }
  ~ShuffleOff() {
    if constexpr (requires(L& l) { l.set_shuffle(true); }) {
      if (loader_ != nullptr) loader_->set_shuffle(true);
    }
  }
  ShuffleOff(const ShuffleOff&) = delete;
  ShuffleOff& operator=(const ShuffleOff&) = delete;

 private:
  L* loader_ = nullptr;
};

}  // namespace volt::detail
