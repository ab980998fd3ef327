#pragma once
/// \file
/// `detail::BufferPool`: the memory that stage 3 (FSDP) gathers each unit into and frees again, every step, and that
/// each unit's gradients are reduce-scattered from, kept for reuse instead of returned to the allocator (one pool for
/// both: a unit's gathered parameters and its gradient bucket are the same size, and one is freed as the other is
/// made). On the CPU, glibc serves blocks under its moving mmap threshold from the
/// heap and keeps what is freed resident, so a fit's memory grows by what was ever held at once plus the heap's
/// fragments; above the threshold it maps and unmaps them, a page fault per page every step. On a GPU, the caching
/// allocator would reuse the blocks too; the pool does it on every device alike.

#include <c10/core/StorageImpl.h>
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

  /// Gives `storage` a block of at least `nbytes` bytes unless it holds one; its size is then the block's.
  void fill(c10::StorageImpl& storage, std::size_t nbytes) {
    if (storage.nbytes() >= nbytes) return;
    release(storage);
    std::size_t capacity = 0;
    storage.set_data_ptr_noswap(take(storage.allocator(), nbytes, capacity));
    storage.set_nbytes(capacity);
  }
  /// Takes `storage`'s block back for a later `fill`: it holds nothing, and the tensors that share it (views, autograd's
  /// saved tensors) keep pointing at it.
  void release(c10::StorageImpl& storage) {
    if (storage.nbytes() == 0) return;
    const std::size_t capacity = storage.nbytes();
    const c10::Device device = storage.device();
    give(storage.set_data_ptr(at::DataPtr(nullptr, device)), capacity);
    storage.set_nbytes(0);
  }

  /// Returns everything kept to its allocator.
  void clear() { blocks_.clear(); }

 private:
  std::size_t kept_;
  std::vector<std::pair<at::DataPtr, std::size_t>> blocks_;
};

}  // namespace volt::detail
