#pragma once
/// \file
/// `volt::DDP<Launcher, Backend>`: data parallelism, as Lightning's `ddp` / `ddp_spawn` and PyTorch's
/// DistributedDataParallel.
///  - set-up: the module moves to the rank's device and rank 0's parameters and buffers are broadcast;
///  - data: `process_dataloader` shards a loader that offers `shard(rank, world_size)` (volt's loaders do:
///    for training one seeded permutation per epoch shared by every rank, padded so every rank gets the same
///    number of batches, as PyTorch's DistributedSampler; for evaluation and prediction the one-process batches
///    dealt out in turn, no sample twice, as Lightning's unrepeated sampler); a loader without it is used as it
///    is, and a note says so;
///  - gradients: averaged across ranks by `detail::Reducer` (bucketed flat all-reduces started during
///    backward), only on the micro-batch that steps when gradients accumulate (the `Replicated` layout,
///    strategies/replicated.hpp);
///  - logging with sync_dist, stop decisions and checkpoints follow the base strategy's collectives.
/// The backend defaults to `AutoBackend`: Nccl on GPU, Mpi on CPU. DDP is `DataParallel<Replicated, L, B>`
/// (strategies/data_parallel.hpp), the data-parallel strategy whose ranks each hold everything.
///
/// \code
///   volt::Trainer<volt::DDP<volt::Spawn>, volt::Bf16Mixed, volt::GPU> trainer({.devices = 4});
///   volt::Trainer<volt::DDP<volt::Script, volt::Mpi>, volt::Fp32, volt::CPU> cpu({.devices = 2});
/// \endcode

#include "volt/strategies/parallel.hpp"
#include "volt/strategies/replicated.hpp"

namespace volt {

template <class L = Script, class B = AutoBackend>
using DDP = DataParallel<Replicated, L, B>;

}  // namespace volt
