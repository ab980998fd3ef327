// Quick start: a small CNN on Fashion-MNIST with volt's Trainer.
//   quickstart [--device auto|cpu|cuda] [--epochs N] [--fast-dev-run] [--resume] [--data-dir DIR] [--out DIR]
// Prints the model's summary, trains, validates on the test split each epoch, shows a progress bar, writes metrics.csv
// and TensorBoard event files (with the hyper-parameters and samples/s) into DIR/volt_logs/version_N, keeps the best
// checkpoint by validation accuracy and last.ckpt in DIR/checkpoints, and prints the training time and the final
// test accuracy. --resume continues from DIR/checkpoints/last.ckpt (an interrupted run goes on where it stopped).
// --device auto (the default) trains on the GPU with bfloat16 mixed precision when CUDA sees one, and on the CPU in
// float32 otherwise. Exits with 77 when the Fashion-MNIST files are missing.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "fashion_mnist.hpp"
#include "quickstart_net.hpp"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>

struct Args {
  std::string device = "auto";
  int64_t epochs = 3;
  bool fast_dev_run = false, resume = false;
  std::string data_dir = fashion_mnist::default_dir, out_dir = ".";
};

// The whole run for one accelerator and precision. The structure is fixed at compile time; main picks which of
// the two instantiations runs, once.
template <class Precision, class Accelerator>
int train(const Args& args) {
  std::cout << "device: " << (Accelerator::device_type == c10::DeviceType::CUDA ? "cuda" : "cpu")
            << ", precision: " << Precision::name << "\n";
  const auto [train_x, train_y] = fashion_mnist::load(args.data_dir, /*train=*/true);
  const auto [test_x, test_y] = fashion_mnist::load(args.data_dir, /*train=*/false);
  volt::data::TensorLoader train(train_x, train_y, {.batch_size = 128, .shuffle = true, .seed = 42});
  volt::data::TensorLoader test(test_x, test_y, {.batch_size = 256});

  Net net(args.epochs);
  auto trainer = volt::make_trainer<volt::SingleDevice, Precision, Accelerator>(
      {.max_epochs = args.epochs, .fast_dev_run = args.fast_dev_run, .seed = 42, .log_every_n_steps = 50,
       .default_root_dir = args.out_dir},
      volt::ModelSummary{}, volt::ProgressBar{}, volt::CSVLogger{},
      volt::TensorBoardLogger({.hparams = {{"lr", 2e-3}, {"batch_size", 128}, {"epochs", args.epochs}, {"optimizer", "Adam"}},
                               .hparam_metrics = {"val_acc", "val_loss"}}),
      volt::LearningRateMonitor{}, volt::ThroughputMonitor{},
      volt::ModelCheckpoint({.monitor = "val_acc", .mode = volt::ModelCheckpoint::Mode::max, .save_last = true}));

  const auto start = std::chrono::steady_clock::now();
  trainer.fit(net, train, test, args.resume ? "last" : "");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto metrics = trainer.test(net, test);

  std::cout << "training took " << seconds << " s\n";
  std::cout << "test accuracy: " << metrics.at("test_acc") * 100.0 << "%\n";
  if (!args.fast_dev_run) {
    std::cout << "metrics: " << trainer.template callback<volt::CSVLogger>().metrics_file().string() << "\n";
    std::cout << "tensorboard: " << trainer.template callback<volt::TensorBoardLogger>().event_file().string()
              << " (tensorboard --logdir " << (std::filesystem::path(args.out_dir) / "volt_logs").string() << ")\n";
    std::cout << "best checkpoint: " << trainer.best_model_path() << "\n";
  }
  return 0;
}

int main(int argc, char** argv) try {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) {
      args.device = argv[++i];
    } else if (a == "--epochs" && i + 1 < argc) {
      args.epochs = std::stoll(argv[++i]);
    } else if (a == "--fast-dev-run") {
      args.fast_dev_run = true;
    } else if (a == "--resume") {
      args.resume = true;
    } else if (a == "--data-dir" && i + 1 < argc) {
      args.data_dir = argv[++i];
    } else if (a == "--out" && i + 1 < argc) {
      args.out_dir = argv[++i];
    } else {
      std::cerr << "usage: quickstart [--device auto|cpu|cuda] [--epochs N] [--fast-dev-run] [--resume] "
                   "[--data-dir DIR] [--out DIR]\n";
      return 2;
    }
  }
  if (args.device != "auto" && args.device != "cpu" && args.device != "cuda") {
    std::cerr << "quickstart: --device " << args.device << " is not one of auto, cpu, cuda\n";
    return 2;
  }
  if (const auto missing = fashion_mnist::missing_file(args.data_dir); !missing.empty()) {
    std::cerr << "quickstart: no Fashion-MNIST data: " << missing << " is missing. Install it with "
              << "`apt-get install dataset-fashion-mnist` (Debian) or copy the four *-ubyte.gz files into a "
              << "folder and pass --data-dir FOLDER.\n";
    return 77;
  }
  const bool cuda = args.device == "cuda" || (args.device == "auto" && volt::GPU::is_available());
  return cuda ? train<volt::Bf16Mixed, volt::GPU>(args) : train<volt::Fp32, volt::CPU>(args);
} catch (const std::exception& e) {
  std::cerr << "quickstart: " << e.what() << "\n";
  return 1;
}
