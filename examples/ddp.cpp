// Data-parallel training: the quick start's CNN on Fashion-MNIST, one rank per GPU or per share of a host's cores.
//   ddp_example [--device auto|cpu|cuda] [--devices N] [--nodes N] [--epochs N] [--timeout-min M] [--fast-dev-run]
//               [--resume] [--data-dir DIR] [--out DIR]
// On GPUs: volt::DDP<volt::Spawn> with bfloat16 mixed precision, one worker per GPU started by fit (the program
//   started plainly), or volt::DDP<volt::Script> where mpirun or srun started the ranks (Spawn refuses to nest).
// On CPUs: volt::DDP<volt::Script> in float32: started plainly the program starts its other devices - 1 copies itself;
//   under mpirun or srun every process is a rank, devices per host times --nodes hosts (see the README's "On a
//   cluster" for batch scripts).
// Each rank trains on its shard of every epoch (the global batch is 128 x ranks), gradients are averaged across ranks,
// validation runs on the test split sharded across ranks, rank 0 prints and writes metrics.csv and checkpoints
// (DIR/checkpoints, last.ckpt included). --resume continues from last.ckpt (a requeued job passes it every time: the
// first run finds none and starts from the beginning). Exits with 77 when the Fashion-MNIST files are missing.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "fashion_mnist.hpp"
#include "quickstart_net.hpp"

#include <chrono>
#include <iostream>
#include <string>
#include <type_traits>

struct Args {
  std::string device = "auto";
  int devices = 2, nodes = 1;
  int64_t epochs = 3, timeout_min = 30;
  bool fast_dev_run = false, resume = false;
  std::string data_dir = fashion_mnist::default_dir, out_dir = ".";
};

template <class Strategy, class Precision, class Accelerator>
int train(const Args& args) {
  const auto [train_x, train_y] = fashion_mnist::load(args.data_dir, /*train=*/true);
  const auto [test_x, test_y] = fashion_mnist::load(args.data_dir, /*train=*/false);
  volt::data::TensorLoader train(train_x, train_y, {.batch_size = 128, .shuffle = true, .seed = 42});
  volt::data::TensorLoader test(test_x, test_y, {.batch_size = 256});

  Net net(args.epochs);
  auto trainer = volt::make_trainer<Strategy, Precision, Accelerator>(
      {.devices = args.devices, .num_nodes = args.nodes, .max_epochs = args.epochs,
       .fast_dev_run = args.fast_dev_run, .seed = 42, .log_every_n_steps = 50, .default_root_dir = args.out_dir,
       .timeout = std::chrono::minutes(args.timeout_min)},
      volt::ProgressBar{}, volt::CSVLogger{},
      volt::ModelCheckpoint({.monitor = "val_acc", .mode = volt::ModelCheckpoint::Mode::max, .save_last = true}));
  const auto start = std::chrono::steady_clock::now();
  trainer.fit(net, train, test, args.resume ? "last" : "");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto metrics = trainer.test(net, test);  // Spawn: here, in the main process, as a world of one
  if (trainer.is_global_zero()) {
    std::cout << Strategy::name << "<" << Strategy::launcher_type::name << "> on " << args.devices * args.nodes << " "
              << (Accelerator::device_type == c10::DeviceType::CUDA ? "GPUs" : "CPU ranks") << ", " << Precision::name
              << ": training took " << seconds << " s\ntest accuracy: " << metrics.at("test_acc") * 100.0 << "%\n";
  }
  return 0;
}

int usage() {
  std::cerr << "usage: ddp_example [--device auto|cpu|cuda] [--devices N] [--nodes N] [--epochs N] "
               "[--timeout-min M] [--fast-dev-run] [--resume] [--data-dir DIR] [--out DIR]\n";
  return 2;
}

int main(int argc, char** argv) try {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool value = i + 1 < argc;
    if (a == "--device" && value) args.device = argv[++i];
    else if (a == "--devices" && value) args.devices = std::stoi(argv[++i]);
    else if (a == "--nodes" && value) args.nodes = std::stoi(argv[++i]);
    else if (a == "--epochs" && value) args.epochs = std::stoll(argv[++i]);
    else if (a == "--timeout-min" && value) args.timeout_min = std::stoll(argv[++i]);
    else if (a == "--fast-dev-run") args.fast_dev_run = true;
    else if (a == "--resume") args.resume = true;
    else if (a == "--data-dir" && value) args.data_dir = argv[++i];
    else if (a == "--out" && value) args.out_dir = argv[++i];
    else return usage();
  }
  if (args.device != "auto" && args.device != "cpu" && args.device != "cuda") {
    std::cerr << "ddp: --device " << args.device << " is not one of auto, cpu, cuda\n";
    return 2;
  }
  if (const auto missing = fashion_mnist::missing_file(args.data_dir); !missing.empty()) {
    std::cerr << "ddp: no Fashion-MNIST data: " << missing << " is missing. Install it with "
              << "`apt-get install dataset-fashion-mnist` (Debian) or pass --data-dir FOLDER.\n";
    return 77;
  }
  if (args.device == "cuda" || (args.device == "auto" && volt::GPU::is_available())) {
    // NCCL where this build links volt::nccl (LibTorch 2.x with CUDA), otherwise MPI staged through host memory
    using Backend = std::conditional_t<VOLT_WITH_NCCL != 0, volt::Nccl, volt::Mpi>;
    if (volt::cluster::detect().launched_externally()) {
      return train<volt::DDP<volt::Script, Backend>, volt::Bf16Mixed, volt::GPU>(args);
    }
    return train<volt::DDP<volt::Spawn, Backend>, volt::Bf16Mixed, volt::GPU>(args);
  }
  return train<volt::DDP<volt::Script>, volt::Fp32, volt::CPU>(args);
} catch (const std::exception& e) {
  std::cerr << "ddp: " << e.what() << "\n";
  return 1;
}
