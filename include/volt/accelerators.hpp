#pragma once
/// \file Accelerators: CPU, GPU and Graphed<GPU> (see accelerators/concept.hpp for the contract).
#include "volt/accelerators/concept.hpp"
#include "volt/accelerators/cpu.hpp"
#include "volt/accelerators/gpu.hpp"
#include "volt/accelerators/graphed.hpp"
