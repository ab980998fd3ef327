// A GAN on Fashion-MNIST with manual optimization: a generator and a discriminator, an Adam each, stepped in turn in
// training_step through the Context (ctx.optimizers(), ctx.toggle_optimizer, ctx.manual_backward, opt.step()).
//   gan [--device auto|cpu|cuda] [--epochs N] [--limit-batches N] [--data-dir DIR] [--out DIR]
// Shows both losses in the progress bar and writes a grid of 64 generated images after every epoch, from the same
// noise each time, as DIR/samples_epoch<N>.png (224 x 224, greyscale), so a person can watch them take shape. Ends
// with the last losses; exits with 1 when they are not finite, and with 77 when the Fashion-MNIST files are missing.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "fashion_mnist.hpp"
#include "png.hpp"

#include <cmath>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kLatent = 64;

struct GanImpl : torch::nn::Module {
  /// The module steps its own optimizers (Lightning's `automatic_optimization = False`).
  static constexpr bool automatic_optimization = false;

  torch::nn::Sequential generator{nullptr}, discriminator{nullptr};
  GanImpl() {
    using namespace torch::nn;
    generator = register_module("generator", Sequential(Linear(kLatent, 256), LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                                                        Linear(256, 512), LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                                                        Linear(512, 784), Tanh()));
    discriminator = register_module("discriminator", Sequential(Linear(784, 512), LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                                                                Linear(512, 256), LeakyReLU(LeakyReLUOptions().negative_slope(0.2)),
                                                                Linear(256, 1)));
  }

  /// Two optimizers, each keeping its type: the generator's first, the discriminator's second.
  std::tuple<volt::optim::Adam, volt::optim::Adam> configure_optimizers() {
    const auto options = torch::optim::AdamOptions(2e-4).betas({0.5, 0.999});
    return {volt::optim::Adam(generator->parameters(), options), volt::optim::Adam(discriminator->parameters(), options)};
  }

  void training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto optimizers = ctx.optimizers();
    volt::ManualOptimizer& g_opt = optimizers[0];
    volt::ManualOptimizer& d_opt = optimizers[1];
    // The images back to [-1, 1] (the loader normalised them), as the generator's tanh makes them.
    const torch::Tensor real = (batch.data.flatten(1) * 0.3530 + 0.2860) * 2.0 - 1.0;
    const torch::Tensor z = torch::randn({real.size(0), kLatent}, real.options());
    const torch::Tensor ones = torch::ones({real.size(0), 1}, real.options());
    const torch::Tensor zeros = torch::zeros({real.size(0), 1}, real.options());
    namespace F = torch::nn::functional;

    // The discriminator: real images are 1, generated ones 0 (only its parameters require gradients).
    ctx.toggle_optimizer(d_opt);
    const torch::Tensor fake = generator->forward(z);
    const torch::Tensor d_loss = F::binary_cross_entropy_with_logits(discriminator->forward(real), ones) +
                                 F::binary_cross_entropy_with_logits(discriminator->forward(fake.detach()), zeros);
    d_opt.zero_grad();
    ctx.manual_backward(d_loss);
    d_opt.step();
    ctx.untoggle_optimizer(d_opt);

    // The generator: its images should pass for real (only its parameters require gradients).
    ctx.toggle_optimizer(g_opt);
    const torch::Tensor g_loss =
        F::binary_cross_entropy_with_logits(discriminator->forward(generator->forward(z)), ones);
    g_opt.zero_grad();
    ctx.manual_backward(g_loss);
    g_opt.step();
    ctx.untoggle_optimizer(g_opt);

    ctx.log("d_loss", d_loss, {.prog_bar = true});
    ctx.log("g_loss", g_loss, {.prog_bar = true});
  }
};
TORCH_MODULE(Gan);

/// After each training epoch (rank zero): the generator's images for fixed noise, as an 8 x 8 grid in a PNG file.
struct SampleGrid {
  static constexpr bool keeps_loss = false;
  std::filesystem::path dir;
  torch::Tensor noise = torch::randn({64, kLatent}, at::make_generator<at::CPUGeneratorImpl>(1234));

