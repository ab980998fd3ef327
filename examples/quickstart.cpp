// Quick start: a small CNN on Fashion-MNIST with volt's Trainer.
//   quickstart [--run.device=auto|cpu|cuda] [--run.resume] [--data.dir=DIR] [--data.batch_size=N]
//              [--trainer.max_epochs=N] [--trainer.fast_dev_run=1] [--trainer.default_root_dir=DIR]
//              [--trainer.<option>=VALUE ...] [--config FILE] [--print_config] [--help]
// Prints the model's summary, trains, validates on the test split each epoch, shows a progress bar, writes metrics.csv
// and TensorBoard event files (with the hyper-parameters and samples/s) into DIR/volt_logs/version_N (DIR: the
// Trainer's default_root_dir), keeps the best checkpoint by validation accuracy and last.ckpt in DIR/checkpoints, and
// prints the training time and the final test accuracy. --run.resume continues from DIR/checkpoints/last.ckpt (an
// interrupted run goes on where it stopped). --run.device=auto (the default) trains on the GPU with bfloat16 mixed
// precision when CUDA sees one, and on the CPU in float32 otherwise. The whole configuration is the run's
// hyper-parameters (in every checkpoint, hparams.yaml and TensorBoard's HPARAMS tab); --print_config prints it as JSON,
// which --config FILE reads back, and --help lists every option. Exits with 77 when the Fashion-MNIST files are
// missing, and with 2 for an option it does not take.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "device.hpp"
#include "fashion_mnist.hpp"
#include "quickstart_net.hpp"

#include <chrono>
#include <filesystem>
#include <iostream>
#include <string>

/// Where the run goes.
struct RunOptions {
  Device device = Device::automatic;
  bool resume = false;
};
constexpr auto volt_fields(const RunOptions*) {
  return volt::fields({{"device", "auto: the GPU in bfloat16 mixed precision where CUDA sees one, else the CPU"},
                       {"resume", "continue from <trainer.default_root_dir>/checkpoints/last.ckpt"}});
}

/// The data.
struct DataOptions {
  std::string dir = fashion_mnist::default_dir;
  int64_t batch_size = 128;
};
constexpr auto volt_fields(const DataOptions*) {
  return volt::fields({{"dir", "the folder of Fashion-MNIST's four *-ubyte.gz files"},
                       {"batch_size", "training images per batch"}});
}

// The whole run for one accelerator and precision. The structure is fixed at compile time; main picks which of
// the two instantiations runs, once.
template <class Precision, class Accelerator>
int train(const volt::TrainerOptions& options, const RunOptions& run, const DataOptions& data,
          const volt::Json& hparams) {
  std::cout << "device: " << (Accelerator::device_type == c10::DeviceType::CUDA ? "cuda" : "cpu")
            << ", precision: " << Precision::name << "\n";
  const auto [train_x, train_y] = fashion_mnist::load(data.dir, /*train=*/true);
  const auto [test_x, test_y] = fashion_mnist::load(data.dir, /*train=*/false);
  volt::data::TensorLoader train(train_x, train_y, {.batch_size = data.batch_size, .shuffle = true, .seed = 42});
  volt::data::TensorLoader test(test_x, test_y, {.batch_size = 256});

  Net net(options.max_epochs.value_or(-1));
  auto trainer = volt::make_trainer<volt::SingleDevice, Precision, Accelerator>(
      options, volt::ModelSummary{}, volt::ProgressBar{}, volt::CSVLogger{},
      volt::TensorBoardLogger({.hparam_metrics = {"val_acc", "val_loss"}}), volt::LearningRateMonitor{},
      volt::ThroughputMonitor{},
      volt::ModelCheckpoint({.monitor = "val_acc", .mode = volt::ModelCheckpoint::Mode::max, .save_last = true}));
  trainer.save_hyperparameters(hparams);

  const auto start = std::chrono::steady_clock::now();
  trainer.fit(net, train, test, run.resume ? "last" : "");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto metrics = trainer.test(net, test);

  std::cout << "training took " << seconds << " s\n";
  std::cout << "test accuracy: " << metrics.at("test_acc") * 100.0 << "%\n";
  if (!trainer.fast_dev_run()) {
    std::cout << "metrics: " << trainer.template callback<volt::CSVLogger>().metrics_file().string() << "\n";
    std::cout << "tensorboard: " << trainer.template callback<volt::TensorBoardLogger>().event_file().string()
              << " (tensorboard --logdir "
              << (std::filesystem::path(options.default_root_dir) / "volt_logs").string() << ")\n";
    std::cout << "best checkpoint: " << trainer.best_model_path() << "\n";
  }
  return 0;
}

int main(int argc, char** argv) try {
  volt::TrainerOptions trainer{.max_epochs = 3, .seed = 42, .log_every_n_steps = 50};
  RunOptions run;
  DataOptions data;
  volt::Config config("quickstart", "Trains a small CNN on Fashion-MNIST.");
  config.add("trainer", trainer).add("run", run).add("data", data);
  if (!config.parse(argc, argv)) return 0;
  if (const auto missing = fashion_mnist::missing_file(data.dir); !missing.empty()) {
    std::cerr << "quickstart: no Fashion-MNIST data: " << missing << " is missing. Install it with "
              << "`apt-get install dataset-fashion-mnist` (Debian) or copy the four *-ubyte.gz files into a "
              << "folder and pass --data.dir=FOLDER.\n";
    return 77;
  }
  switch (resolve(run.device)) {
    case Device::cuda: return train<volt::Bf16Mixed, volt::GPU>(trainer, run, data, config.json());
    default: return train<volt::Fp32, volt::CPU>(trainer, run, data, config.json());
  }
} catch (const volt::ConfigError& e) {
  std::cerr << "quickstart: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "quickstart: " << e.what() << "\n";
  return 1;
}
