// Quick start: a small CNN on Fashion-MNIST with volt's Trainer.
//   quickstart [--epochs N] [--fast-dev-run] [--resume] [--data-dir DIR] [--out DIR]
// Trains, validates on the test split each epoch, shows a progress bar, writes metrics.csv, keeps the best
// checkpoint by validation accuracy and last.ckpt in DIR/checkpoints, and prints the final test accuracy.
// --resume continues from DIR/checkpoints/last.ckpt (an interrupted run goes on where it stopped).

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "fashion_mnist.hpp"
#include "quickstart_net.hpp"

#include <cstring>
#include <iostream>
#include <string>


int main(int argc, char** argv) try {
  int64_t epochs = 3;
  bool fast_dev_run = false, resume = false;
  std::string data_dir = fashion_mnist::default_dir, out_dir = ".";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--epochs" && i + 1 < argc) {
      epochs = std::stoll(argv[++i]);
    } else if (a == "--fast-dev-run") {
      fast_dev_run = true;
    } else if (a == "--resume") {
      resume = true;
    } else if (a == "--data-dir" && i + 1 < argc) {
      data_dir = argv[++i];
    } else if (a == "--out" && i + 1 < argc) {
      out_dir = argv[++i];
    } else {
      std::cerr << "usage: quickstart [--epochs N] [--fast-dev-run] [--resume] [--data-dir DIR] [--out DIR]\n";
      return 2;
    }
  }

  const auto [train_x, train_y] = fashion_mnist::load(data_dir, /*train=*/true);
  const auto [test_x, test_y] = fashion_mnist::load(data_dir, /*train=*/false);
  volt::data::TensorLoader train(train_x, train_y, {.batch_size = 128, .shuffle = true, .seed = 42});
  volt::data::TensorLoader test(test_x, test_y, {.batch_size = 256});

  Net net(epochs);
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      {.max_epochs = epochs, .fast_dev_run = fast_dev_run, .seed = 42, .log_every_n_steps = 50,
       .default_root_dir = out_dir},
      volt::ProgressBar{}, volt::CSVLogger{}, volt::LearningRateMonitor{},
      volt::ModelCheckpoint({.monitor = "val_acc", .mode = volt::ModelCheckpoint::Mode::max, .save_last = true}));

  const auto start = std::chrono::steady_clock::now();
  trainer.fit(net, train, test, resume ? "last" : "");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto metrics = trainer.test(net, test);

  std::cout << "training took " << seconds << " s\n";
  std::cout << "test accuracy: " << metrics.at("test_acc") * 100.0 << "%\n";
  if (!fast_dev_run) {
    std::cout << "metrics: " << trainer.callback<volt::CSVLogger>().metrics_file().string() << "\n";
    std::cout << "best checkpoint: " << trainer.best_model_path() << "\n";
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "quickstart: " << e.what() << "\n";
  return 1;
}
