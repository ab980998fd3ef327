#pragma once

/// volt's version, as numbers and as a string. Checkpoints (and anything else that must be read back by
/// a later volt) record it.
#define VOLT_VERSION_MAJOR 0
#define VOLT_VERSION_MINOR 1
#define VOLT_VERSION_PATCH 0

namespace volt {
inline constexpr int version_major = VOLT_VERSION_MAJOR;
inline constexpr int version_minor = VOLT_VERSION_MINOR;
inline constexpr int version_patch = VOLT_VERSION_PATCH;
inline constexpr const char* version_string = "0.1.0";
}  // namespace volt
