// What a checkpoint of the quick-start net costs (Adam state included): its size, the time of
// Trainer::save_checkpoint (collect, serialize, CRC-32, write, fsync, rename) and of reading it back checked
// (checkpoint::read), against LibTorch's own torch::save of the module and the optimizer in the same process
// (no checksum, no fsync), rounds interleaved. One JSON line per measure, with medians and ratios.
//   checkpoint [--rounds 9] [--dir DIR]
// And how long a save holds the training loop, synchronous against asynchronous (`.async_save`: a host copy, then
// the write on a thread), on a model of MB megabytes of weights (SGD with momentum: twice that in the file), rounds
// interleaved; the asynchronous line also gives how long the write went on after the loop was free.
//   checkpoint async [--mb 256] [--rounds 5] [--dir DIR]

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "common.hpp"

#include "../examples/quickstart_net.hpp"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

using volt_bench::median;

template <class F>
double time_ms(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// A stack of 1024-wide linear layers with about `mb` megabytes of weights.
struct BigImpl : torch::nn::Module {
  torch::nn::Sequential layers;
  explicit BigImpl(int64_t mb) {
    for (int64_t i = 0; i < std::max<int64_t>(1, mb / 4); ++i) layers->push_back(torch::nn::Linear(1024, 1024));
    register_module("layers", layers);
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return (layers->forward(b.data) - b.target).pow(2).mean();
  }
  torch::optim::SGD configure_optimizers() {
    return torch::optim::SGD(parameters(), torch::optim::SGDOptions(1e-3).momentum(0.9));
  }
};
TORCH_MODULE(Big);

int async_main(int argc, char** argv) {
  int rounds = 5;
  int64_t mb = 256;
  std::filesystem::path dir = std::filesystem::temp_directory_path() / "volt_bench_checkpoint";
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rounds") rounds = std::stoi(argv[i + 1]);
    if (a == "--mb") mb = std::stoll(argv[i + 1]);
    if (a == "--dir") dir = argv[i + 1];
  }
  std::filesystem::create_directories(dir);
  Big net(mb);
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>({.max_steps = 1});
  trainer.fit(net, volt::data::TensorLoader(torch::randn({8, 1024}), torch::randn({8, 1024}), {.batch_size = 8}));
  const std::string sync_path = (dir / "sync.ckpt").string(), async_path = (dir / "async.ckpt").string();
  std::vector<double> sync_ms, async_ms, write_after_ms;
  for (int r = 0; r < rounds + 1; ++r) {  // the first round warms up
    const double s = time_ms([&] { trainer.save_checkpoint(sync_path); });
    const double a = time_ms([&] { trainer.save_checkpoint(std::vector<std::string>{async_path}, {.async_save = true}); });
    const double w = time_ms([&] { trainer.wait_for_checkpoint(); });
    if (r == 0) continue;
    sync_ms.push_back(s);
    async_ms.push_back(a);
    write_after_ms.push_back(w);
  }
  std::cout << "{\"bench\": \"checkpoint_async\"" << volt_bench::blas_field() << ", \"file_bytes\": "
            << std::filesystem::file_size(sync_path) << ", \"rounds\": " << rounds
            << ", \"sync_loop_wait_ms\": " << median(sync_ms) << ", \"async_loop_wait_ms\": " << median(async_ms)
            << ", \"ratio\": " << median(async_ms) / median(sync_ms)
            << ", \"async_write_after_ms\": " << median(write_after_ms) << "}\n";
  std::filesystem::remove(sync_path);
  std::filesystem::remove(async_path);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "async") return async_main(argc, argv);
  int rounds = 9;
  std::filesystem::path dir = std::filesystem::temp_directory_path() / "volt_bench_checkpoint";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rounds") rounds = std::stoi(argv[i + 1]);
    if (a == "--dir") dir = argv[i + 1];
  }
  std::filesystem::create_directories(dir);
  torch::manual_seed(0);
  Net net(1);
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>({.max_epochs = 1});
  trainer.fit(net, volt::data::TensorLoader(torch::randn({256, 1, 28, 28}), torch::randint(0, 10, {256}),
                                            {.batch_size = 128, .shuffle = true}));
  const std::string volt_path = (dir / "volt.ckpt").string();
  const std::string torch_model = (dir / "torch_model.pt").string(), torch_optim = (dir / "torch_optim.pt").string();

  std::vector<double> save_volt, save_torch, read_volt, read_torch, atomic_write, plain_write, checksum;
  std::vector<char> bytes;
  {
    std::ifstream in(volt_path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  for (int r = 0; r < rounds + 1; ++r) {  // the first round warms up
    const double sv = time_ms([&] { trainer.save_checkpoint(volt_path); });
    const double st = time_ms([&] {
      torch::save(net, torch_model);
      torch::save(*trainer.optimizer(), torch_optim);
    });
    const double rv = time_ms([&] { volt::checkpoint::read(volt_path); });
    const double rt = time_ms([&] {
      Net other(1);
      torch::load(other, torch_model);
    });
    // where the save time goes: the durable write, against a plain one, and the checksum
    const double aw = time_ms([&] { volt::checkpoint::write_atomic((dir / "bytes.ckpt").string(), bytes.data(), bytes.size()); });
    const double pw = time_ms([&] {
      std::ofstream out(dir / "plain.bin", std::ios::binary);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    });
    const auto contents = volt::checkpoint::read(volt_path);
    const double cs = time_ms([&] { volt::checkpoint::detail::checksum(contents, 0); });
    if (r == 0) continue;
    atomic_write.push_back(aw);
    plain_write.push_back(pw);
    checksum.push_back(cs);
    save_volt.push_back(sv);
    save_torch.push_back(st);
    read_volt.push_back(rv);
    read_torch.push_back(rt);
  }
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.numel();
  const auto volt_bytes = std::filesystem::file_size(volt_path);
  const auto torch_bytes = std::filesystem::file_size(torch_model) + std::filesystem::file_size(torch_optim);
  std::cout << "{\"bench\": \"checkpoint_size\"" << volt_bench::blas_field()
            << ", \"model\": \"quickstart\", \"parameters\": " << params << ", \"volt_bytes\": " << volt_bytes
            << ", \"torch_save_bytes\": " << torch_bytes
            << ", \"ratio\": " << static_cast<double>(volt_bytes) / static_cast<double>(torch_bytes) << "}\n";
  std::cout << "{\"bench\": \"checkpoint_save\"" << volt_bench::blas_field()
            << ", \"model\": \"quickstart\", \"rounds\": " << rounds << ", \"volt_ms\": " << median(save_volt)
            << ", \"torch_save_ms\": " << median(save_torch)
            << ", \"ratio\": " << median(save_volt) / median(save_torch) << "}\n";
  std::cout << "{\"bench\": \"checkpoint_read\"" << volt_bench::blas_field()
            << ", \"model\": \"quickstart\", \"rounds\": " << rounds << ", \"volt_ms\": " << median(read_volt)
            << ", \"torch_load_ms\": " << median(read_torch)
            << ", \"ratio\": " << median(read_volt) / median(read_torch) << "}\n";
  std::cout << "{\"bench\": \"checkpoint_write\"" << volt_bench::blas_field() << ", \"bytes\": " << bytes.size()
            << ", \"atomic_fsync_ms\": " << median(atomic_write) << ", \"plain_write_ms\": " << median(plain_write)
            << ", \"ratio\": " << median(atomic_write) / median(plain_write)
            << ", \"checksum_ms\": " << median(checksum) << "}\n";
  return 0;
}
