#pragma once
/// \file Launchers: Script and Spawn (see launchers/concept.hpp).
#include "volt/launchers/concept.hpp"
#include "volt/launchers/script.hpp"
#include "volt/launchers/spawn.hpp"
