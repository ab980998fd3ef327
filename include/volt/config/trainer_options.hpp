#pragma once
/// \file
/// `TrainerOptions` and `SignalOptions` as configurable structs: their tables of fields (checked against the structs
/// when this header compiles, so a field added to either and not here is a compile error that names it), and the
/// names of `ClipAlgorithm`'s values. volt/options.hpp says what each field does; these lines are `--help`'s.

#include "volt/config/table.hpp"
#include "volt/options.hpp"

#include <array>
#include <string_view>
#include <utility>

namespace volt {

constexpr auto volt_enum_names(ClipAlgorithm) {
  using P = std::pair<ClipAlgorithm, std::string_view>;
  return std::array{P{ClipAlgorithm::norm, "norm"}, P{ClipAlgorithm::value, "value"}};
}

constexpr auto volt_fields(const SignalOptions*) {
  return fields({
      {"enabled", "handle SIGTERM, SIGINT and the requeue signal during fit (checkpoint, flush, requeue, exit)"},
      {"requeue_signal", "the signal a scheduler sends before its deadline (10: SIGUSR1); 0: none"},
      {"auto_requeue", "in a SLURM job, requeue it after the checkpoint (SIGTERM and the requeue signal)"},
      {"scontrol", "the program that requeues: <scontrol> requeue $SLURM_JOB_ID"},
      {"exit_process", "end the process after the checkpoint (false: fit throws volt::Interrupted)"},
  });
}

constexpr auto volt_fields(const TrainerOptions*) {
  return fields({
      {"devices", "processes (CPU) or devices (GPU) per node"},
      {"num_nodes", "number of nodes"},
      {"max_epochs", "stop after this many epochs; -1: no limit; null: 1000 when max_steps is -1"},
      {"min_epochs", "run at least this many epochs before a stop request takes effect"},
      {"max_steps", "stop after this many optimizer steps; -1: no limit"},
      {"min_steps", "run at least this many optimizer steps before a stop request takes effect"},
      {"max_time", "stop training after this much time (checkpoint as at a stop signal); null: no limit"},
      {"limit_train_batches", "training batches per epoch: a count, or a fraction of the loader"},
      {"limit_val_batches", "validation batches per run: a count, or a fraction"},
      {"limit_test_batches", "test batches: a count, or a fraction"},
      {"limit_predict_batches", "predict batches: a count, or a fraction"},
      {"overfit_batches", "train and validate on this many batches (or fraction) every epoch; 0: off"},
      {"val_check_interval", "validate every this many training batches, or this fraction of an epoch"},
      {"check_val_every_n_epoch", "validate in every n-th epoch; null: val_check_interval counts across epochs"},
      {"num_sanity_val_steps", "validation batches run before training; -1: all of them"},
      {"accumulate_grad_batches", "batches per optimizer step (their gradients accumulated)"},
      {"gradient_clip_val", "clip gradients to this norm or value; null: no clipping"},
      {"gradient_clip_algorithm", "how gradient_clip_val clips"},
      {"fast_dev_run", "run this many batches of train, validation and test once, logging nothing; 0: off; a bare flag: 1",
       "1"},
      {"deterministic", "deterministic algorithms only"},
      {"benchmark", "cuDNN's autotuner; null: as the process has it (false under deterministic)"},
      {"seed", "seed every generator at the start of each run; null: not seeded"},
      {"detect_anomaly", "autograd's anomaly mode while fitting (slow: for finding a NaN's source)"},
      {"inference_mode", "evaluate under InferenceMode (true) or NoGradGuard (false)"},
      {"log_every_n_steps", "send step-level metrics to loggers every n optimizer steps"},
      {"default_root_dir", "where loggers and checkpoints go unless told otherwise"},
      {"signals", "stop signals during fit"},
      {"timeout", "how long a collective may wait for the other ranks before the job ends"},
  });
}

static_assert(config::detail::checked<SignalOptions> && config::detail::checked<TrainerOptions>);

}  // namespace volt
