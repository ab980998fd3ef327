#pragma once
// The Profiler callback's trace read back with a JSON reader (nlohmann/json's parser) and checked against what the
// fit did; shared by test/callbacks.cpp (one process) and test/distributed.cpp (2-rank DDP). Catch-free.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <ATen/record_function.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace vt {

/// A regression whose training_step marks a range "batch <i>" (i counts its calls from 0): the trace says which
/// batches it recorded.
struct ProfiledNetImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  int64_t calls = 0;
  ProfiledNetImpl() {
    torch::manual_seed(1);
    lin = register_module("lin", torch::nn::Linear(4, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    const std::string name = "batch " + std::to_string(calls++);
    RECORD_USER_SCOPE(name);
    return torch::mse_loss(lin(b.data), b.target);
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.01)); }
};
TORCH_MODULE(ProfiledNet);

/// What is wrong with the trace at `path` of `rank` that recorded training batches `batches` (empty: nothing), and
/// with `summary` (the callback's table), against it: one process named for the rank; the fit loop's three ranges and
/// the module's "batch i" range once per recorded batch and for no other batch, in order (training_step, then backward,
/// then optimizer_step), each batch's range inside its training_step, ATen ops inside each training_step; the table's
/// calls and total times those of the trace's events.
inline std::string check_profiler_trace(const std::string& path, int rank, const std::vector<int64_t>& batches,
                                        const std::vector<volt::ProfiledOp>& summary) {
  std::ifstream in(path);
  if (!in) return "no trace at " + path;
  nlohmann::json trace;
  try {
    trace = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    return path + " is not JSON: " + e.what();
  }
  std::ostringstream bad;
  const auto& events = trace.at("traceEvents");
  bool named = false;
  struct Span {
    double start, end;
  };
  std::map<std::string, std::vector<Span>> ranges;  // name -> spans
  std::vector<Span> aten;
  std::map<std::string, std::pair<int64_t, double>> totals;  // name -> calls, microseconds
  for (const auto& e : events) {
    const std::string ph = e.at("ph"), name = e.at("name");
    if (ph == "M") {
      if (name == "process_name" && e.at("pid") == rank &&
          e.at("args").at("name").get<std::string>().rfind("rank " + std::to_string(rank) + " ", 0) == 0) {
        named = true;
      }
      continue;
    }
    if (ph != "X") continue;
    if (e.at("pid") != rank) bad << name << " is in process " << e.at("pid") << ", not " << rank << "; ";
    const double ts = e.at("ts"), dur = e.at("dur");
    totals[name].first += 1;
    totals[name].second += dur;
    if (name.rfind("volt::", 0) == 0 || name.rfind("batch ", 0) == 0) ranges[name].push_back({ts, ts + dur});
    if (name.rfind("aten::", 0) == 0) aten.push_back({ts, ts + dur});
  }
  // The profiler lists events in no promised order: in time order here.
  for (auto& [name, spans] : ranges) {
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.start < b.start; });
  }
  if (!named) bad << "no process_name \"rank " << rank << " ...\"; ";
  const std::size_t n = batches.size();
  for (const char* r : {"volt::training_step", "volt::backward", "volt::optimizer_step"}) {
    if (ranges[r].size() != n) bad << r << " " << ranges[r].size() << " times, expected " << n << "; ";
  }
  std::set<int64_t> wanted(batches.begin(), batches.end());
  for (const auto& [name, spans] : ranges) {
    if (name.rfind("batch ", 0) != 0) continue;
    if (!wanted.count(std::stoll(name.substr(6)))) bad << "\"" << name << "\" was not to be recorded; ";
  }
  if (bad.str().empty()) {
    for (std::size_t i = 0; i < n; ++i) {
      const auto& ts = ranges["volt::training_step"][i];
      const auto& bw = ranges["volt::backward"][i];
      const auto& os = ranges["volt::optimizer_step"][i];
      const auto mark = ranges["batch " + std::to_string(batches[i])];
      if (mark.size() != 1) {
        bad << "batch " << batches[i] << " recorded " << mark.size() << " times; ";
        continue;
      }
      // Within the events' clock resolution (a microsecond on LibTorch 1.13). An event's start and duration are each
      // rounded to it, so its end is off by up to a tick, and the ends of two events compared here by up to two (seen:
      // a mark ending 1.25 us after its training_step on a loaded machine).
      constexpr double tick = 2.0;
      if (!(ts.end <= bw.start + tick && bw.end <= os.start + tick)) {
        bad << "batch " << batches[i] << ": ranges out of order; ";
      }
      if (!(mark[0].start + tick >= ts.start && mark[0].end <= ts.end + tick)) {
        bad << std::fixed << "batch " << batches[i] << " (" << mark[0].start << " to " << mark[0].end
            << " us) outside its training_step (" << ts.start << " to " << ts.end << "); ";
      }
      bool op_inside = false;
      for (const auto& a : aten) op_inside = op_inside || (a.start + tick >= ts.start && a.end <= ts.end + tick);
      if (!op_inside) bad << "no ATen op inside training_step " << i << "; ";
    }
  }
  for (const auto& op : summary) {
    const auto it = totals.find(op.name);
    if (it == totals.end()) continue;  // memory events and device activity are not in totals' kind
    if (it->second.first != op.calls || std::abs(it->second.second - op.total_us) > 1e-3 * op.calls + 1e-6) {
      bad << "table: " << op.name << " " << op.calls << " calls, " << op.total_us << " us; trace: "
          << it->second.first << ", " << it->second.second << " us; ";
    }
    if (op.self_us > op.total_us + 1e-9 || op.self_us < -1e-9) {
      bad << "table: " << op.name << " self time out of range; ";
    }
  }
  if (n > 0 && summary.empty()) bad << "the table is empty; ";
  return bad.str();
}

}  // namespace vt
