// mlflow_run: a small regression fit logged to CSV and (unless --run.mlflow=false) to an MLflow tracking server, for
// test/mlflow_check.py, which starts a real server and reads the runs back with MLflow's Python client.
//   mlflow_run --trainer.default_root_dir=DIR [--trainer.<option>=VALUE ...] [--run.<option>=VALUE ...]
// The whole configuration is saved as the run's hyper-parameters (the parameters MLflow gets). --run.stop_at=N
// raises SIGTERM in the step that ends with global step N (the fit checkpoints and exits with 143);
// --run.freeze_group=PGID with --run.freeze_at=N sends --run.freeze_signal (KILL or STOP) to that process group then:
// the server, killed or hung mid-fit. --run.wide=N logs N more metrics in the first step. --run.every_step=true saves
// step=N.ckpt (and its .safetensors) after every step, keeping the latest only. Prints the run id.

#include <torch/torch.h>
#include <volt/loggers/mlflow.hpp>
#include <volt/volt.hpp>

#include <signal.h>

#include <array>
#include <cmath>
#include <iostream>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

struct RunOptions {
  bool mlflow = true;
  bool resume = false;
  volt::MLFlowLogger::LogModel log_model = volt::MLFlowLogger::LogModel::all;
  std::string experiment = "volt_tests";
  double timeout = 10;
  int64_t stop_at = -1;
  int64_t freeze_group = 0;
  int64_t freeze_at = -1;
  std::string freeze_signal = "KILL";
  int64_t wide = 0;
  bool every_step = false;
  bool continue_without_server = false;
};
constexpr auto volt_fields(const RunOptions*) {
  return volt::fields({{"mlflow", "log to MLFLOW_TRACKING_URI too"},
                       {"resume", "continue from the last checkpoint"},
                       {"log_model", "which checkpoints go to MLflow"},
                       {"experiment", "the MLflow experiment"},
                       {"timeout", "seconds one HTTP attempt may take"},
                       {"stop_at", "raise SIGTERM at this global step"},
                       {"freeze_group", "a process group to signal (the server)"},
                       {"freeze_at", "the global step to signal it at"},
                       {"freeze_signal", "KILL or STOP"},
                       {"wide", "metrics more to log in the first step"},
                       {"every_step", "a checkpoint (and its safetensors) every step, the latest kept"},
                       {"continue_without_server", "train on when the run cannot be opened"}});
}

struct WideRegressorImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  int64_t wide;
  explicit WideRegressorImpl(int64_t wide_) : wide(wide_) {
    torch::manual_seed(3);
    lin = register_module("lin", torch::nn::Linear(4, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto loss = (lin(b.data) - b.target).pow(2).mean();
    ctx.log("train_loss", loss);
    if (ctx.global_step() == 0) {
      for (int64_t i = 0; i < wide; ++i) ctx.log("wide/m" + std::to_string(i), 0.25 * static_cast<double>(i) + 1.0 / 3);
      ctx.log("not_a_number", std::numeric_limits<double>::quiet_NaN());
    }
    return loss;
  }
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("val_loss", (lin(b.data) - b.target).pow(2).mean());
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.05)); }
};
TORCH_MODULE(WideRegressor);

/// Raises the run's signals at their steps.
struct Signals {
  RunOptions run;
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (trainer.global_step() == run.freeze_at && run.freeze_group > 0) {
      ::kill(static_cast<pid_t>(-run.freeze_group), run.freeze_signal == "STOP" ? SIGSTOP : SIGKILL);
    }
    if (trainer.global_step() == run.stop_at) ::raise(SIGTERM);
  }
};

template <class... Loggers>
int fit(const volt::TrainerOptions& options, const RunOptions& run, const volt::Json& hparams, Loggers... loggers) {
  torch::manual_seed(7);
  const auto x = torch::randn({96, 4});
  const auto y = x.matmul(torch::tensor({1.0, -2.0, 0.5, 3.0}).unsqueeze(1)) + 0.1 * torch::randn({96, 1});
  volt::data::TensorLoader train(x, y, {.batch_size = 8, .shuffle = true, .seed = 5});
  volt::data::TensorLoader val(x.slice(0, 0, 32), y.slice(0, 0, 32), {.batch_size = 16});
  WideRegressor net(run.wide);
  // every_step: step=N.ckpt and .safetensors after each step, each pruned by the next save (while its upload waits)
  const auto checkpoints = run.every_step ? volt::ModelCheckpoint::Options{.filename = "{step}", .save_top_k = 1,
                                                                           .save_last = true, .every_n_train_steps = 1,
                                                                           .save_safetensors = true}
                                          : volt::ModelCheckpoint::Options{.monitor = "val_loss", .save_top_k = 2,
                                                                           .save_last = true};
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      options, volt::CSVLogger{}, volt::ModelCheckpoint(checkpoints), Signals{run}, std::move(loggers)...);
  trainer.save_hyperparameters(hparams);
  trainer.fit(net, train, val, run.resume ? "last" : "");
  std::cout << "metrics: " << trainer.template callback<volt::CSVLogger>().metrics_file().string() << "\n";
  if constexpr (sizeof...(Loggers) > 0) {
    std::cout << "run id: " << trainer.template callback<volt::MLFlowLogger>().run_id() << "\n";
  }
  return 0;
}

// docs/logging.md's block, compiled here (the fits above are what runs). Kept as the page writes it:
// clang-format off
template <class Module, class Loader>
void docs_logging(const volt::TrainerOptions& options, const volt::Config& config, Module& net, Loader& train,
                  Loader& val) {
  // MLFLOW_TRACKING_URI=http://127.0.0.1:5000, and MLFLOW_TRACKING_TOKEN (or _USERNAME and _PASSWORD) where the
  // server asks for credentials
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      options, volt::CSVLogger{}, volt::ModelCheckpoint({.monitor = "val_loss", .save_last = true}),
      volt::MLFlowLogger({.experiment_name = "mnist", .run_name = "baseline", .tags = {{"team", "vision"}},
                          .log_model = volt::MLFlowLogger::LogModel::all}));
  trainer.save_hyperparameters(config.json());  // the run's parameters
  trainer.fit(net, train, val, "last");          // resumed: the same MLflow run goes on
}
// clang-format on

int main(int argc, char** argv) try {
  volt::TrainerOptions trainer{.max_epochs = 3, .seed = 11, .log_every_n_steps = 1};
  RunOptions run;
  volt::Config config("mlflow_run", "A small fit logged to CSV and MLflow.");
  config.add("trainer", trainer).add("run", run);
  if (!config.parse(argc, argv)) return 0;
  if (!run.mlflow) return fit(trainer, run, config.json());
  return fit(trainer, run, config.json(),
             volt::MLFlowLogger({.experiment_name = run.experiment,
                                 .run_name = "regression",
                                 .tags = {{"suite", "volt"}},
                                 .log_model = run.log_model,
                                 .timeout_s = run.timeout,
                                 .continue_without_server = run.continue_without_server}));
} catch (const volt::ConfigError& e) {
  std::cerr << "mlflow_run: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "mlflow_run: " << e.what() << "\n";
  return 1;
}
