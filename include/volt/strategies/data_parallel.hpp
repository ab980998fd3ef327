#pragma once
/// \file
/// How a data-parallel strategy (strategies/parallel.hpp) splits a loader over the ranks whose batches differ: the
/// one place that asks a loader what it can do (volt/data/concept.hpp).

#include "volt/data/concept.hpp"
#include "volt/stage.hpp"

#include <cstddef>
#include <iostream>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

namespace detail {

/// A data-parallel strategy's loader for `stage` on rank `rank` of `world`: for training, one per-epoch permutation on
/// every rank, padded; for evaluation and prediction, the one-process batches dealt out in turn where the loader can
/// (no sample twice, so means are over the real samples and predict's gathered results are the one-process results; a
/// rank may get none). `pad_evaluation` (the parameters are sharded, so every forward is a collective): evaluation is
/// padded as training is, every rank running as many batches, the last ones repeating the first samples (as PyTorch's
/// DistributedSampler). A loader that cannot be sharded so is said once (`warned`), naming `strategy`.
template <class Loader>
decltype(auto) data_parallel_loader(Loader&& loader, Stage stage, int rank, int world, bool pad_evaluation,
                                    const char* strategy, bool& warned) {
  const auto warn_once = [&](const char* what) {
    if (!warned && rank == 0 && world > 1) {
      warned = true;
      std::cerr << "volt: " << strategy << what << "\n";
    }
  };
  if constexpr (data::SplittableLoader<std::remove_cvref_t<Loader>>) {
    const bool padded = stage == Stage::train || pad_evaluation;
    const auto split = padded ? data::Split::padded_samples : data::Split::whole_batches;
    // Fewer evaluation batches than ranks leave some ranks none: they take part in the epoch's reductions with
    // empty sums (connectors/logger_connector.hpp), as Lightning runs such a loader.
    return loader.shard(rank, world, split);
  } else if constexpr (requires { loader.shard(0, 1); }) {
    if (stage != Stage::train) warn_once(": a loader without shard(rank, world_size, volt::data::Split) is split for "
                                         "evaluation as for training: padded, so some samples count twice.");
    return loader.shard(rank, world);
  } else {
    warn_once(" was given a loader without shard(rank, world_size); every rank iterates all of it. Shard it yourself, "
              "or use volt::data's loaders.");
    return std::forward<Loader>(loader);
  }
}

}  // namespace detail

}  // namespace volt
