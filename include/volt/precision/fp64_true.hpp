#pragma once

#include "volt/precision/concept.hpp"

namespace volt {

/// float64 throughout: the module's parameters and buffers and every floating input tensor are cast to
/// double, and double is torch's default dtype inside each step.
struct Fp64True : PrecisionDefaults {
  static constexpr const char* name = "Fp64True";
  static constexpr bool converts_inputs = true;
  static constexpr torch::Dtype input_dtype = torch::kFloat64;

  detail::DefaultDtypeGuard forward_context(c10::DeviceType) {
    return detail::DefaultDtypeGuard(caffe2::TypeMeta::Make<double>());
  }
  void convert_module(torch::nn::Module& module) { module.to(torch::kFloat64); }
};

}  // namespace volt
