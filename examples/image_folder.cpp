// Training from image files read by background workers: Fashion-MNIST written out as one PNG per image
// (root/<split>/<class>/<index>.png, as torchvision's ImageFolder reads), then the quick start's network trained
// from those files with volt::data::ImageFolder and SampleLoader: each image is read and decoded (libpng) on a
// loader worker, and augmented with a random flip and shift drawn from the generator volt hands each sample.
//   image_folder [--data.folder=DIR] [--data.train_images=N] [--data.workers=N] [--data.batch_size=N]
//                [--trainer.max_epochs=N] [--trainer.default_root_dir=DIR] [--trainer.<option>=VALUE ...]
//                [--config FILE] [--print_config] [--help]
// The folder is written once (DIR/train, DIR/test; default: ./fashion_mnist_png) and reused. Before training, the
// first test images decoded from the files are checked against the IDX files' pixels. Prints the epoch time and
// the test accuracy. Exits with 77 when the Fashion-MNIST files are missing, and with 2 for an option it does not
// take.

#include <torch/torch.h>
#include <volt/data/image_folder.hpp>
#include <volt/volt.hpp>

#include "fashion_mnist.hpp"
#include "png.hpp"
#include "quickstart_net.hpp"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace {

constexpr double kMean = 0.2860, kStd = 0.3530;

// Writes the first `count` images of a split as PNGs under `dir`/<class>/<index>.png (once: a finished split has
// a `done` file).
void write_split(const fs::path& dir, bool train, int64_t count) {
  if (fs::exists(dir / "done")) return;
  const auto [x, y] = fashion_mnist::load(fashion_mnist::default_dir, train);
  const torch::Tensor pixels = (x * kStd + kMean).mul_(255.0).round_().to(torch::kUInt8);
  count = std::min<int64_t>(count, x.size(0));
  for (int64_t i = 0; i < count; ++i) {
    std::ostringstream name;
    name << std::setw(5) << std::setfill('0') << i << ".png";
    const fs::path cls = dir / ("class" + std::to_string(y[i].item<int64_t>()));
    fs::create_directories(cls);
    const torch::Tensor img = pixels[i][0].contiguous();
    png::write_gray(cls / name.str(), std::vector<uint8_t>(img.data_ptr<uint8_t>(), img.data_ptr<uint8_t>() + img.numel()), 28, 28);
  }
  std::ofstream(dir / "done") << count << "\n";
}

// Normalised as the quick start's tensors; for training, a random horizontal flip and a random shift of up to two
// pixels, drawn from the sample's own generator.
torch::Tensor normalise(torch::Tensor img, at::Generator&) { return img.sub_(kMean).div_(kStd); }
torch::Tensor augment(torch::Tensor img, at::Generator& gen) {
  if (torch::rand({1}, gen).item<float>() < 0.5f) img = img.flip({2});
  const auto shift = torch::randint(-2, 3, {2}, gen);
  img = torch::roll(img, {shift[0].item<int64_t>(), shift[1].item<int64_t>()}, {1, 2});
  return normalise(std::move(img), gen);
}

// The first 64 test images decoded from their files equal the IDX files' pixels.
void check_decoding(const volt::data::ImageFolder& test) {
  const auto [x, y] = fashion_mnist::load(fashion_mnist::default_dir, false);
  at::Generator unused = volt::data::sample_generator(0, 0, 0);
  for (int64_t i = 0; i < std::min<int64_t>(64, test.size()); ++i) {
    const int64_t index = std::stoll(fs::path(test.path(i)).stem().string());
    const auto sample = test.get(i, unused);
    if (!torch::allclose(sample.data, x[index], 0, 1e-5) || sample.target.item<int64_t>() != y[index].item<int64_t>()) {
      throw std::runtime_error("image " + test.path(i) + " does not decode to the IDX file's image " + std::to_string(index));
    }
  }
  std::cout << "decoded test images equal the IDX files' pixels (64 checked)\n";
}

/// The image files and how they are read.
struct DataOptions {
  std::string folder = "fashion_mnist_png";
  int64_t train_images = 10000;
  int workers = 2;
  int64_t batch_size = 128;
};
constexpr auto volt_fields(const DataOptions*) {
  return volt::fields({{"folder", "where the PNG files are written once (train/, test/) and read from"},
                       {"train_images", "training images written as files (a fifth as many test images)"},
                       {"workers", "loader workers reading and decoding the files"},
                       {"batch_size", "training images per batch"}});
}

// Trains the quick start's network from the files: one SampleLoader per split, its workers decoding.
int train(const volt::TrainerOptions& options, const DataOptions& data, const volt::Json& hparams) {
  const fs::path folder = data.folder;
  volt::data::ImageFolder train_images_set((folder / "train").string(), {.channels = 1}, augment);
  volt::data::ImageFolder test_images_set((folder / "test").string(), {.channels = 1}, normalise);
  check_decoding(volt::data::ImageFolder((folder / "test").string(), {.channels = 1}, normalise));
  std::cout << train_images_set.size() << " training images in " << train_images_set.classes().size()
            << " classes, read by " << data.workers << " worker(s)\n";
  volt::data::SampleLoader train(std::move(train_images_set), {.batch_size = data.batch_size, .shuffle = true,
                                                               .seed = 42, .num_workers = data.workers});
  volt::data::SampleLoader test(std::move(test_images_set), {.batch_size = 256, .num_workers = data.workers});

  const int64_t epochs = std::max<int64_t>(1, options.max_epochs.value_or(1));
  Net net(epochs);
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(options, volt::ProgressBar{},
                                                                               volt::CSVLogger{});
  trainer.save_hyperparameters(hparams);
  const auto start = std::chrono::steady_clock::now();
  trainer.fit(net, train, test);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "training took " << seconds << " s (" << seconds / static_cast<double>(epochs) << " s an epoch)\n";
  std::cout << "test accuracy: " << trainer.test(net, test).at("test_acc") * 100.0 << "%\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  volt::TrainerOptions trainer{.max_epochs = 1, .seed = 42, .log_every_n_steps = 20};
  DataOptions data;
  volt::Config config("image_folder", "Trains the quick start's CNN from Fashion-MNIST written as PNG files.");
  config.add("trainer", trainer).add("data", data);
  if (!config.parse(argc, argv)) return 0;
  if (const std::string missing = fashion_mnist::missing_file(fashion_mnist::default_dir); !missing.empty()) {
    std::cout << "no Fashion-MNIST files (" << missing << "): apt-get install dataset-fashion-mnist. Skipped.\n";
    return 77;
  }
  write_split(fs::path(data.folder) / "train", true, data.train_images);
  write_split(fs::path(data.folder) / "test", false, data.train_images / 5);
  return train(trainer, data, config.json());
} catch (const volt::ConfigError& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
