#pragma once

#include "volt/precision/concept.hpp"

namespace volt {

/// Full float32: the module, inputs and math as they are. The default.
struct Fp32 : PrecisionDefaults {
  static constexpr const char* name = "Fp32";
};

}  // namespace volt
