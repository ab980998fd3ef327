#pragma once
/// \file
/// `volt::data::detail::Prefetcher<T>`: the worker threads of a loader pass (LoaderOptions::num_workers). It runs
/// `fetch(batch, ctx)` for batches 0 .. count - 1 of one pass on `workers` threads, at most `depth` batches
/// ahead of the batch the training thread takes next, and hands the batches out strictly in order, so the
/// sequence is the synchronous loader's whatever the number of workers. A batch's exception is kept in its slot
/// and thrown on the training thread when that batch is taken, not earlier.
///
/// **Threads and cores.** Each worker runs LibTorch's operations single-threaded (its OpenMP team set to one
/// thread; see detail::serial_intra_op_in_this_thread), so a pass uses at most `workers` threads for reading plus
/// the training thread's intra-op threads (`at::get_num_threads()`): with C cores, `num_workers` +
/// `at::get_num_threads()` <= C does not oversubscribe.
///
/// **Stopping.** The destructor (end of a pass, an exception, a stop signal's unwinding) raises the stop flag,
/// wakes every worker and joins them. A worker inside a fetch finishes it first: a fetch that reads slowly checks
/// `FetchContext::check_stop()` between reads (volt's SampleLoader does between samples), so the join waits for
/// at most one read per worker.

#include "volt/data/fetch.hpp"
#include "volt/detail/torch_compat.hpp"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace volt::data::detail {

template <class T>
class Prefetcher {
 public:
  using Fetch = std::function<T(int64_t batch, const FetchContext& ctx)>;

  /// Starts `workers` threads reading batches 0 .. count - 1; `ctx` is copied for each (its worker and stop set).
  Prefetcher(int64_t count, int workers, int64_t depth, FetchContext ctx, Fetch fetch)
      : count_(count), depth_(depth), fetch_(std::move(fetch)), slots_(static_cast<std::size_t>(depth)) {
    ctx.stop = &stop_;
    threads_.reserve(static_cast<std::size_t>(workers));
    try {
      for (int w = 0; w < workers; ++w) {
        FetchContext mine = ctx;
        mine.worker = w;
        threads_.emplace_back([this, mine] { work(mine); });
      }
    } catch (...) {
      shut_down();
      throw;
    }
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  ~Prefetcher() { shut_down(); }

  /// Batch `b`, waiting for it; rethrows the exception its fetch threw. Batches before `b` that were never taken
  /// (an iterator incremented without being read, as when a resume skips batches) are dropped unread.
  T take(int64_t b) {
    std::unique_lock lock(mutex_);
    if (b < next_take_) {
      throw std::logic_error("volt: a loader iterator with workers hands out each batch once and in order: batch " +
                             std::to_string(b) + " was asked for again after batch " + std::to_string(next_take_ - 1) +
                             " (dereference an iterator once per increment).");
    }
    for (;;) {
      Slot& slot = slots_[index(next_take_)];
      produced_.wait(lock, [&] { return slot.full; });
      Slot out = std::move(slot);
      slot = Slot{};
      const bool wanted = next_take_++ == b;
      space_.notify_all();
      if (!wanted) continue;
      lock.unlock();
      if (out.error) std::rethrow_exception(out.error);
      return std::move(*out.value);
    }
  }

 private:
  struct Slot {
    bool full = false;
    std::optional<T> value;
    std::exception_ptr error;
  };

  std::size_t index(int64_t b) const { return static_cast<std::size_t>(b % depth_); }

  void work(const FetchContext& ctx) {
    volt::detail::serial_intra_op_in_this_thread();
    for (;;) {
      int64_t b = 0;
      {
        std::unique_lock lock(mutex_);
        space_.wait(lock, [&] { return stopping() || next_fetch_ >= count_ || next_fetch_ < next_take_ + depth_; });
        if (stopping() || next_fetch_ >= count_) return;
        b = next_fetch_++;
      }
      Slot slot;
      try {
        slot.value.emplace(fetch_(b, ctx));
      } catch (const FetchStopped&) {
        if (stopping()) return;  // not wanted any more; otherwise it is the batch's error like any other
        slot.error = std::current_exception();
      } catch (...) {
        slot.error = std::current_exception();
      }
      slot.full = true;
      {
        std::lock_guard lock(mutex_);
        slots_[index(b)] = std::move(slot);
      }
      produced_.notify_all();
    }
  }

  bool stopping() const { return stop_.load(std::memory_order_relaxed); }

  void shut_down() {
    {
      std::lock_guard lock(mutex_);
      stop_.store(true);
    }
    space_.notify_all();
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
    threads_.clear();
  }

  const int64_t count_;
  const int64_t depth_;
  Fetch fetch_;
  std::mutex mutex_;
  std::condition_variable produced_, space_;
  std::vector<Slot> slots_;
  int64_t next_fetch_ = 0;  // the next batch a worker starts
  int64_t next_take_ = 0;   // the next batch the training thread takes
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace volt::data::detail
