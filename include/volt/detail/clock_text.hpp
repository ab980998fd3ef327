#pragma once
/// \file
/// `detail::clock_text`: a duration as a clock shows it (the progress bar's times, the max_time notice).

#include <cstdint>
#include <string>

namespace volt::detail {

/// A duration as a clock shows it, rounded to seconds: "02:03", or "1:02:03" from an hour on.
inline std::string clock_text(double seconds) {
  const auto t = static_cast<int64_t>(seconds + 0.5);
  const auto two = [](int64_t v) { return std::string(v < 10 ? "0" : "") + std::to_string(v); };
  return (t >= 3600 ? std::to_string(t / 3600) + ":" : std::string()) + two(t / 60 % 60) + ":" + two(t % 60);
}

}  // namespace volt::detail
