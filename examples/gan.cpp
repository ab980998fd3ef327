// A GAN on Fashion-MNIST with manual optimization: a generator and a discriminator, an Adam each, stepped in turn in
// training_step through the Context (ctx.optimizers(), ctx.toggle_optimizer, ctx.manual_backward, opt.step()).
//   gan [--run.device=auto|cpu|cuda] [--data.dir=DIR] [--data.batch_size=N] [--trainer.max_epochs=N]
//       [--trainer.limit_train_batches=N] [--trainer.default_root_dir=DIR] [--trainer.<option>=VALUE ...]
//       [--config FILE] [--print_config] [--help]
// Shows both losses in the progress bar and writes a grid of 64 generated images after every epoch, from the same
// noise each time, as DIR/samples_epoch<N>.png (224 x 224, greyscale; DIR: the Trainer's default_root_dir), so a person
// can watch them take shape. Ends with the last losses; exits with 1 when they are not finite, with 77 when the
// Fashion-MNIST files are missing, and with 2 for an option it does not take.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "device.hpp"
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

/// Where the run goes.
struct RunOptions {
  Device device = Device::automatic;
};
constexpr auto volt_fields(const RunOptions*) {
  return volt::fields({{"device", "auto: the GPU in bfloat16 mixed precision where CUDA sees one, else the CPU"}});
}

/// The data.
struct DataOptions {
  std::string dir = fashion_mnist::default_dir;
  int64_t batch_size = 64;
};
constexpr auto volt_fields(const DataOptions*) {
  return volt::fields({{"dir", "the folder of Fashion-MNIST's four *-ubyte.gz files"},
                       {"batch_size", "training images per batch"}});
}

template <class Precision, class Accelerator>
int train(const volt::TrainerOptions& options, const DataOptions& data, const volt::Json& hparams) {
  const auto [x, y] = fashion_mnist::load(data.dir, /*train=*/true);
  volt::data::TensorLoader loader(x, y, {.batch_size = data.batch_size, .shuffle = true, .drop_last = true, .seed = 42});
  volt::seed_everything(42);
  Gan gan;
  std::filesystem::create_directories(options.default_root_dir);
  auto trainer = volt::make_trainer<volt::SingleDevice, Precision, Accelerator>(options, volt::ProgressBar{},
                                                                               SampleGrid{options.default_root_dir});
  trainer.save_hyperparameters(hparams);
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
  volt::TrainerOptions trainer{.max_epochs = 5, .seed = 42};
  RunOptions run;
  DataOptions data;
  volt::Config config("gan", "Trains a GAN on Fashion-MNIST with manual optimization and writes its samples as PNGs.");
  config.add("trainer", trainer).add("run", run).add("data", data);
  if (!config.parse(argc, argv)) return 0;
  if (const auto missing = fashion_mnist::missing_file(data.dir); !missing.empty()) {
    std::cerr << "gan: no Fashion-MNIST data: " << missing << " is missing. Install it with "
              << "`apt-get install dataset-fashion-mnist` (Debian) or pass --data.dir=FOLDER.\n";
    return 77;
  }
  switch (resolve(run.device)) {
    case Device::cuda: return train<volt::Bf16Mixed, volt::GPU>(trainer, data, config.json());
    default: return train<volt::Fp32, volt::CPU>(trainer, data, config.json());
  }
} catch (const volt::ConfigError& e) {
  std::cerr << "gan: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "gan: " << e.what() << "\n";
  return 1;
}
