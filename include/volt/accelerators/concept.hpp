#pragma once
/// \file
/// The Accelerator kind: which hardware runs the math. An accelerator is a stateless type.
///
/// | member | meaning |
/// |---|---|
/// | `static constexpr c10::DeviceType device_type` | the device type tensors and autocast use |
/// | `static constexpr const char* name` | for messages |
/// | `static constexpr bool has_fp16_autocast` | autocast to float16 works here (Fp16Mixed needs it) |
/// | `static constexpr bool has_bf16_autocast` | autocast to bfloat16 works here (Bf16Mixed needs it) |
/// | `static bool is_available()` | this process can use it now (a run-time check: phase (b)) |
/// | `static int device_count()` | how many devices this process sees |
/// | `static torch::Device device(int local_rank)` | the device a local rank uses |
/// | `static void synchronize(torch::Device)` | wait for queued work on that device (timings) |
/// | `static std::vector<std::string> slow_settings(int ranks_on_host)` (optional) | sentences on what makes a fit here much slower than it should be (the CPU's: accelerators/cpu_speed.hpp); the first rank of each host says them once per process, when its first run (fit, validate, test, predict) sets up |
/// | `using graph_type` (optional) | how `Graphed<A>` captures and replays steps (accelerators/graphed.hpp); absent: `Graphed<A>` is refused |
///
/// Writing your own: a struct with these members; the Trainer's rules read only the flags, never the type.
/// \code
///   struct MyNpu { static constexpr c10::DeviceType device_type = c10::DeviceType::PrivateUse1; ... };
/// \endcode

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>

#include <concepts>

namespace volt {

template <class A>
concept Accelerator = requires(int local_rank, c10::Device device) {
  { A::device_type } -> std::convertible_to<c10::DeviceType>;
  { A::name } -> std::convertible_to<const char*>;
  { A::has_fp16_autocast } -> std::convertible_to<bool>;
  { A::has_bf16_autocast } -> std::convertible_to<bool>;
  { A::is_available() } -> std::same_as<bool>;
  { A::device_count() } -> std::convertible_to<int>;
  { A::device(local_rank) } -> std::same_as<c10::Device>;
  A::synchronize(device);
};

}  // namespace volt
