// Data-parallel training: the quick start's CNN on Fashion-MNIST, one rank per GPU or per share of a host's cores.
//   ddp_example [--run.device=auto|cpu|cuda] [--run.resume] [--data.dir=DIR] [--data.batch_size=N]
//               [--trainer.devices=N] [--trainer.num_nodes=N] [--trainer.max_epochs=N] [--trainer.timeout=30min]
//               [--trainer.fast_dev_run=1] [--trainer.default_root_dir=DIR] [--trainer.<option>=VALUE ...]
//               [--config FILE] [--print_config] [--help]
// On GPUs: volt::DDP<volt::Spawn> with bfloat16 mixed precision, one worker per GPU started by fit (the program
//   started plainly), or volt::DDP<volt::Script> where mpirun or srun started the ranks (Spawn refuses to nest).
// On CPUs: volt::DDP<volt::Script> in float32: started plainly the program starts its other devices - 1 copies itself;
//   under mpirun or srun every process is a rank, devices per host times trainer.num_nodes hosts (see docs/distributed.md, "On
//   a cluster" for batch scripts).
// Each rank trains on its shard of every epoch (the global batch is data.batch_size x ranks), gradients are averaged
// across ranks, validation runs on the test split sharded across ranks, rank 0 prints and writes metrics.csv and
// checkpoints (DIR/checkpoints, last.ckpt included; DIR: the Trainer's default_root_dir), with the configuration as
// the run's hyper-parameters. --run.resume continues from last.ckpt (a requeued job passes it every time: the first
// run finds none and starts from the beginning). Exits with 77 when the Fashion-MNIST files are missing, and with 2
// for an option it does not take.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "device.hpp"
#include "fashion_mnist.hpp"
#include "quickstart_net.hpp"

#include <chrono>
#include <iostream>
#include <string>
#include <type_traits>

/// Where the run goes.
struct RunOptions {
  Device device = Device::automatic;
  bool resume = false;
};
constexpr auto volt_fields(const RunOptions*) {
  return volt::fields({{"device", "auto: the GPUs in bfloat16 mixed precision where CUDA sees one, else CPU ranks"},
                       {"resume", "continue from <trainer.default_root_dir>/checkpoints/last.ckpt"}});
}

/// The data.
struct DataOptions {
  std::string dir = fashion_mnist::default_dir;
  int64_t batch_size = 128;
};
constexpr auto volt_fields(const DataOptions*) {
  return volt::fields({{"dir", "the folder of Fashion-MNIST's four *-ubyte.gz files"},
                       {"batch_size", "training images per batch on each rank"}});
}

template <class Strategy, class Precision, class Accelerator>
int train(const volt::TrainerOptions& options, const RunOptions& run, const DataOptions& data,
          const volt::Json& hparams) {
  const auto [train_x, train_y] = fashion_mnist::load(data.dir, /*train=*/true);
  const auto [test_x, test_y] = fashion_mnist::load(data.dir, /*train=*/false);
  volt::data::TensorLoader train(train_x, train_y, {.batch_size = data.batch_size, .shuffle = true, .seed = 42});
  volt::data::TensorLoader test(test_x, test_y, {.batch_size = 256});

  Net net(options.max_epochs.value_or(-1));
  auto trainer = volt::make_trainer<Strategy, Precision, Accelerator>(
      options, volt::ProgressBar{}, volt::CSVLogger{},
      volt::ModelCheckpoint({.monitor = "val_acc", .mode = volt::ModelCheckpoint::Mode::max, .save_last = true}));
  trainer.save_hyperparameters(hparams);
  const auto start = std::chrono::steady_clock::now();
  trainer.fit(net, train, test, run.resume ? "last" : "");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto metrics = trainer.test(net, test);  // Spawn: here, in the main process, as a world of one
  if (trainer.is_global_zero()) {
    std::cout << Strategy::name << "<" << Strategy::launcher_type::name << "> on "
              << options.devices * options.num_nodes << " "
              << (Accelerator::device_type == c10::DeviceType::CUDA ? "GPUs" : "CPU ranks") << ", " << Precision::name
              << ": training took " << seconds << " s\ntest accuracy: " << metrics.at("test_acc") * 100.0 << "%\n";
  }
  return 0;
}

int main(int argc, char** argv) try {
  volt::TrainerOptions trainer{.devices = 2, .max_epochs = 3, .seed = 42, .log_every_n_steps = 50};
  RunOptions run;
  DataOptions data;
  volt::Config config("ddp_example", "Trains the quick start's CNN on Fashion-MNIST over several ranks (DDP).");
  config.add("trainer", trainer).add("run", run).add("data", data);
  if (!config.parse(argc, argv)) return 0;
  if (const auto missing = fashion_mnist::missing_file(data.dir); !missing.empty()) {
    std::cerr << "ddp: no Fashion-MNIST data: " << missing << " is missing. Install it with "
              << "`apt-get install dataset-fashion-mnist` (Debian) or pass --data.dir=FOLDER.\n";
    return 77;
  }
  const volt::Json hparams = config.json();
  switch (resolve(run.device)) {
    case Device::cuda: {
      // NCCL where this build links volt::nccl (LibTorch 2.x with CUDA), otherwise MPI staged through host memory
      using Backend = std::conditional_t<VOLT_WITH_NCCL != 0, volt::Nccl, volt::Mpi>;
      if (volt::cluster::detect().launched_externally()) {
        return train<volt::DDP<volt::Script, Backend>, volt::Bf16Mixed, volt::GPU>(trainer, run, data, hparams);
      }
      return train<volt::DDP<volt::Spawn, Backend>, volt::Bf16Mixed, volt::GPU>(trainer, run, data, hparams);
    }
    default: return train<volt::DDP<volt::Script>, volt::Fp32, volt::CPU>(trainer, run, data, hparams);
  }
} catch (const volt::ConfigError& e) {
  std::cerr << "ddp: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "ddp: " << e.what() << "\n";
  return 1;
}
