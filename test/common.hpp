#pragma once
// What the Catch test files share: Catch itself and the Catch-free support (test/support/).

#include <catch2/catch.hpp>

#include "support/models.hpp"

#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>

// What every Catch test file uses by its short name.
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using Catch::Matchers::EndsWith;
namespace fs = std::filesystem;
using vt::cat;
using vt::index_dataset_loader;
using vt::index_loader;
using vt::make_loader;
using vt::Regressor;
using vt::same_weights;
using vt::scratch;
using vt::take;

namespace vt {

/// Built with AddressSanitizer or ThreadSanitizer (the sanitizer lanes): their shadow memory makes resident memory
/// say nothing about the code's own, so tests that measure it only read there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif
/// Collects what std::cerr receives while it lives (warnings the library prints), and puts std::cerr back after,
/// also when a check throws.
class CaptureCerr {
 public:
  CaptureCerr() : old_(std::cerr.rdbuf(text_.rdbuf())) {}
  ~CaptureCerr() { std::cerr.rdbuf(old_); }
  CaptureCerr(const CaptureCerr&) = delete;
  CaptureCerr& operator=(const CaptureCerr&) = delete;
  std::string str() const { return text_.str(); }
  void clear() { text_.str(""); }

 private:
  std::ostringstream text_;
  std::streambuf* old_;
};
}  // namespace vt
using vt::CaptureCerr;
