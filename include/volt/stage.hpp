#pragma once
/// \file
/// `volt::Stage`: which loop is running. A word of the ground floor: the module's Context says it, and strategies,
/// loaders' wrapping and callbacks take it.

namespace volt {

/// Which loop is running. `sanity_check` is the short validation run before training.
enum class Stage { train, sanity_check, validate, test, predict };

inline const char* to_string(Stage s) {
  switch (s) {
    case Stage::train: return "train";
    case Stage::sanity_check: return "sanity_check";
    case Stage::validate: return "validate";
    case Stage::test: return "test";
    case Stage::predict: return "predict";
  }
  return "?";
}

}  // namespace volt
