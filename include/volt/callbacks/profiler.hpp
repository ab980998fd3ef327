#pragma once
/// \file
/// `Profiler`: LibTorch's profiler over a window of training steps, as Lightning's `profiler="pytorch"` with
/// PyTorch's `schedule(skip_first, wait, warmup, active)`: a Chrome trace per rank (`chrome://tracing`, Perfetto,
/// TensorBoard's profiler plugin open it) and a table of the slowest ops at the end of the window. The fit loop marks
/// its own ranges (`volt::training_step`, `volt::backward`, `volt::optimizer_step`), so a step's parts show in the
/// trace around the ATen ops they ran.
///
/// The trace is written by volt from the profiler's events, the same way on every LibTorch line: Debian's LibTorch
/// 1.13 is built without Kineto, whose own writer (`ProfilerResult::save`) it lacks. Events: the ops and ranges of
/// the training thread (as "X" complete events, with input shapes when recorded), memory events ("i" instant events
/// with the bytes allocated or freed, when recorded), and on a CUDA device the kernels and copies Kineto saw.

#include "volt/callbacks/concept.hpp"
#include "volt/checkpoint.hpp"
#include "volt/errors.hpp"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#ifndef VOLT_WITH_CUDA
#define VOLT_WITH_CUDA 0
#endif