  template <class T>
  void on_train_epoch_end(T& trainer, GanImpl& module) {
    if (!trainer.is_global_zero()) return;
    torch::NoGradGuard no_grad;
    const torch::Tensor images = module.generator->forward(noise.to(module.parameters()[0].device())).cpu();
    // [64, 784] in [-1, 1] -> rows of 8 images -> [224, 224] bytes.
    const torch::Tensor grid = images.reshape({8, 8, 28, 28}).permute({0, 2, 1, 3}).reshape({224, 224});
    const torch::Tensor bytes = ((grid + 1.0) * 127.5).round().clamp(0, 255).to(torch::kUInt8).contiguous();
    std::vector<uint8_t> pixels(bytes.data_ptr<uint8_t>(), bytes.data_ptr<uint8_t>() + bytes.numel());
    const auto path = dir / ("samples_epoch" + std::to_string(trainer.current_epoch()) + ".png");
    png::write_gray(path, pixels, 224, 224);
    std::cout << "\nwrote " << path.string() << std::endl;
  }
};

struct Args {
  std::string device = "auto";
  int64_t epochs = 5, limit_batches = 0;
  std::string data_dir = fashion_mnist::default_dir, out_dir = ".";
};

template <class Precision, class Accelerator>
int train(const Args& args) {
  const auto [x, y] = fashion_mnist::load(args.data_dir, /*train=*/true);
  volt::data::TensorLoader loader(x, y, {.batch_size = 64, .shuffle = true, .drop_last = true, .seed = 42});
  volt::seed_everything(42);
  Gan gan;
  std::filesystem::create_directories(args.out_dir);
  volt::TrainerOptions options{.max_epochs = args.epochs, .seed = 42, .default_root_dir = args.out_dir};
  if (args.limit_batches > 0) options.limit_train_batches = volt::Limit(args.limit_batches);
  auto trainer = volt::make_trainer<volt::SingleDevice, Precision, Accelerator>(options, volt::ProgressBar{},
                                                                               SampleGrid{args.out_dir});
  trainer.fit(gan, loader);
  const auto metrics = trainer.callback_metric_values();
  const double d = metrics.at("d_loss"), g = metrics.at("g_loss");
  std::cout << "final d_loss " << d << ", g_loss " << g << " after " << trainer.global_step() << " optimizer steps\n";
  if (!std::isfinite(d) || !std::isfinite(g)) {
    std::cerr << "gan: the losses are not finite\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) {
      args.device = argv[++i];
    } else if (a == "--epochs" && i + 1 < argc) {
      args.epochs = std::stoll(argv[++i]);
    } else if (a == "--limit-batches" && i + 1 < argc) {
      args.limit_batches = std::stoll(argv[++i]);
    } else if (a == "--data-dir" && i + 1 < argc) {
      args.data_dir = argv[++i];
    } else if (a == "--out" && i + 1 < argc) {
      args.out_dir = argv[++i];
    } else {
      std::cerr << "usage: gan [--device auto|cpu|cuda] [--epochs N] [--limit-batches N] [--data-dir DIR] [--out DIR]\n";
      return 2;
    }
  }
  if (args.device != "auto" && args.device != "cpu" && args.device != "cuda") {
    std::cerr << "gan: --device " << args.device << " is not one of auto, cpu, cuda\n";
    return 2;
  }
  if (const auto missing = fashion_mnist::missing_file(args.data_dir); !missing.empty()) {
    std::cerr << "gan: no Fashion-MNIST data: " << missing << " is missing. Install it with "
              << "`apt-get install dataset-fashion-mnist` (Debian) or pass --data-dir FOLDER.\n";
    return 77;
  }
  const bool cuda = args.device == "cuda" || (args.device == "auto" && volt::GPU::is_available());
  return cuda ? train<volt::Bf16Mixed, volt::GPU>(args) : train<volt::Fp32, volt::CPU>(args);
} catch (const std::exception& e) {
  std::cerr << "gan: " << e.what() << "\n";
  return 1;
}
