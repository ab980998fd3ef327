#pragma once
/// \file
/// `volt::seed_everything(seed)`: one call at the top of `main`, before the model is built, so that a program's
/// weights, dropout masks and shuffles are the same in every run (as Lightning's `seed_everything`). The
/// Trainer's `seed` option seeds again when each run starts; it cannot reach weights built before `fit`.

#include <torch/utils.h>

#include <cstdint>
#include <cstdlib>

namespace volt {

/// Seeds LibTorch's generators (the CPU one and, where CUDA is, every GPU's) and `std::rand`. Returns `seed`.
/// Under `DDP<Spawn>` the workers run `main` again, so they seed the same way.
inline uint64_t seed_everything(uint64_t seed) {
  torch::manual_seed(seed);
  std::srand(static_cast<unsigned>(seed));
  return seed;
}

}  // namespace volt
