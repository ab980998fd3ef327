#pragma once
/// \file volt's optimizers: LibTorch's Adam, AdamW and SGD, stepped by fused kernels (see volt/optim/fused.hpp), their
/// parameter groups with and without weight decay, and the learning-rate schedules LibTorch lacks (warm-up, cosine,
/// one after another: volt/optim/schedulers.hpp).
#include "volt/optim/adam.hpp"
#include "volt/optim/schedulers.hpp"
#include "volt/optim/sgd.hpp"
