#pragma once
/// \file
/// `detail::BufferPool`: the memory that stage 3 (FSDP) gathers each unit into and frees again, every step, kept for
/// reuse instead of returned to the allocator. On the CPU, glibc serves blocks under its moving mmap threshold from the
/// heap and keeps what is freed resident, so a fit's memory grows by what was ever held at once plus the heap's
/// fragments; above the threshold it maps and unmaps them, a page fault per page every step. On a GPU, the caching
/// allocator would reuse the blocks too; the pool does it on every device alike.

#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace volt::detail {

/// Keeps at most `kept` blocks of raw memory (each a gathered unit's parameters); when one more is given, the smallest
/// goes.
class BufferPool {
 public:
  explicit BufferPool(std::size_t kept = 4) : kept_(kept) {}

  /// A block of at least `nbytes` bytes: the smallest kept one that is large enough and at most twice as large (of
  /// those, the last given: its memory is the likeliest still in the caches), or a new one from `allocator`;
  /// `capacity` is set to its size.
  at::DataPtr take(c10::Allocator* allocator, std::size_t nbytes, std::size_t& capacity) {
    auto best = blocks_.end();
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
      if (it->second >= nbytes && it->second <= 2 * nbytes && (best == blocks_.end() || it->second <= best->second)) {
        best = it;
      }
    }
    if (best == blocks_.end()) {
      capacity = nbytes;
      return allocator->allocate(nbytes);
    }
    capacity = best->second;
    at::DataPtr data = std::move(best->first);
    blocks_.erase(best);
    return data;
  }
  /// Keeps `data` (of `capacity` bytes) for a later `take`.
  void give(at::DataPtr data, std::size_t capacity) {
    if (!data || capacity == 0) return;
    blocks_.emplace_back(std::move(data), capacity);
    if (blocks_.size() <= kept_) return;
    blocks_.erase(std::min_element(blocks_.begin(), blocks_.end(),
                                   [](const auto& a, const auto& b) { return a.second < b.second; }));
  }

  /// Returns everything kept to its allocator.
  void clear() { blocks_.clear(); }

 private:
  std::size_t kept_;
  std::vector<std::pair<at::DataPtr, std::size_t>> blocks_;
};

}  // namespace volt::detail
