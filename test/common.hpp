#pragma once
// What the Catch test files share: Catch itself and the Catch-free support (test/support/).

#include <catch2/catch.hpp>

#include "support/models.hpp"

#include <filesystem>

// What every Catch test file uses by its short name.
using Catch::Matchers::Contains;
namespace fs = std::filesystem;
using vt::cat;
using vt::index_dataset_loader;
using vt::index_loader;
using vt::make_loader;
using vt::Regressor;
using vt::same_weights;
using vt::scratch;
using vt::take;
