#pragma once
/// \file
/// What a rank knows when a collective does not complete, for the waits of `MpiGroup` (runtime.hpp):
///  - a **flight recorder**: the last collectives, sends and receives this rank issued, numbered in the order issued
///    (in a program whose ranks issue the same collectives, on whichever mesh axes, the same collective has the same
///    number on every rank, as MPI and NCCL need them issued in one order), with the training step and bucket they
///    served, the axis and peer, and when they completed (PyTorch's NCCL flight recorder is the model);
///  - **heartbeats**: a thread of each rank sends every other member, twice a second, how far its recorder has got;
///    a member not heard from for `kSilentLimit` has lost its process, its host or the link to it, whatever the
///    launcher does about it (srun with `KillOnBadExit=0` does nothing, a cut link leaves mpirun waiting). The
///    thread runs where MPI gives MPI_THREAD_MULTIPLE (volt asks for it; a program that initialised MPI with less
///    has the timeout alone). It also runs the device watchers a backend adds (Nccl: its collectives' CUDA events).

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace volt::detail {

/// What the recorder records: the collectives, and the point-to-point sends and receives (`send`, `recv`).
enum class Collective : std::int8_t {
  all_reduce, reduce_scatter, all_gather, broadcast, barrier, exchange, agreement, send, recv
};
inline bool point_to_point(Collective c) { return c == Collective::send || c == Collective::recv; }

inline const char* to_string(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all-reduce";
    case Collective::reduce_scatter: return "reduce-scatter";
    case Collective::all_gather: return "all-gather";
    case Collective::broadcast: return "broadcast";
    case Collective::barrier: return "barrier";
    case Collective::exchange: return "byte exchange";
    case Collective::agreement: return "agreement";
    case Collective::send: return "send";
    case Collective::recv: return "receive";
  }
  return "collective";
}

/// What the issuing thread is doing, set by those who know it: the loops set the global step at each batch, the
/// gradient reducer the bucket it starts. Recorded with each collective.
struct CollectiveTag {
  int64_t step = -1;
  int bucket = -1;
};
inline CollectiveTag& collective_tag() {
  thread_local CollectiveTag tag;
  return tag;
}
/// Tags the collectives of one scope with a bucket.
class BucketTag {
 public:
  explicit BucketTag(int bucket) : saved_(collective_tag().bucket) { collective_tag().bucket = bucket; }
  BucketTag(const BucketTag&) = delete;
  BucketTag& operator=(const BucketTag&) = delete;
  ~BucketTag() { collective_tag().bucket = saved_; }

 private:
  int saved_;
};

using Clock = std::chrono::steady_clock;

inline std::string seconds_text(Clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(d).count());
  return text;
}

/// `name` as a string that lives as long as the process (the axis names entries point to): equal names, one copy.
inline const char* intern(const std::string& name) {
  static std::mutex mutex;
  static auto* names = new std::set<std::string>();  // leaked: entries may be described at exit
  std::lock_guard<std::mutex> lock(mutex);
  return names->insert(name).first->c_str();
}

/// Where a collective ran: the mesh axis (null: the whole group) and, for a send or a receive, the peer's rank in
/// the whole group.
struct Route {
  const char* axis = nullptr;
  int peer = -1;
};

/// One collective as the recorder keeps it.
struct FlightEntry {
  uint64_t seq = 0;  // 1, 2, ... in the order issued; 0: none
  Collective kind = Collective::all_reduce;
  int64_t step = -1;
  int bucket = -1;
  int64_t bytes = -1;
  Clock::time_point issued{}, completed{};  // completed: {} while in flight
  Route route{};
};

/// "all-reduce #12 (step 3, bucket 1, 4096 bytes)", "send #13 to rank 3 on axis pipe (step 2, 512 bytes)".
inline std::string describe(Collective kind, uint64_t seq, int64_t step, int bucket, int64_t bytes, Route route = {}) {
  std::string s = std::string(to_string(kind)) + " #" + std::to_string(seq);
  if (route.peer >= 0) s += (kind == Collective::recv ? " from rank " : " to rank ") + std::to_string(route.peer);
  if (route.axis != nullptr) s += std::string(" on axis ") + route.axis;
  std::string detail;
  if (step >= 0) detail += "step " + std::to_string(step);
  if (bucket >= 0) detail += (detail.empty() ? "" : ", ") + std::string("bucket ") + std::to_string(bucket);
  if (bytes >= 0) detail += (detail.empty() ? "" : ", ") + std::to_string(bytes) + " bytes";
  return detail.empty() ? s : s + " (" + detail + ")";
}
inline std::string describe(const FlightEntry& e) {
  return describe(e.kind, e.seq, e.step, e.bucket, e.bytes, e.route);
}

