#pragma once
/// \file
/// `DeviceStatsMonitor`: what the device holds, recorded for the loggers at each logging step of training, as
/// Lightning's DeviceStatsMonitor. Where the module trains on a CUDA device: the caching allocator's statistics
/// (compiled where LibTorch has CUDA, `VOLT_WITH_CUDA=1`; not yet run on a GPU). On the CPU: the process's resident
/// memory and CPU time (Linux's /proc/self/status and getrusage).

#ifndef VOLT_WITH_CUDA
#define VOLT_WITH_CUDA 0
#endif

#include "volt/callbacks/concept.hpp"

#include <c10/core/Device.h>
#include <sys/resource.h>

#if VOLT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

namespace volt {

namespace detail {
/// A `/proc/self/status` field in kB (`VmRSS`, `VmHWM`), as bytes; 0 where it cannot be read.
inline double proc_status_bytes(const char* field) {
  double kb = 0.0;
  if (std::FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    const std::size_t n = std::strlen(field);
    while (std::fgets(line, sizeof line, f)) {
      if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
        kb = std::strtod(line + n + 1, nullptr);
        break;
      }
    }
    std::fclose(f);
  }
  return kb * 1024.0;
}

/// The CPU statistics DeviceStatsMonitor records (names under `<prefix>`): resident memory now and at its peak
/// (VmRSS, VmHWM), user and system CPU seconds of every thread since the process started (getrusage).
inline std::map<std::string, double> cpu_stats(const std::string& prefix) {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& tv) { return static_cast<double>(tv.tv_sec) + static_cast<double>(tv.tv_usec) * 1e-6; };
  return {{prefix + "cpu_rss_mb", proc_status_bytes("VmRSS") / 1e6},
          {prefix + "cpu_peak_rss_mb", proc_status_bytes("VmHWM") / 1e6},
          {prefix + "cpu_user_time_s", seconds(usage.ru_utime)},
          {prefix + "cpu_system_time_s", seconds(usage.ru_stime)}};
}

/// The CUDA caching allocator's statistics for `device` (the aggregate pool), as `torch.cuda.memory_stats` names
/// them; empty where CUDA is not compiled in.
inline std::map<std::string, double> cuda_stats([[maybe_unused]] const c10::Device& device,
                                                [[maybe_unused]] const std::string& prefix) {
#if VOLT_WITH_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  constexpr std::size_t all = 0;  // StatType::AGGREGATE
  const double mb = 1e6;
  return {{prefix + "allocated_bytes.all.current_mb", static_cast<double>(stats.allocated_bytes[all].current) / mb},
          {prefix + "allocated_bytes.all.peak_mb", static_cast<double>(stats.allocated_bytes[all].peak) / mb},
          {prefix + "reserved_bytes.all.current_mb", static_cast<double>(stats.reserved_bytes[all].current) / mb},
          {prefix + "reserved_bytes.all.peak_mb", static_cast<double>(stats.reserved_bytes[all].peak) / mb},
          {prefix + "num_alloc_retries", static_cast<double>(stats.num_alloc_retries)},
          {prefix + "num_ooms", static_cast<double>(stats.num_ooms)}};
#else
  return {};
#endif
}
}  // namespace detail

/// Records device statistics at every logging step of training (`log_every_n_steps`), under `device_stats/`:
/// on a CUDA device `allocated_bytes.all.current_mb`, `..._peak_mb`, `reserved_bytes.all.current_mb`, `..._peak_mb`,
/// `num_alloc_retries`, `num_ooms`; always the process's `cpu_rss_mb`, `cpu_peak_rss_mb`, `cpu_user_time_s` and
/// `cpu_system_time_s` (the whole process, every thread, since it started).
class DeviceStatsMonitor {
 public:
  template <class T, class M, class L, class B>
  void on_train_batch_end(T& trainer, M&, const L&, const B&, int64_t) {
    if (!trainer.logs_this_batch()) return;
    auto values = detail::cpu_stats("device_stats/");
    if (const c10::Device device = trainer.strategy().root_device(); device.is_cuda()) {
      values.merge(detail::cuda_stats(device, "device_stats/"));
    }
    trainer.record_metrics(values);
  }
};

}  // namespace volt
