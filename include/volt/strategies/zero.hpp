#pragma once
/// \file
/// `volt::ZeRO<Stage, Launcher, Backend>`: data parallelism with the optimizer state sharded across ranks (stage 1)
/// and the gradients too (stage 2), as DeepSpeed's ZeRO stages 1 and 2 (arXiv:1910.02054). DDP keeps a whole copy of
/// the weights, gradients and optimizer state on every rank; with Adam the state is twice the weights. Here each rank
/// keeps the state of 1/W of the elements, and the gradients travel as a reduce-scatter plus an all-gather of the
/// weights: the bytes of one all-reduce, so the memory comes at no communication cost.
///
///  - set-up, data, logging, decisions: as DDP (both are `DataParallel`, strategies/data_parallel.hpp; ZeRO's layout is
///    `Sharded<Stage>`, strategies/sharded.hpp);
///  - layout, at the fit's start (after `configure_optimizers`): the parameters that require gradients are laid out in
///    DDP's buckets (reverse order, so communication starts during backward; by dtype and device), each padded to a
///    multiple of the world size W, and each parameter becomes a view into its bucket's flat buffer. Rank r owns block
///    r of every bucket. The optimizer's parameter groups are given, in place of each parameter, the piece of it that
///    falls in this rank's blocks, before its first step: its state (made at its first step) covers those pieces only;
///  - gradients: on the micro-batch that steps, each bucket is reduce-scattered (averaged) as soon as its last
///    gradient arrives, in bucket order on every rank; the pieces' gradients are this rank's reduced block, and each
///    module `.grad` is dropped as its bucket takes it. Stage 1 keeps every bucket's full gradient buffer, stage 2
///    only its block: a bucket's buffer lives from its first gradient to the end of its reduce-scatter, so its
///    backward holds the blocks and a few buckets. Both run at most two collectives at once
///    (`detail::kBucketsInFlight`). Micro-batches that only accumulate do so in
///    `.grad`, locally, as under DDP. So `on_before_optimizer_step` finds no `.grad` on the module's parameters (the
///    averages are in the pieces: `optimizer.param_groups()`), and zero_grad drops every module parameter's `.grad`;
///  - the step: gradient clipping reduces the squared norm across ranks (Fp16Mixed's inf check likewise, so every rank
///    skips the same steps); each rank steps its pieces, then every bucket is all-gathered in place;
///  - checkpoints: the pieces' states are gathered and written in the layout of an unsharded run (`torch.load` reads
///    it; DDP and one process resume it), and a resume cuts the file's state by this run's world size, so a run saved
///    on N ranks resumes on M.
/// What it is not (refused at compile time): manual optimization and graph mode.
///
/// \code
///   volt::Trainer<volt::ZeRO<2, volt::Spawn>, volt::Bf16Mixed, volt::GPU> trainer({.devices = 8});
///   volt::Trainer<volt::ZeRO<1, volt::Script, volt::Mpi>, volt::Fp32, volt::CPU> cpu({.devices = 2});
/// \endcode

#include "volt/strategies/parallel.hpp"
#include "volt/strategies/sharded.hpp"

namespace volt {

template <int Stage, class L = Script, class B = AutoBackend>
using ZeRO = DataParallel<Sharded<Stage>, L, B>;

/// Fully sharded data parallelism: `ZeRO<3>`, the parameters sharded too, gathered unit by unit where the model runs
/// its units (volt/units.hpp; strategies/fully_sharded.hpp says when each is gathered and freed).
template <class L = Script, class B = AutoBackend>
using FSDP = DataParallel<FullySharded, L, B>;

}  // namespace volt
