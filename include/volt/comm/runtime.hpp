#pragma once
/// \file
/// The MPI side of a process: initialisation (Boost.MPI's environment, once per process), a process group
/// with a failure channel, and waits that never hang on a dead peer.
///
/// Failure model. Every wait volt does on MPI is a polling loop (`MPI_Test`, or a collective thread's ticket) that
/// also watches
///  - a failure channel: a rank whose body throws sends who failed and its message to every other member (and to a
///    Spawn parent) before it rethrows; a waiting member throws `volt::RankFailure` carrying both;
///  - the peers' processes: members on the same host whose PIDs this process can see (`Peer::visible`) are checked
///    with `kill(pid, 0)`, so a peer that died without a word (a crash, SIGKILL) is noticed at once;
///  - the peers' heartbeats (watchdog.hpp): a member on any host not heard from for `Heartbeat::kSilentLimit` (or the
///    timeout, when shorter) is gone, and the waiting member says so, announces it and throws `RankFailure`;
///  - the collective timeout (`TrainerOptions::timeout`, Lightning's 30 minutes): a collective not complete by then
///    ends the job with one message naming this rank and host, the collective (kind, number, step, bucket), the
///    members that had not issued it yet (from their heartbeats) and this rank's last collectives.
/// A process whose group failed never calls `MPI_Finalize` (it would wait for the dead), so the job ends
/// with the failing rank's message and a non-zero exit instead of a hang.

#include "volt/comm/hosts.hpp"
#include "volt/comm/watchdog.hpp"
#include "volt/errors.hpp"