namespace volt {

/// Which training batches the profiler records, and what it writes. Batches count from the fit's first (a resumed
/// fit's first batch is batch 0 again): `skip_first` and `wait` batches are not profiled, `warmup` batches are with
/// the profiler prepared but not recording (its start-up cost stays out of the trace), then `active` batches are
/// recorded; the trace is written when the last of them ends, or when the fit ends first.
struct ProfilerOptions {
  std::string dirpath;             ///< empty: `<default_root_dir>/profiler`
  std::string filename = "trace";  ///< each rank's file: `<dirpath>/<filename>.rank<R>.pt.trace.json`
  int64_t skip_first = 0;
  int64_t wait = 1;
  int64_t warmup = 1;
  int64_t active = 3;
  bool record_shapes = false;   ///< input shapes of each op, in the trace's args
  bool profile_memory = false;  ///< allocations and frees, as instant events
  int64_t row_limit = 15;       ///< rows of the table printed on rank zero (0: none)
};

/// One op or range's totals over the recorded window: `self_us` leaves out the time of ops nested inside it.
struct ProfiledOp {
  std::string name;
  int64_t calls = 0;
  double total_us = 0.0, self_us = 0.0;
};

namespace detail {

/// An event as the trace and the table use it: `start_ns`/`dur_ns` on the profiler's clock; `device`: "cpu" or the
/// device type's name; `bytes` for memory events.
struct TraceEvent {
  std::string name;
  std::string device = "cpu";
  int device_index = -1;
  uint64_t thread = 0;
  int64_t stream = 0;
  uint64_t start_ns = 0, dur_ns = 0;
  int64_t bytes = 0;
  bool memory = false;
  std::vector<std::vector<int64_t>> shapes;
};

inline std::vector<TraceEvent> trace_events(const torch::autograd::profiler::ProfilerResult& result) {
  std::vector<TraceEvent> out;
  out.reserve(result.events().size());
  for (const auto& e : result.events()) {
    TraceEvent t;
    t.name = e.name();
    t.memory = t.name == "[memory]";
    t.bytes = e.nBytes();
    t.thread = e.startThreadId();
#if TORCH_VERSION_MAJOR >= 2
    t.start_ns = e.startNs();
    t.dur_ns = e.durationNs();
#else
    t.start_ns = e.startUs() * 1000;
    t.dur_ns = e.durationUs() * 1000;
#endif
    if (e.deviceType() != c10::DeviceType::CPU && !t.memory) {
      t.device = c10::DeviceTypeName(e.deviceType(), /*lower_case=*/true);
      t.device_index = static_cast<int>(e.deviceIndex());
      t.stream = e.deviceResourceId();
    }
    if (e.hasShapes()) t.shapes.assign(e.shapes().begin(), e.shapes().end());
    out.push_back(std::move(t));
  }
  return out;
}

/// Totals by name over `events` (host ops and ranges; memory events are not ops), the slowest by self time first.
/// An event's self time is its duration less that of the events directly inside it on the same thread.
inline std::vector<ProfiledOp> op_table(std::vector<TraceEvent> events) {
  std::erase_if(events, [](const TraceEvent& e) { return e.memory || e.device != "cpu"; });
  std::sort(events.begin(), events.end(), [](const TraceEvent& a, const TraceEvent& b) {
    if (a.thread != b.thread) return a.thread < b.thread;
    if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
    return a.dur_ns > b.dur_ns;  // the enclosing event first
  });
  std::vector<double> self(events.size());
  std::vector<std::size_t> open;  // indices of the events enclosing the current one, innermost last
  for (std::size_t i = 0; i < events.size(); ++i) {
    const TraceEvent& e = events[i];
    self[i] = static_cast<double>(e.dur_ns);
    while (!open.empty()) {
      const TraceEvent& o = events[open.back()];
      // Inside `o` if it starts before `o` ends: calls nest on a thread (the events' clock may be as coarse as a
      // microsecond, so an end is not compared).
      const uint64_t o_end = o.start_ns + o.dur_ns;
      if (o.thread == e.thread && (e.start_ns < o_end || e.start_ns + e.dur_ns <= o_end)) break;
      open.pop_back();
    }
    if (!open.empty()) self[open.back()] -= static_cast<double>(e.dur_ns);
    open.push_back(i);
  }
  std::map<std::string, ProfiledOp> by_name;
  for (std::size_t i = 0; i < events.size(); ++i) {
    ProfiledOp& op = by_name[events[i].name];
    op.name = events[i].name;
    ++op.calls;
    op.total_us += static_cast<double>(events[i].dur_ns) / 1e3;
    op.self_us += self[i] / 1e3;
  }
  std::vector<ProfiledOp> table;
  for (auto& [name, op] : by_name) table.push_back(std::move(op));
  std::stable_sort(table.begin(), table.end(),
                   [](const ProfiledOp& a, const ProfiledOp& b) { return a.self_us > b.self_us; });
  return table;
}

/// The Chrome trace event format's JSON for `events`: process `rank` (named "rank R" with the operating system's
/// pid), a thread per host thread, a process per device ("rank R cuda:0", a thread per stream).
inline nlohmann::json chrome_trace(const std::vector<TraceEvent>& events, int rank) {
  using nlohmann::json;
  json list = json::array();
  std::set<std::pair<int, uint64_t>> threads;
  std::set<int> devices;
  for (const TraceEvent& e : events) {
    const int pid = e.device == "cpu" ? rank : 1000 * (rank + 1) + std::max(e.device_index, 0);
    const uint64_t tid = e.device == "cpu" ? e.thread : static_cast<uint64_t>(e.stream);
    json ev = {{"name", e.name}, {"pid", pid}, {"tid", tid}, {"ts", static_cast<double>(e.start_ns) / 1e3}};
    if (e.memory) {
      ev.update({{"ph", "i"}, {"s", "t"}, {"cat", "cpu_instant_event"}, {"args", {{"Bytes", e.bytes}}}});
    } else {
      ev.update({{"ph", "X"}, {"dur", static_cast<double>(e.dur_ns) / 1e3},
                 {"cat", e.device == "cpu" ? "cpu_op" : "kernel"}});
      if (!e.shapes.empty()) ev["args"] = {{"Input Dims", e.shapes}};
    }
    list.push_back(std::move(ev));
    threads.emplace(pid, tid);
    if (e.device != "cpu") devices.insert(std::max(e.device_index, 0));
  }
  auto meta = [&](const char* what, int pid, uint64_t tid, const std::string& name) {
    list.push_back({{"ph", "M"}, {"name", what}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}});
  };
  meta("process_name", rank, 0, "rank " + std::to_string(rank) + " (pid " + std::to_string(::getpid()) + ")");
  for (const int d : devices) {
    meta("process_name", 1000 * (rank + 1) + d, 0, "rank " + std::to_string(rank) + " device " + std::to_string(d));
  }
  for (const auto& [pid, tid] : threads) {
    meta("thread_name", pid, tid, (pid == rank ? "thread " : "stream ") + std::to_string(tid));
  }
  return {{"traceEvents", std::move(list)}, {"displayTimeUnit", "ms"}, {"schemaVersion", 1}};
}

/// The table Profiler prints: the `rows` slowest ops by self time.
inline std::string format_op_table(const std::vector<ProfiledOp>& table, std::size_t rows, int64_t steps) {
  double self_total = 0.0;
  for (const auto& op : table) self_total += op.self_us;
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof line, "%-44s %8s %12s %7s %12s %12s\n", "op (slowest by self time)", "calls", "self ms",
                "self %", "total ms", "per step ms");
  out << line;
  for (std::size_t i = 0; i < std::min(rows, table.size()); ++i) {
    const auto& op = table[i];
    const std::string name = op.name.size() > 44 ? op.name.substr(0, 41) + "..." : op.name;
    std::snprintf(line, sizeof line, "%-44s %8lld %12.3f %6.1f%% %12.3f %12.3f\n", name.c_str(),
                  static_cast<long long>(op.calls), op.self_us / 1e3,
                  self_total > 0 ? 100.0 * op.self_us / self_total : 0.0, op.total_us / 1e3,
                  op.total_us / 1e3 / static_cast<double>(std::max<int64_t>(steps, 1)));
    out << line;
  }
  return out.str();
}

}  // namespace detail

