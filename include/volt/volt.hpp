#pragma once
/// \file Everything: `#include <volt/volt.hpp>`. Per-kind umbrellas (volt/precision.hpp, ...) compile faster.
#include "volt/accelerators.hpp"
#include "volt/batch.hpp"
#include "volt/callbacks.hpp"
#include "volt/context.hpp"
#include "volt/data.hpp"
#include "volt/module.hpp"
#include "volt/options.hpp"
#include "volt/precision.hpp"
#include "volt/rules.hpp"
#include "volt/strategies.hpp"
#include "volt/trainer.hpp"
#include "volt/version.hpp"
