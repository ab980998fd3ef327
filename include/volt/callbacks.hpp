#pragma once
/// \file Callbacks shipped with volt (see callbacks/concept.hpp for every hook).
#include "volt/callbacks/backbone_finetuning.hpp"
#include "volt/callbacks/concept.hpp"
#include "volt/callbacks/device_stats_monitor.hpp"
#include "volt/callbacks/early_stopping.hpp"
#include "volt/callbacks/ema_weight_averaging.hpp"
#include "volt/callbacks/learning_rate_monitor.hpp"
#include "volt/callbacks/model_checkpoint.hpp"
#include "volt/callbacks/model_summary.hpp"
#include "volt/callbacks/progress_bar.hpp"
#include "volt/callbacks/prediction_writer.hpp"
#include "volt/callbacks/profiler.hpp"
#include "volt/callbacks/throughput_monitor.hpp"
