#pragma once
/// \file
/// `FitResult`, and how it travels from a Spawn worker to the main process together with the trained
/// weights: rank 0 packs its module's parameters and buffers (LibTorch's serialize archive), its callback
/// metrics, best checkpoint path and the fit's counters (epoch, optimizer step) into bytes; the main process
/// unpacks them into its own module (on CPU: the main process builds no device) and its Trainer's counters, so
/// `current_epoch()` and `global_step()` read the same there as in the workers, and returns the rest.

#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>

namespace volt {

/// What `fit` returns (in the calling process, also under launchers that run fit elsewhere):
/// the final callback metrics and the best checkpoint's path ("" without checkpointing).
struct FitResult {
  std::map<std::string, double> metrics;
  std::string best_model_path;
};

namespace detail {

/// The run is not `fit`: nothing is brought back to a calling process (a launcher's `transfer` is null).
struct NoTransfer {};

/// Rank 0's module and result, packed in a Spawn worker and unpacked in the main process.
template <class Impl>
struct FitTransfer {
  Impl* module;
  /// The Trainer's completed epochs and optimizer steps: written by rank 0, read back by the main process.
  int64_t* current_epoch = nullptr;
  int64_t* global_step = nullptr;

  std::string pack(const FitResult& result) const {
    torch::serialize::OutputArchive archive;
    module->save(archive);
    std::ostringstream weights;
    archive.save_to(weights);
    std::string out;
    put(out, weights.str());
    put_u64(out, result.metrics.size());
    for (const auto& [name, value] : result.metrics) {
      put(out, name);
      out.append(reinterpret_cast<const char*>(&value), sizeof value);
    }
    put(out, result.best_model_path);
    put_u64(out, static_cast<uint64_t>(current_epoch != nullptr ? *current_epoch : 0));
    put_u64(out, static_cast<uint64_t>(global_step != nullptr ? *global_step : 0));
    return out;
  }

  FitResult unpack(const std::string& bytes) const {
    std::size_t at = 0;
    const std::string weights = get(bytes, at);
    torch::serialize::InputArchive archive;
    std::istringstream in(weights);
    archive.load_from(in, torch::Device(torch::kCPU));
    module->load(archive);
    FitResult result;
    const uint64_t n = get_u64(bytes, at);
    for (uint64_t i = 0; i < n; ++i) {
      std::string name = get(bytes, at);
      double value = 0;
      need(bytes, at, sizeof value);
      std::memcpy(&value, bytes.data() + at, sizeof value);
      at += sizeof value;
      result.metrics.emplace(std::move(name), value);
    }
    result.best_model_path = get(bytes, at);
    const auto epoch = static_cast<int64_t>(get_u64(bytes, at));
    const auto step = static_cast<int64_t>(get_u64(bytes, at));
    if (current_epoch != nullptr) *current_epoch = epoch;
    if (global_step != nullptr) *global_step = step;
    return result;
  }

 private:
  static void put_u64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
  static void put(std::string& out, const std::string& s) {
    put_u64(out, s.size());
    out += s;
  }
  static void need(const std::string& b, std::size_t at, std::size_t n) {
    if (at + n > b.size()) throw std::runtime_error("volt: the result sent by Spawn's rank 0 is truncated.");
  }
  static uint64_t get_u64(const std::string& b, std::size_t& at) {
    uint64_t v = 0;
    need(b, at, sizeof v);
    std::memcpy(&v, b.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  static std::string get(const std::string& b, std::size_t& at) {
    const uint64_t n = get_u64(b, at);
    need(b, at, n);
    std::string s = b.substr(at, n);
    at += n;
    return s;
  }
};

}  // namespace detail
}  // namespace volt