/// Profiles a window of training batches with LibTorch's profiler (see ProfilerOptions), on every rank: each writes
/// its trace, rank zero prints the table of its slowest ops. `summary()` holds the table after the window.
class Profiler {
 public:
  explicit Profiler(ProfilerOptions o = {}) : o_(std::move(o)) {
    for (const auto& [name, v] : {std::pair{"skip_first", o_.skip_first}, std::pair{"wait", o_.wait},
                                  std::pair{"warmup", o_.warmup}, std::pair{"row_limit", o_.row_limit}}) {
      if (v < 0) {
        throw ConfigError("Profiler: " + std::string(name) + " = " + std::to_string(v) + "; allowed: 0 or more");
      }
    }
    if (o_.active < 1) throw ConfigError("Profiler: active = " + std::to_string(o_.active) + "; allowed: 1 or more");
    if (o_.filename.empty() || o_.filename.find('/') != std::string::npos) {
      throw ConfigError("Profiler: filename \"" + o_.filename + "\"; allowed: a file name without a folder");
    }
  }
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;
  Profiler(Profiler&& other) noexcept : o_(std::move(other.o_)), path_(std::move(other.path_)),
                                        summary_(std::move(other.summary_)) {}
  ~Profiler() { abandon(); }

  template <class T, class M>
  void on_fit_start(T& trainer, M&) {
    batch_ = 0;
    steps_recorded_ = 0;
    const std::string dir = o_.dirpath.empty()
                                ? (std::filesystem::path(trainer.options().default_root_dir) / "profiler").string()
                                : o_.dirpath;
    rank_ = trainer.strategy().global_rank();
    path_ = (std::filesystem::path(dir) / (o_.filename + ".rank" + std::to_string(rank_) + ".pt.trace.json")).string();
    print_ = trainer.strategy().is_global_zero() && o_.row_limit > 0;
    cuda_ = trainer.strategy().root_device().is_cuda();
  }
  template <class T, class M, class B>
  void on_train_batch_start(T&, M&, const B&, int64_t) {
    const int64_t start = o_.skip_first + o_.wait;
    if (batch_ == start && o_.warmup > 0) prepare();
    if (batch_ == start + o_.warmup) enable();
  }
  template <class T, class M, class L, class B>
  void on_train_batch_end(T&, M&, const L&, const B&, int64_t) {
    if (state_ == State::recording) ++steps_recorded_;
    if (batch_++ == o_.skip_first + o_.wait + o_.warmup + o_.active - 1) finish();
  }
  template <class T, class M>
  void on_fit_end(T&, M&) {
    if (state_ == State::recording) finish();  // the fit ended inside the window: what was recorded
    abandon();
  }
  template <class T, class M>
  void on_exception(T&, M&, std::exception_ptr) { abandon(); }

  /// Each rank's trace file (set at the fit's start).
  const std::string& trace_path() const { return path_; }
  /// The ops of the last window, the slowest by self time first (all of them, not only the printed rows).
  const std::vector<ProfiledOp>& summary() const { return summary_; }
  /// The training batches the last window recorded.
  int64_t steps_recorded() const { return steps_recorded_; }

 private:
  enum class State { off, prepared, recording };

  torch::profiler::impl::ProfilerConfig config() const {
    return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO, o_.record_shapes,
                                                 o_.profile_memory);
  }
  std::set<torch::profiler::impl::ActivityType> activities() const {
    std::set<torch::profiler::impl::ActivityType> a{torch::profiler::impl::ActivityType::CPU};
    if (VOLT_WITH_CUDA && cuda_) a.insert(torch::profiler::impl::ActivityType::CUDA);
    return a;
  }
  void prepare() {
    torch::autograd::profiler::prepareProfiler(config(), activities());
    state_ = State::prepared;
  }
  void enable() {
    if (state_ == State::off) prepare();
    try {
      torch::autograd::profiler::enableProfiler(config(), activities());
    } catch (const c10::Error& e) {
      state_ = State::off;
      throw ConfigError("Profiler: LibTorch's profiler could not start (is another profiler running in this "
                        "thread?): " + std::string(e.what_without_backtrace()));
    }
    state_ = State::recording;
  }
  void finish() {
    if (state_ != State::recording) {
      state_ = State::off;
      return;
    }
    state_ = State::off;
    const auto result = torch::autograd::profiler::disableProfiler();
    const auto events = detail::trace_events(*result);
    std::filesystem::create_directories(std::filesystem::path(path_).parent_path());
    const std::string text = detail::chrome_trace(events, rank_).dump();
    checkpoint::write_atomic(path_, text.data(), text.size());
    summary_ = detail::op_table(events);
    if (print_) {
      std::cout << "volt Profiler: " << steps_recorded_ << " training batches recorded; rank " << rank_
                << "'s trace: " << path_ << "\n"
                << detail::format_op_table(summary_, static_cast<std::size_t>(o_.row_limit), steps_recorded_)
                << std::flush;
    }
  }
  /// Stops a profiler left running (an exception, a window never ended) without writing anything.
  void abandon() noexcept {
    if (state_ == State::off) return;
    state_ = State::off;
    try {
      (void)torch::autograd::profiler::disableProfiler();
    } catch (...) {
    }
  }

  ProfilerOptions o_;
  std::string path_;
  std::vector<ProfiledOp> summary_;
  State state_ = State::off;
  int64_t batch_ = 0, steps_recorded_ = 0;
  int rank_ = 0;
  bool print_ = false, cuda_ = false;
};

}  // namespace volt
