#pragma once

#include "volt/accelerators/concept.hpp"
#include "volt/accelerators/cpu_speed.hpp"

#include <c10/core/Device.h>

#include <string>
#include <vector>

namespace volt {

/// The host CPU. Always available; `devices` counts processes, not cores.
struct CPU {
  static constexpr c10::DeviceType device_type = c10::DeviceType::CPU;
  static constexpr const char* name = "CPU";
  // LibTorch's CPU autocast lowers to bfloat16; float16 CPU autocast is not offered (Fp16Mixed is a GPU policy).
  static constexpr bool has_fp16_autocast = false;
  static constexpr bool has_bf16_autocast = true;

  static bool is_available() { return true; }
  /// Processes on one host are not limited by a device count.
  static int device_count() { return 1 << 20; }
  static c10::Device device(int /*local_rank*/) { return c10::Device(c10::DeviceType::CPU); }
  static void synchronize(c10::Device /*device*/) {}
  /// What makes a fit on this host much slower than it should be: the reference BLAS, too few or too many threads.
  static std::vector<std::string> slow_settings(int ranks_on_host) { return cpu_slow_settings(ranks_on_host); }
};

}  // namespace volt
