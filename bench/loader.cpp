// Loader benchmarks (JSON lines; every ratio measured in this process, rounds interleaved, medians):
//   loader throughput [--rounds 5] [--files 4096] [--dir DIR]
//       batches/s reading a folder of 28x28 PNG files (one per sample, batch 64, decoded with libpng) with
//       num_workers 0, 1, 2, 4: volt's SampleLoader<ImageFolder> against torch::data::make_data_loader with the
//       same number of workers over the same files and the same decoder; ratio = volt / torch::data.
//       loader_torch.py reads the same folder with PyTorch's DataLoader (run it where torch is importable).
//   loader overlap [--rounds 5] [--batches 40] [--load-ms 20]
//       a fit whose every batch costs about as much to load as to train: each sample's read waits load-ms /
//       batch-size (a latency-bound read, as on a network file system), the step is an MLP sized to take about
//       load-ms. Epoch time with 0 and 2 workers against the load time alone and the step time alone; `hidden`
//       is the share of the load time that the steps cover: (load + step - epoch) / load.

#include <torch/torch.h>
#include <volt/data/image_folder.hpp>
#include <volt/volt.hpp>

#include "common.hpp"

#include "../examples/png.hpp"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

using volt_bench::median;

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
void write_files(const fs::path& dir, int64_t files) {
  if (fs::exists(dir / "done")) return;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const torch::Tensor pixels = torch::randint(0, 256, {files, 28 * 28}, gen, torch::kLong).to(torch::kUInt8);
  for (int64_t i = 0; i < files; ++i) {
    const fs::path cls = dir / ("class" + std::to_string(i % 10));
    fs::create_directories(cls);
    const uint8_t* p = pixels[i].data_ptr<uint8_t>();
    png::write_gray(cls / (std::to_string(100000 + i) + ".png"), std::vector<uint8_t>(p, p + 28 * 28), 28, 28);
  }
  std::ofstream(dir / "done") << files << "\n";
}

/// The same files through torch::data: a map-style dataset whose get decodes with volt::data::read_png.
struct TorchPngs : torch::data::datasets::Dataset<TorchPngs> {
  std::shared_ptr<const volt::data::ImageFolder> folder;
  torch::data::Example<> get(size_t i) override {
    at::Generator unused;  // no transform: the generator is not used
    return folder->get(static_cast<int64_t>(i), unused);
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(folder->size()); }
};

template <class L>
int64_t drain(L& loader) {
  int64_t samples = 0;
  for (auto&& batch : loader) samples += batch.data.size(0);
  return samples;
}

int throughput(int rounds, int64_t files, const fs::path& dir) {
  write_files(dir, files);
  const volt::data::ImageFolder folder(dir.string(), {.channels = 1});
  std::map<int, std::vector<double>> volt_s, torch_s;
  for (int r = 0; r < rounds; ++r) {
    for (const int w : {0, 1, 2, 4}) {
      volt::data::SampleLoader loader(folder, {.batch_size = 64, .num_workers = w});
      auto t0 = Clock::now();
      const int64_t n = drain(loader);
      volt_s[w].push_back(since(t0));
      TorchPngs ds;
      ds.folder = std::make_shared<const volt::data::ImageFolder>(folder);
      auto tl = torch::data::make_data_loader(ds.map(torch::data::transforms::Stack<>()),
                                              torch::data::DataLoaderOptions().batch_size(64).workers(static_cast<size_t>(w)));
      t0 = Clock::now();
      const int64_t m = drain(*tl);
      torch_s[w].push_back(since(t0));
      if (n != files || m != files) throw std::runtime_error("a loader read " + std::to_string(n) + " / " + std::to_string(m) + " samples");
    }
  }
  const double batches = static_cast<double>((files + 63) / 64);
  for (const int w : {0, 1, 2, 4}) {
    const double v = batches / median(volt_s[w]), t = batches / median(torch_s[w]);
    std::cout << "{\"bench\":\"loader_throughput\"" << volt_bench::blas_field() << ",\"files\":" << files
              << ",\"num_workers\":" << w << ",\"volt_batches_per_s\":" << v << ",\"torch_data_batches_per_s\":" << t
              << ",\"ratio\":" << v / t << ",\"rounds\":" << rounds << ",\"intra_op_threads\":" << at::get_num_threads()
              << "}" << std::endl;
  }
  return 0;
}

