#pragma once
/// \file Strategies: SingleDevice, DDP<Launcher, Backend>, ZeRO<Stage, Launcher, Backend>,
/// ManualParallel<Launcher, Backend> (see strategies/concept.hpp for the contract, launchers/concept.hpp and
/// comm/concept.hpp for the parameters).
#include "volt/strategies/concept.hpp"
#include "volt/strategies/ddp.hpp"
#include "volt/strategies/manual_parallel.hpp"
#include "volt/strategies/model_parallel.hpp"
#include "volt/strategies/single_device.hpp"
#include "volt/strategies/zero.hpp"
