#pragma once
/// \file
/// The thread that runs one communicator's collectives for `volt::Mpi`: Open MPI's blocking collectives (its tuned
/// algorithms: ring and Rabenseifner all-reduce, recursive-doubling and ring all-gather) issued one after another, in
/// the order the backend starts them, on a communicator of the thread's own. The rank's own thread goes on meanwhile
/// (backward's kernels), and a collective progresses while it computes.
///
/// Why not MPI's non-blocking collectives: Open MPI 4.1 runs them through libnbc, which progresses only inside MPI
/// calls (nothing moves while backward computes) and picks a binomial reduce-and-broadcast all-reduce and a
/// reduce-then-scatter reduce-scatter below 4 ranks: half the bus bandwidth of the blocking ones (docs/distributed.md,
/// "Speed across hosts"). PyTorch's MPI process group runs its collectives the same way, on one worker thread.
///
/// `VOLT_COLLECTIVE_DELAY_US` (a debugging aid): each collective starts that many microseconds after the thread takes
/// it, so that a buffer read before its wait, or freed or refilled while its collective may still run, shows as wrong
/// values or a crash instead of passing by luck (the tests run FSDP under it).
///
/// Failure model: the rank's thread never waits on the collective thread itself, but polls its tickets through
/// `MpiGroup::wait_until`, which watches the failure channel, the peers and the timeout as for any request. A
/// collective whose peer died never returns: after a failure the thread is left behind (detached) and the process
/// ends without MPI_Finalize, as every failed volt process does.

#include "volt/comm/runtime.hpp"
#include "volt/errors.hpp"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <utility>

namespace volt::detail {

/// One collective handed to the thread; done once the thread has returned from it (`error`: its MPI code).
class Ticket {
 public:
  bool done() const { return done_.load(std::memory_order_acquire); }
  int error() const { return error_; }
  /// Waits for up to `slice` for the collective to finish (the rank's thread, between its failure checks).
  template <class Rep, class Period>
  void wait_for(std::chrono::duration<Rep, Period> slice) {
    if (done()) return;
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait_for(lock, slice, [this] { return done(); });
  }
  void finish(int error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = error;
      done_.store(true, std::memory_order_release);
    }
    finished_.notify_all();
  }

 private:
  std::atomic<bool> done_{false};
  int error_ = MPI_SUCCESS;
  std::mutex mutex_;
  std::condition_variable finished_;
};

class CollectiveThread {
 public:
  /// A blocking MPI collective on the thread's communicator; returns its MPI code.
  using Call = std::function<int(MPI_Comm)>;

  /// Duplicates `comm` (collective over its members, watched as any wait) and starts the thread, where MPI allows
  /// several threads (volt asks for MPI_THREAD_MULTIPLE; a program that initialised MPI with less has its collectives
  /// run blocking at submit(), without the failure checks).
  CollectiveThread(MpiGroup& group, MPI_Comm comm) : group_(&group) {
    MPI_Request request;
    mpi_check(MPI_Comm_idup(comm, &comm_, &request), "MPI_Comm_idup");
    group.wait(request);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    if (const char* delay = std::getenv("VOLT_COLLECTIVE_DELAY_US")) {
      delay_ = std::chrono::microseconds(parse_delay(delay));
    }
    if (provided == MPI_THREAD_MULTIPLE) thread_ = std::thread([this] { loop(); });
  }
  CollectiveThread(const CollectiveThread&) = delete;
  CollectiveThread& operator=(const CollectiveThread&) = delete;
  ~CollectiveThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (group_->failed() || finalized) {
      if (thread_.joinable()) thread_.detach();  // it may be inside a collective a dead peer never joins
      return;
    }
    if (thread_.joinable()) thread_.join();
    MPI_Comm_free(&comm_);
  }

  /// Queues `call` after the collectives queued before it.
  std::shared_ptr<Ticket> submit(Call call) {
    auto ticket = std::make_shared<Ticket>();
    if (!thread_.joinable()) {
      ticket->finish(call(comm_));
      return ticket;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace_back(std::move(call), ticket);
    }
    wake_.notify_one();
    return ticket;
  }

 private:
  void loop() {
    for (;;) {
      std::pair<Call, std::shared_ptr<Ticket>> next;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        next = std::move(queue_.front());
        queue_.pop_front();
      }
      if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
      next.second->finish(next.first(comm_));
    }
  }

  static int64_t parse_delay(const char* text) {
    char* end = nullptr;
    const long long us = std::strtoll(text, &end, 10);
    if (end == text || *end != '\0' || us < 0 || us > 10'000'000) {
      throw ConfigError(std::string("volt: VOLT_COLLECTIVE_DELAY_US is \"") + text + "\"; allowed: a whole number of "
                        "microseconds from 0 to 10000000.");
    }
    return us;
  }

  MpiGroup* group_;
  std::chrono::microseconds delay_{0};
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<Call, std::shared_ptr<Ticket>>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace volt::detail