#include <boost/mpi/communicator.hpp>
#include <boost/mpi/collectives/all_gather.hpp>
#include <boost/mpi/collectives/broadcast.hpp>
#include <boost/mpi/environment.hpp>
#include <boost/serialization/string.hpp>
#include <boost/serialization/utility.hpp>
#include <boost/serialization/vector.hpp>
#include <mpi.h>

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace volt {

namespace detail {

inline constexpr int kFailureTag = 31001;  // failure notices, on the failure channel
inline constexpr int kResultTag = 31002;   // Spawn: rank 0's result to the main process
inline constexpr int kErrorTag = 31003;    // Spawn: a worker's failure to the main process
inline constexpr int kHelloTag = 31004;    // Spawn: a worker's pid and host to the main process
inline constexpr int kInterruptedTag = 31005;  // Spawn: the workers stopped on a signal ("<signal> <checkpoint>")
inline constexpr std::size_t kMessageCap = 8192;

inline void mpi_check(int code, const char* what) {
  if (code != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(code, text, &len);
    throw std::runtime_error(std::string("volt: ") + what + " failed: " + std::string(text, static_cast<std::size_t>(len)));
  }
}

/// A process of the job, as another member sees it.
struct Peer {
  int rank = 0;
  int pid = 0;
  std::string host;
  /// On this host and in this PID namespace: `kill(pid, 0)` tells whether it has ended.
  bool visible = false;
};

/// Whether `pid` on this host has ended.
inline bool process_gone(int pid) { return pid > 0 && ::kill(pid, 0) == -1 && errno == ESRCH; }

/// MPI for this process: initialised once (lazily, when a distributed run first launches) and finalised
/// at exit, unless a group failed. Leaked on purpose: it must outlive every static that might use MPI.
class MpiRuntime {
 public:
  static MpiRuntime& instance() {
    static MpiRuntime* runtime = new MpiRuntime();
    return *runtime;
  }

  void ensure_initialized() {
    if (env_) return;
    int already = 0;
    MPI_Initialized(&already);
    if (already) {
      external_ = true;  // the program initialised MPI itself; it finalises it too
    } else {
      env_ = std::make_unique<boost::mpi::environment>(boost::mpi::threading::multiple, /*abort_on_exception=*/false);
      std::atexit(&MpiRuntime::at_exit);
    }
    if (!external_ && !env_) throw std::runtime_error("volt: MPI could not be initialised.");
    MPI_Comm_get_parent(&parent_);
  }
  bool initialized() const {
    int flag = 0;
    MPI_Initialized(&flag);
    return flag != 0;
  }
  /// The intercommunicator to the process that spawned this one (MPI_COMM_NULL when none).
  MPI_Comm parent() const { return parent_; }

  /// After a failure: never finalise (peers may be dead), and let nothing disconnect.
  void mark_failed() { failed_ = true; }
  bool failed() const { return failed_; }

  /// Intercommunicators to disconnect before MPI_Finalize (after everything in close_at_exit).
  void disconnect_at_exit(MPI_Comm comm) { to_disconnect_.push_back(comm); }
  /// Something to close before those (a group's own communicators); run in reverse order of registration.
  void close_at_exit(std::function<void()> close) { to_close_.push_back(std::move(close)); }

 private:
  MpiRuntime() = default;

  static void at_exit() {
    MpiRuntime& r = instance();
    if (r.failed_ || !r.env_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto it = r.to_close_.rbegin(); it != r.to_close_.rend(); ++it) (*it)();
    r.to_close_.clear();
    for (auto it = r.to_disconnect_.rbegin(); it != r.to_disconnect_.rend(); ++it) {
      if (*it != MPI_COMM_NULL) MPI_Comm_disconnect(&*it);
    }
    r.to_disconnect_.clear();
    r.env_.reset();  // MPI_Finalize
  }

  std::unique_ptr<boost::mpi::environment> env_;
  bool external_ = false;
  bool failed_ = false;
  MPI_Comm parent_ = MPI_COMM_NULL;
  std::vector<MPI_Comm> to_disconnect_;
  std::vector<std::function<void()>> to_close_;
};

/// The processes of one job and the communicator their collectives run on, with its failure channel.
class MpiGroup {
 public:
  /// `comm` is duplicated (twice: work and failure channel); `parent` is a Spawn worker's link to the
  /// main process (MPI_COMM_NULL otherwise). Collective over `comm`: the members' host names, PIDs and kernels are
  /// gathered, and give each its local and node rank (`place`).
  explicit MpiGroup(MPI_Comm comm, MPI_Comm parent = MPI_COMM_NULL) : parent_(parent) {
    mpi_check(MPI_Comm_dup(comm, &work_), "MPI_Comm_dup");
    mpi_check(MPI_Comm_dup(comm, &failure_), "MPI_Comm_dup");
    mpi_check(MPI_Comm_dup(comm, &beat_), "MPI_Comm_dup");
    for (MPI_Comm c : {work_, failure_, beat_}) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);  // errors are thrown
    MPI_Comm_rank(work_, &rank_);
    MPI_Comm_size(work_, &size_);
    boost::mpi::communicator bc(work_, boost::mpi::comm_attach);
    const std::string here = host_name(), kernel = kernel_identity();
    std::vector<std::pair<int, std::pair<std::string, std::string>>> all;
    boost::mpi::all_gather(bc, std::make_pair(static_cast<int>(::getpid()), std::make_pair(here, kernel)), all);
    std::vector<std::string> hosts;
    for (const auto& member : all) hosts.push_back(member.second.first);
    const Placement placement = place(hosts);
    local_rank_ = placement.local_rank[static_cast<std::size_t>(rank_)];
    node_rank_ = placement.node_rank[static_cast<std::size_t>(rank_)];
    nodes_ = placement.nodes;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const auto& [pid, where] = all[static_cast<std::size_t>(r)];
      peers_.push_back(Peer{r, pid, where.first, where.first == here && !kernel.empty() && where.second == kernel});
    }
    post_failure_receive();
    heartbeat_ = std::make_unique<Heartbeat>(beat_, recorder_);
    heartbeat_->start();
    MpiRuntime::instance().close_at_exit([this] { close(); });
  }
  MpiGroup(const MpiGroup&) = delete;
  MpiGroup& operator=(const MpiGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int node_rank() const { return node_rank_; }
  /// The number of hosts the members run on.
  int nodes() const { return nodes_; }
  MPI_Comm comm() const { return work_; }
  MPI_Comm parent() const { return parent_; }
  bool failed() const { return failed_; }

  /// How long a collective may wait before the job ends (TrainerOptions::timeout).
  void set_timeout(Clock::duration timeout) { timeout_ = timeout; }
  Clock::duration timeout() const { return timeout_; }
  /// Records a collective (or a send or receive) about to be issued on `comm()`, on a mesh axis of it or by a backend of
  /// this group; returns its number for wait.
  uint64_t record(Collective kind, int64_t bytes, Route route = {}) { return recorder_.issue(kind, bytes, route); }
  const FlightRecorder& recorder() const { return recorder_; }
  FlightRecorder& recorder() { return recorder_; }
  /// Adds a check the heartbeat thread runs at every beat (a backend's device work); a message it returns ends the
  /// job at this rank's next wait.
  void add_watcher(Heartbeat::Watcher w) { heartbeat_->add_watcher(std::move(w)); }

  /// Waits for `request` (collective number `seq`, 0 for none), throwing RankFailure if another member fails, dies or
  /// falls silent meanwhile, or when the timeout passes. `members`: the ranks the collective runs among (a mesh axis;
  /// empty: all), which the timeout's message looks at.
  void wait(MPI_Request& request, uint64_t seq = 0, std::span<const int> members = {}) {
    const auto done = [&request] {
      int finished = 0;
      mpi_check(MPI_Test(&request, &finished, MPI_STATUS_IGNORE), "MPI_Test");
      return finished != 0;
    };
    wait_until(done, [] { ::sched_yield(); }, seq, members);
  }
  /// The same for any work that `done()` says has finished; `pause()` runs between the checks (a yield, or a short
  /// wait on the work).
  template <class Done, class Pause>
  void wait_until(Done&& done, Pause&& pause, uint64_t seq = 0, std::span<const int> members = {}) {
    const auto started = Clock::now();
    auto next_check = started;
    while (!done()) {
      pause();  // first: MPI calls from this thread at the start of a collective slow the thread that runs it
      if (done()) break;
      poll_failures();
      const auto now = Clock::now();
      if (now >= next_check) {
        next_check = now + std::chrono::milliseconds(100);
        if (check_peers_alive(done, seq)) break;
        check_watchdog(seq, now - started, members);
      }
    }
    if (seq != 0) recorder_.complete(seq);
  }

  /// The largest of every member's `value` (an MPI allreduce on the host: no device is synchronised).
  int max_over_ranks(int value) {
    int out = value;
    MPI_Request request;
    const uint64_t seq = record(Collective::agreement, sizeof value);
    mpi_check(MPI_Iallreduce(&value, &out, 1, MPI_INT, MPI_MAX, work_, &request), "MPI_Iallreduce");
    wait(request, seq);
    return out;
  }

  /// Every member's `bytes`, in rank order (MPI allgathers of the sizes, then of the bytes).
  std::vector<std::string> all_gather_bytes(const std::string& bytes) {
    const long long mine = static_cast<long long>(bytes.size());
    std::vector<long long> sizes(static_cast<std::size_t>(size_));
    MPI_Request request;
    uint64_t seq = record(Collective::exchange, sizeof mine);
    mpi_check(MPI_Iallgather(&mine, 1, MPI_LONG_LONG, sizes.data(), 1, MPI_LONG_LONG, work_, &request), "MPI_Iallgather");
    wait(request, seq);
    std::vector<int> counts(sizes.size()), displs(sizes.size());
    long long total = 0;
    for (std::size_t r = 0; r < sizes.size(); ++r) {
      if (sizes[r] > INT_MAX || total + sizes[r] > INT_MAX) {
        throw std::runtime_error("volt: gathering " + std::to_string(total + sizes[r]) + " bytes across ranks is "
                                 "more than one MPI message holds (2 GiB); write large results with a callback.");
      }
      counts[r] = static_cast<int>(sizes[r]);
      displs[r] = static_cast<int>(total);
      total += sizes[r];
    }
    std::string all(static_cast<std::size_t>(total), '\0');
    seq = record(Collective::exchange, total);
    mpi_check(MPI_Iallgatherv(bytes.data(), static_cast<int>(mine), MPI_BYTE, all.data(), counts.data(), displs.data(),
                              MPI_BYTE, work_, &request),
              "MPI_Iallgatherv");
    wait(request, seq);
    std::vector<std::string> out;
    for (std::size_t r = 0; r < sizes.size(); ++r) out.push_back(all.substr(static_cast<std::size_t>(displs[r]), static_cast<std::size_t>(counts[r])));
    return out;
  }

  /// Throws RankFailure if a failure notice has arrived (cheap: one MPI_Test).
  void poll_failures() {
    if (failed_) throw RankFailure(failed_rank_, failure_message_);
    int arrived = 0;
    MPI_Status status;
    MPI_Test(&failure_request_, &arrived, &status);
    if (arrived) {  // the rank that failed (4 bytes), then the message
      int len = 0, failed = status.MPI_SOURCE;
      MPI_Get_count(&status, MPI_CHAR, &len);
      if (len >= static_cast<int>(sizeof failed)) std::memcpy(&failed, failure_buffer_.data(), sizeof failed);
      const std::size_t skip = std::min<std::size_t>(sizeof failed, static_cast<std::size_t>(std::max(len, 0)));
      on_failure(failed, std::string(failure_buffer_.data() + skip, static_cast<std::size_t>(len) - skip));
    }
  }

  /// Before MPI_Finalize: withdraw the failure receive and free the group's communicators (the launcher
  /// disconnects the intercommunicator they came from afterwards).
  void close() {
    heartbeat_->stop();
    if (beat_ != MPI_COMM_NULL) MPI_Comm_free(&beat_);
    if (failure_request_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&failure_request_);
      MPI_Wait(&failure_request_, MPI_STATUS_IGNORE);
    }
    if (failure_ != MPI_COMM_NULL) MPI_Comm_free(&failure_);
    if (work_ != MPI_COMM_NULL) MPI_Comm_free(&work_);
  }

  /// This member failed with `message` (or found rank `failed` gone: -1 for this member): tell every other member
  /// (and a Spawn parent) who failed and why, briefly wait for the notices to leave, and mark the process so it never
  /// finalises. Never throws.
  void announce_failure(const std::string& message, int failed = -1) noexcept {
    if (failed_) return;  // already failing because of someone else: nothing new to say
    failed_ = true;
    heartbeat_->stop();
    failed_rank_ = failed < 0 ? rank_ : failed;
    failure_message_ = message;
    MpiRuntime::instance().mark_failed();
    const std::string text = message.substr(0, kMessageCap - 1 - sizeof failed_rank_);
    std::string notice(sizeof failed_rank_, '\0');
    std::memcpy(notice.data(), &failed_rank_, sizeof failed_rank_);
    notice += text;
    std::vector<MPI_Request> sends;
    for (const Peer& p : peers_) {
      MPI_Request r;
      if (MPI_Isend(notice.data(), static_cast<int>(notice.size()), MPI_CHAR, p.rank, kFailureTag, failure_, &r) == MPI_SUCCESS) {
        sends.push_back(r);
      }
    }
    if (parent_ != MPI_COMM_NULL) {
      MPI_Request r;
      if (MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, 0, kErrorTag, parent_, &r) == MPI_SUCCESS) {
        sends.push_back(r);
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (MPI_Request& r : sends) {
      int done = 0;
      while (!done && std::chrono::steady_clock::now() < deadline) {
        MPI_Test(&r, &done, MPI_STATUS_IGNORE);
        if (!done) ::sched_yield();
      }
    }
  }

 private:
  void post_failure_receive() {
    failure_buffer_.assign(kMessageCap, '\0');
    mpi_check(MPI_Irecv(failure_buffer_.data(), static_cast<int>(kMessageCap), MPI_CHAR, MPI_ANY_SOURCE, kFailureTag,
                        failure_, &failure_request_),
              "MPI_Irecv");
  }

  [[noreturn]] void on_failure(int rank, std::string message) {
    heartbeat_->stop();
    failed_ = true;
    failed_rank_ = rank;
    failure_message_ = std::move(message);
    MpiRuntime::instance().mark_failed();
    throw RankFailure(failed_rank_, failure_message_);
  }

  /// A member on this host whose process has ended (killed, crashed): announced to the others, then thrown here.
  /// Returns true when the work finished after all (the member's last message completed it before it left).
  template <class Done>
  bool check_peers_alive(Done& done, uint64_t seq) {
    for (const Peer& p : peers_) {
      if (!p.visible || !process_gone(p.pid)) continue;
      if (done()) return true;
      poll_failures();
      give_up(p.rank, "volt: rank " + std::to_string(p.rank) + " (pid " + std::to_string(p.pid) + " on " + p.host +
                          ") ended without a message (killed or crashed) while rank " + std::to_string(rank_) +
                          " was waiting for " + waiting_for(seq) + ".");
    }
    return false;
  }

  /// While waiting for collective `seq` (0: a message) for `waited`: a watcher's failure, a member silent for longer
  /// than the heartbeat's limit, or the timeout end the job (announced, then thrown here).
  void check_watchdog(uint64_t seq, Clock::duration waited, std::span<const int> members) {
    if (std::string failure = heartbeat_->watcher_failure(); !failure.empty()) give_up(rank_, failure);
    const auto limit = std::min<Clock::duration>(Heartbeat::kSilentLimit, timeout_);
    if (const auto [r, quiet] = heartbeat_->silent(limit); r >= 0) {
      const Progress last = heartbeat_->peer(r).first;
      give_up(r, "volt: rank " + std::to_string(r) + " on " + host_of(r) + " has not been heard from for " +
                     seconds_text(quiet) + " while rank " + std::to_string(rank_) + " on " + host_name() +
                     " waited for " + waiting_for(seq) + ": its process ended, its host stopped or the link to it is "
                     "down. Its last heartbeat said: " +
                     (last.issued() == 0 ? std::string("no collective issued yet")
                                         : "last issued " + last.last_issued() + ", completed up to #" +
                                               std::to_string(last.completed())) +
                     ".");
    }
    if (waited >= timeout_) give_up(-1, timeout_message(seq, waited, members));
  }

  /// The collective timeout's message: what this rank waited for, who had not issued it (among `members`; a send's or
  /// receive's peer), this rank's record.
  std::string timeout_message(uint64_t seq, Clock::duration waited, std::span<const int> members) const {
    const FlightEntry waited_for = seq != 0 ? recorder_.entry(seq) : FlightEntry{};
    const bool p2p = waited_for.seq != 0 && point_to_point(waited_for.kind);
    const auto involved = [&](int r) {
      if (p2p) return r == waited_for.route.peer;
      return members.empty() || std::find(members.begin(), members.end(), r) != members.end();
    };
    std::string behind;
    for (const Peer& p : peers_) {
      if (!involved(p.rank)) continue;
      const auto [progress, ago] = heartbeat_->peer(p.rank);
      if (!p2p && heartbeat_->running() && seq != 0 && progress.issued() >= seq) continue;
      behind += (behind.empty() ? "" : "; ") + std::string("rank ") + std::to_string(p.rank) + " on " + p.host +
                (heartbeat_->running() ? " (last issued " + progress.last_issued() + ", heard " + seconds_text(ago) +
                                             " ago)"
                                       : "");
    }
    if (!heartbeat_->running()) behind = "unknown (no heartbeats: MPI was initialised without MPI_THREAD_MULTIPLE)";
    return "volt: rank " + std::to_string(rank_) + " on " + host_name() + " waited " + seconds_text(waited) + " for " +
           waiting_for(seq) + ", longer than the collective timeout (TrainerOptions::timeout, " +
           seconds_text(timeout_) + (p2p ? "). Its peer: " : "). Members that had not issued it: ") +
           (behind.empty() ? "none (every member issued it; one has stopped inside it)" : behind) + ". Rank " +
           std::to_string(rank_) + "'s last collectives: " + recorder_.recent(6) + ".";
  }
  std::string waiting_for(uint64_t seq) const {
    if (seq == 0) return "a message";
    const FlightEntry e = recorder_.entry(seq);
    return e.seq == seq ? describe(e) : "collective #" + std::to_string(seq);
  }
  std::string host_of(int rank) const {
    for (const Peer& p : peers_) {
      if (p.rank == rank) return p.host;
    }
    return host_name();
  }
  [[noreturn]] void give_up(int rank, const std::string& message) {
    announce_failure(message, rank);
    throw RankFailure(rank, message);
  }

  int rank_ = 0, size_ = 1, local_rank_ = 0, node_rank_ = 0, nodes_ = 1;
  MPI_Comm work_ = MPI_COMM_NULL, failure_ = MPI_COMM_NULL, beat_ = MPI_COMM_NULL, parent_ = MPI_COMM_NULL;
  FlightRecorder recorder_;
  std::unique_ptr<Heartbeat> heartbeat_;
  Clock::duration timeout_ = std::chrono::minutes(30);
  std::vector<Peer> peers_;
  MPI_Request failure_request_ = MPI_REQUEST_NULL;
  std::vector<char> failure_buffer_;
  bool failed_ = false;
  int failed_rank_ = -1;
  std::string failure_message_;
};

}  // namespace detail
}  // namespace volt