/// Latency-bound reads: each sample waits `wait`, then is a fixed random vector.
struct SlowReads {
  torch::Tensor x, y;
  std::chrono::microseconds wait;
  int64_t size() const { return x.size(0); }
  torch::data::Example<> get(int64_t i) const {
    std::this_thread::sleep_for(wait);
    return {x[i], y[i]};
  }
};

struct MlpImpl : volt_bench::WideMlp {
  using WideMlp::WideMlp;
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.01)); }
};
TORCH_MODULE(Mlp);

template <class L>
double fit_seconds(L& loader, int64_t width) {
  Mlp model(width);
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>({.max_epochs = 1});
  const auto t0 = Clock::now();
  trainer.fit(model, loader);
  return since(t0);
}

int overlap(int rounds, int64_t batches, double load_ms) {
  const int64_t b = 64, n = b * batches;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  SlowReads reads{torch::randn({n, 784}, gen), torch::randint(0, 10, {n}, gen, torch::kLong),
                  std::chrono::microseconds(static_cast<int64_t>(load_ms * 1000.0 / static_cast<double>(b)))};
  // An MLP width whose step takes about load_ms: grown until it does.
  int64_t width = 256;
  volt::data::TensorLoader memory(reads.x, reads.y, {.batch_size = b});
  for (; width < 8192; width *= 2) {
    if (fit_seconds(memory, width) / static_cast<double>(batches) * 1000.0 >= load_ms) break;
  }
  std::vector<double> load, step, sync, two;
  for (int r = 0; r < rounds; ++r) {
    volt::data::SampleLoader only(reads, {.batch_size = b});
    auto t0 = Clock::now();
    drain(only);
    load.push_back(since(t0));
    step.push_back(fit_seconds(memory, width));
    volt::data::SampleLoader l0(reads, {.batch_size = b});
    sync.push_back(fit_seconds(l0, width));
    volt::data::SampleLoader l2(reads, {.batch_size = b, .num_workers = 2});
    two.push_back(fit_seconds(l2, width));
  }
  const double L = median(load), S = median(step), E0 = median(sync), E2 = median(two);
  std::cout << "{\"bench\":\"loader_overlap\"" << volt_bench::blas_field() << ",\"batches\":" << batches
            << ",\"mlp_width\":" << width << ",\"load_s\":" << L << ",\"step_s\":" << S
            << ",\"epoch_0_workers_s\":" << E0 << ",\"epoch_2_workers_s\":" << E2 << ",\"sum_s\":" << L + S
            << ",\"max_s\":" << std::max(L, S) << ",\"hidden_0_workers\":" << (L + S - E0) / L
            << ",\"hidden_2_workers\":" << (L + S - E2) / L << ",\"rounds\":" << rounds << "}" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::vector<std::string> a(argv + 1, argv + argc);
  auto opt = [&](const std::string& name, const std::string& fallback) {
    auto it = std::find(a.begin(), a.end(), name);
    return it != a.end() && it + 1 != a.end() ? *(it + 1) : fallback;
  };
  const int rounds = std::stoi(opt("--rounds", "5"));
  if (!a.empty() && a[0] == "throughput") {
    return throughput(rounds, std::stoll(opt("--files", "4096")), opt("--dir", "loader_bench_pngs"));
  }
  if (!a.empty() && a[0] == "overlap") return overlap(rounds, std::stoll(opt("--batches", "40")), std::stod(opt("--load-ms", "20")));
  std::cerr << "usage: loader throughput [--rounds R] [--files N] [--dir DIR] | loader overlap [--rounds R] [--batches N] "
               "[--load-ms MS]\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
