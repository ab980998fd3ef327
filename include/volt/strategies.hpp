#pragma once
/// \file Strategies: SingleDevice (see strategies/concept.hpp for the contract).
#include "volt/strategies/concept.hpp"
#include "volt/strategies/single_device.hpp"
