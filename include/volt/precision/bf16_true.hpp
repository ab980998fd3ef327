#pragma once

#include "volt/precision/concept.hpp"

namespace volt {

/// bfloat16 throughout: parameters, buffers, optimizer state and floating inputs are bfloat16. Half the
/// memory of Fp32 with no float32 master weights, so small updates can round away; prefer Bf16Mixed to train.
struct Bf16True : PrecisionDefaults {
  static constexpr const char* name = "Bf16True";
  static constexpr bool converts_inputs = true;
  static constexpr torch::Dtype input_dtype = torch::kBFloat16;

  detail::DefaultDtypeGuard forward_context(c10::DeviceType) {
    return detail::DefaultDtypeGuard(caffe2::TypeMeta::Make<c10::BFloat16>());
  }
  void convert_module(torch::nn::Module& module) { module.to(torch::kBFloat16); }
};

}  // namespace volt
