#pragma once
/// \file volt's optimizers: LibTorch's Adam, AdamW and SGD, stepped by fused kernels (see volt/optim/fused.hpp).
#include "volt/optim/adam.hpp"
#include "volt/optim/sgd.hpp"