/// A rank's progress as its heartbeat carries it: the last collective issued (number, kind, step, bucket, bytes, the
/// peer of a send or receive) and the highest number completed.
struct Progress {
  static constexpr int kWords = 7;
  std::array<int64_t, kWords> words{};
  uint64_t issued() const { return static_cast<uint64_t>(words[0]); }
  uint64_t completed() const { return static_cast<uint64_t>(words[5]); }
  std::string last_issued() const {
    if (issued() == 0) return "none issued yet";
    return describe(static_cast<Collective>(words[1]), issued(), words[2], static_cast<int>(words[3]), words[4],
                    Route{nullptr, static_cast<int>(words[6])});
  }
};

/// The last `kKept` collectives of this rank.
class FlightRecorder {
 public:
  static constexpr std::size_t kKept = 32;

  /// Records a collective (or a send or receive) about to be issued; returns its number.
  uint64_t issue(Collective kind, int64_t bytes, Route route = {}) {
    std::lock_guard<std::mutex> lock(mutex_);
    const CollectiveTag& tag = collective_tag();
    ++issued_;
    ring_[issued_ % kKept] = FlightEntry{issued_, kind, tag.step, tag.bucket, bytes, Clock::now(), {}, route};
    return issued_;
  }
  void complete(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    FlightEntry& e = ring_[seq % kKept];
    if (e.seq == seq && e.completed == Clock::time_point{}) e.completed = Clock::now();
    completed_ = std::max(completed_, seq);
  }
  Progress progress() const {
    std::lock_guard<std::mutex> lock(mutex_);
    Progress p;
    const FlightEntry& last = ring_[issued_ % kKept];
    p.words = {static_cast<int64_t>(issued_), static_cast<int64_t>(last.kind), last.step, last.bucket, last.bytes,
               static_cast<int64_t>(completed_), last.route.peer};
    return p;
  }
  /// The entry numbered `seq` while it is still kept (seq 0 otherwise).
  FlightEntry entry(uint64_t seq) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const FlightEntry& e = ring_[seq % kKept];
    return e.seq == seq ? e : FlightEntry{};
  }
  /// The last `n` collectives, oldest first, each with how long it took or has been in flight.
  std::string recent(std::size_t n) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string out;
    const auto now = Clock::now();
    for (uint64_t seq = issued_ > n ? issued_ - n + 1 : 1; seq <= issued_; ++seq) {
      const FlightEntry& e = ring_[seq % kKept];
      if (e.seq != seq) continue;
      out += (out.empty() ? "" : "; ") + describe(e) +
             (e.completed == Clock::time_point{} ? ", in flight for " + seconds_text(now - e.issued)
                                                 : ", done in " + seconds_text(e.completed - e.issued));
    }
    return out.empty() ? "none" : out;
  }

 private:
  mutable std::mutex mutex_;
  std::array<FlightEntry, kKept> ring_{};
  uint64_t issued_ = 0, completed_ = 0;
};

/// Heartbeats between the members of a group, on a communicator of their own.
class Heartbeat {
 public:
  static constexpr auto kEvery = std::chrono::milliseconds(500);
  /// A member not heard from for this long is gone (or the collective timeout, when shorter).
  static constexpr auto kSilentLimit = std::chrono::seconds(15);
  static constexpr int kTag = 31010;

  /// A watcher run on the heartbeat thread at every beat; a non-empty answer is a failure (the first is kept).
  using Watcher = std::function<std::string()>;

