#pragma once
// The examples' choice of device (`--run.device=auto|cpu|cuda`): an enumeration a configuration names
// (volt_enum_names), resolved once at the top of a program to one of the Trainer types it compiled.

#include <volt/volt.hpp>

#include <array>
#include <string_view>
#include <utility>

/// Where an example trains: the GPU where CUDA sees one (auto), the CPU, or the GPU.
enum class Device { automatic, cpu, cuda };

constexpr auto volt_enum_names(Device) {
  using P = std::pair<Device, std::string_view>;
  return std::array{P{Device::automatic, "auto"}, P{Device::cpu, "cpu"}, P{Device::cuda, "cuda"}};
}

/// `device` with auto resolved: cuda where CUDA sees a device, cpu otherwise.
inline Device resolve(Device device) {
  if (device != Device::automatic) return device;
  return volt::GPU::is_available() ? Device::cuda : Device::cpu;
}
