#pragma once
// What the Catch test files share: Catch itself and the Catch-free support (test/support/).

#include <catch2/catch.hpp>

#include "support/models.hpp"
