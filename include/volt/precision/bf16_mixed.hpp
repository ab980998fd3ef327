#pragma once

#include "volt/detail/torch_compat.hpp"
#include "volt/precision/concept.hpp"

namespace volt {

/// Mixed bfloat16: float32 parameters and optimizer, each step's forward (and loss) under autocast to
/// bfloat16 on the accelerator's device type. bfloat16 has float32's range, so no loss scaling is needed.
/// Works on CPU and GPU. Under FSDP the parameters are gathered for each forward in bfloat16 (half the bytes on the
/// wire and in memory), from float32 pieces the optimizer steps; their gradients are accumulated and reduced in
/// float32.
struct Bf16Mixed : PrecisionDefaults {
  static constexpr const char* name = "Bf16Mixed";
  static constexpr bool needs_bf16_autocast = true;
  static constexpr std::optional<torch::Dtype> compute_dtype = torch::kBFloat16;

  detail::AutocastGuard forward_context(c10::DeviceType device) {
    return detail::AutocastGuard(device, at::kBFloat16);
  }
};

/// The name used in `Trainer<DDP<Spawn>, Bf16, GPU>`.
using Bf16 = Bf16Mixed;

}  // namespace volt
