#pragma once

#include "volt/accelerators/concept.hpp"
#include "volt/accelerators/cuda_graph.hpp"
#include "volt/detail/torch_compat.hpp"

#include <c10/core/Device.h>
#include <torch/cuda.h>

namespace volt {

/// CUDA GPUs. Local rank r uses `cuda:r`. Needs a CUDA build of LibTorch and a visible device at run time;
/// both are checked when the Trainer is built, never assumed.
struct GPU {
  static constexpr c10::DeviceType device_type = c10::DeviceType::CUDA;
  static constexpr const char* name = "GPU";
  static constexpr bool has_fp16_autocast = true;
  static constexpr bool has_bf16_autocast = true;
  /// How `Graphed<GPU>` captures and replays steps (compiled in where LibTorch has CUDA).
  using graph_type = detail::CudaGraph;

  static bool is_available() { return torch::cuda::is_available(); }
  static int device_count() { return static_cast<int>(torch::cuda::device_count()); }
  static c10::Device device(int local_rank) {
    return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(local_rank));
  }
  static void synchronize(c10::Device device) { detail::cuda_synchronize(device.index()); }
};

}  // namespace volt
