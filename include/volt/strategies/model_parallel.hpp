#pragma once
/// \file
/// `volt::ModelParallel<Launcher, Backend>`: data parallelism whose layout the module chooses part by part, on a
/// process mesh, as Lightning's `ModelParallelStrategy` (the composition of the design discussion it answers: "wrap
/// parts of their models in DDP and partition other parts with techniques like FSDP"). The module's
/// `configure_model(volt::ModelPlan&)` (volt/model_plan.hpp) names its parts:
/// \code
///   auto trainer = volt::make_trainer<volt::ModelParallel<volt::Script, volt::Mpi>>({.devices = 4});
///   trainer.strategy().set_mesh({{"replicate", 2}, {"shard", 2}});
///   // in the module:
///   void configure_model(volt::ModelPlan& plan) { plan.shard(blocks, "shard"); plan.replicate(head); }
/// \endcode
///
/// | part | what each rank holds and does |
/// |---|---|
/// | `plan.shard(m, axis)` | FSDP of `m` along the mesh's data axis `axis` (the layout of `FSDP`, strategies/sharded.hpp and fully_sharded.hpp, over that axis's communicator): each rank on the axis keeps its shard of each unit of `m`; gradients reduce-scattered along the axis as each unit's backward ends. Where the mesh has other data axes, replicated along them (hybrid sharding, FSDP2's HSDP): after the step's last backward the blocks are averaged across them |
/// | `plan.replicate(m)`, and what no part holds | DDP over the data axes (strategies/replicated.hpp) |
///
/// Each axis has a role (`AxisRole`, comm/mesh.hpp). Along a data axis each rank trains on its own share of every
/// batch: the loaders are split over the data axes flattened (`Mesh::data()`), logged values with `sync_dist` are
/// reduced over them, and every gradient ends averaged over them, so a fit equals a one-process fit on the global
/// batches whatever the plan. The ranks along a tensor or pipe axis share each batch; no layout uses such an axis yet
/// (tensor and pipeline parallelism will), so they hold the same parts and train alike.
///
/// One optimizer steps every part (automatic optimization): each sharded part gives it its pieces in place of its
/// parameters. Clipping by norm takes the norm over every part (each sharded part's pieces summed along its axis);
/// a loss-scaled step's inf check is agreed by every rank. Checkpoints: the full form (one file from rank zero, each
/// sharded part gathered along its axis), which resumes under any strategy; with more than one sharded part the
/// optimizer's state can be neither written nor read yet (refused, with nothing written or loaded).

#include "volt/strategies/parallel.hpp"
#include "volt/strategies/replicated.hpp"
#include "volt/strategies/sharded.hpp"

namespace volt {

template <class L = Script, class B = AutoBackend>
using ModelParallel = Parallel<L, B, Replicated, FullySharded>;

}  // namespace volt