  Heartbeat(MPI_Comm comm, const FlightRecorder& recorder) : comm_(comm), recorder_(&recorder) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    const auto now = Clock::now();
    heard_.assign(static_cast<std::size_t>(size_), now);
    peers_.assign(static_cast<std::size_t>(size_), Progress{});
  }
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  ~Heartbeat() { stop(); }

  /// Starts beating where MPI allows several threads to call it and there is a peer to beat for.
  void start() {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE || size_ < 2 || thread_.joinable()) return;
    thread_ = std::thread([this] { loop(); });
  }
  /// Stops beating (at once; never throws).
  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }
  bool running() const { return thread_.joinable(); }

  /// Adds a watcher (any time: the thread takes the list afresh at every beat).
  void add_watcher(Watcher w) {
    std::lock_guard<std::mutex> lock(watchers_mutex_);
    watchers_.push_back(std::move(w));
  }
  /// The first failure a watcher reported ("" while none).
  std::string watcher_failure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return watcher_failure_;
  }

  /// The member heard from least recently, if it has been silent for at least `limit`: {rank, silence}; rank -1 when
  /// none has.
  std::pair<int, Clock::duration> silent(Clock::duration limit) const {
    if (!running()) return {-1, {}};
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = Clock::now();
    std::pair<int, Clock::duration> worst{-1, {}};
    for (int r = 0; r < size_; ++r) {
      const auto quiet = now - heard_[static_cast<std::size_t>(r)];
      if (r != rank_ && quiet >= limit && quiet > worst.second) worst = {r, quiet};
    }
    return worst;
  }
  /// What member `rank` last said, and how long ago.
  std::pair<Progress, Clock::duration> peer(int rank) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {peers_[static_cast<std::size_t>(rank)], Clock::now() - heard_[static_cast<std::size_t>(rank)]};
  }

 private:
  void loop() {
    std::vector<MPI_Request> sends(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
    std::vector<Progress> out(static_cast<std::size_t>(size_));
    Progress in;
    MPI_Request receive = MPI_REQUEST_NULL;
    MPI_Irecv(in.words.data(), Progress::kWords, MPI_INT64_T, MPI_ANY_SOURCE, kTag, comm_, &receive);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      lock.unlock();
      beat(sends, out);
      for (int arrived = 1; arrived && receive != MPI_REQUEST_NULL;) {
        MPI_Status status;
        if (MPI_Test(&receive, &arrived, &status) != MPI_SUCCESS) break;
        if (!arrived) break;
        {
          std::lock_guard<std::mutex> heard(mutex_);
          heard_[static_cast<std::size_t>(status.MPI_SOURCE)] = Clock::now();
          peers_[static_cast<std::size_t>(status.MPI_SOURCE)] = in;
        }
        MPI_Irecv(in.words.data(), Progress::kWords, MPI_INT64_T, MPI_ANY_SOURCE, kTag, comm_, &receive);
      }
      std::vector<Watcher> watchers;
      {
        std::lock_guard<std::mutex> taken(watchers_mutex_);
        watchers = watchers_;
      }
      for (const Watcher& w : watchers) {
        std::string failure = w();
        std::lock_guard<std::mutex> failed(mutex_);
        if (!failure.empty() && watcher_failure_.empty()) watcher_failure_ = std::move(failure);
      }
      lock.lock();
      wake_.wait_for(lock, kEvery, [this] { return stopping_; });
    }
    lock.unlock();
    if (receive != MPI_REQUEST_NULL) {
      MPI_Cancel(&receive);
      MPI_Wait(&receive, MPI_STATUS_IGNORE);
    }
    for (MPI_Request& r : sends) {  // a send to a member that is gone may never complete: let MPI drop it
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    }
  }

  /// Sends this rank's progress to every member whose previous beat has left.
  void beat(std::vector<MPI_Request>& sends, std::vector<Progress>& out) {
    const Progress mine = recorder_->progress();
    for (int r = 0; r < size_; ++r) {
      auto& send = sends[static_cast<std::size_t>(r)];
      int done = 1;
      if (r == rank_) continue;
      if (send != MPI_REQUEST_NULL && (MPI_Test(&send, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done)) continue;
      out[static_cast<std::size_t>(r)] = mine;
      MPI_Isend(out[static_cast<std::size_t>(r)].words.data(), Progress::kWords, MPI_INT64_T, r, kTag, comm_, &send);
    }
  }

  MPI_Comm comm_;
  const FlightRecorder* recorder_;
  int rank_ = 0, size_ = 1;
  std::thread thread_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::vector<Clock::time_point> heard_;
  std::vector<Progress> peers_;
  std::mutex watchers_mutex_;
  std::vector<Watcher> watchers_;
  std::string watcher_failure_;
};

}  // namespace volt::detail
