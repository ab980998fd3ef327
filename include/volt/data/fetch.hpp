#pragma once
/// \file
/// What a loader's `fetch` may be told about the batch it reads (`volt::data::FetchContext`), and the
/// per-sample generators that make random augmentation reproducible.
///
/// A derived loader's `fetch(indices, ctx)` (see data/stateful.hpp) runs on the training thread when
/// `num_workers` is 0 and on a worker thread otherwise. Randomness for a sample comes from
/// `ctx.generator(sample)`: a generator seeded by (loader seed, epoch, sample index) only, so a random crop or
/// flip is the same whichever worker reads the sample, however many workers there are, and after a resume.
/// (PyTorch seeds each worker instead, so its augmentations change with `num_workers`.)

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>

namespace volt::data {

/// The generator of sample `index` in `epoch` for a loader seeded with `seed` (splitmix64 of the three).
inline at::Generator sample_generator(uint64_t seed, int64_t epoch, int64_t index) {
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  const uint64_t s = mix(mix(mix(seed) ^ static_cast<uint64_t>(epoch)) ^ static_cast<uint64_t>(index));
  return at::make_generator<at::CPUGeneratorImpl>(s);
}

/// Thrown by a fetch that saw `stop_requested()`: the loader is shutting down and the batch is not wanted.
struct FetchStopped : std::exception {
  const char* what() const noexcept override { return "volt: the loader stopped this fetch"; }
};

/// Passed to `fetch(indices, ctx)`.
struct FetchContext {
  /// The epoch whose order the batch belongs to.
  int64_t epoch = 0;
  /// The loader's seed (LoaderOptions::seed).
  uint64_t seed = 0;
  /// The worker thread reading it (0 .. num_workers - 1), or -1 on the training thread.
  int worker = -1;
  const std::atomic<bool>* stop = nullptr;

  /// The generator for sample `index` (an index into the data set, as in `indices`).
  at::Generator generator(int64_t index) const { return sample_generator(seed, epoch, index); }
  /// True once the loader no longer wants this batch (end of a pass, an error, a stop): a fetch that reads
  /// slowly checks it between reads and throws `FetchStopped`.
  bool stop_requested() const { return stop != nullptr && stop->load(std::memory_order_relaxed); }
  /// Throws `FetchStopped` when `stop_requested()`.
  void check_stop() const {
    if (stop_requested()) throw FetchStopped();
  }
};

}  // namespace volt::data
