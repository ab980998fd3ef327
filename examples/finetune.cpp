// Fine-tuning from pretrained weights. The quick start's network is trained on Fashion-MNIST's 10 classes and its
// weights are saved as safetensors (the file Python's `safetensors.torch.load_file` reads). A new model for another
// task (3 classes: tops, footwear, the rest) has the same feature layers under `backbone` and a new head; it starts
// from the saved weights (`volt::load_weights` into its backbone, the old head skipped), BackboneFinetuning keeps
// the backbone frozen for the first epoch while the head learns, then trains it at a tenth of the head's learning
// rate, growing each epoch. The same model trained from scratch on the same few labelled images is the comparison.
//
//   finetune [--data.dir=DIR] [--data.samples=N] [--pretrain.batches=N] [--trainer.max_epochs=N]
//            [--trainer.default_root_dir=DIR] [--trainer.<option>=VALUE ...] [--config FILE] [--print_config] [--help]
//
// The trainer section is the fine-tuning Trainer's (both fits on the new task); the pretraining takes the same options
// but runs one epoch of pretrain.batches batches, seeded with 42. The configuration is each fit's hyper-parameters.
// Exits 77 (skipped) when the Fashion-MNIST files are missing, 1 when the backbone moved while it was frozen or
// did not train after, 2 for an option it does not take.
#include "fashion_mnist.hpp"
#include "quickstart_net.hpp"

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <filesystem>
#include <iostream>
#include <string>

// The quick start's feature layers, under the names NetImpl gives them, so its weights load by name.
struct BackboneImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{torch::nn::Conv2dOptions(1, 16, 3).padding(1)};
  torch::nn::BatchNorm2d bn1{16};
  torch::nn::Conv2d conv2{torch::nn::Conv2dOptions(16, 32, 3).padding(1)};
  torch::nn::BatchNorm2d bn2{32};
  torch::nn::Linear fc1{32 * 7 * 7, 128};
  BackboneImpl() {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    register_module("fc1", fc1);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    x = torch::max_pool2d(torch::relu(bn2(conv2(x))), 2);
    return torch::relu(fc1(x.flatten(1)));
  }
};
TORCH_MODULE(Backbone);

struct ClothingKindImpl : torch::nn::Module {
  Backbone backbone;
  torch::nn::Dropout drop{0.3};
  torch::nn::Linear head{128, 3};
  ClothingKindImpl() {
    register_module("backbone", backbone);
    register_module("drop", drop);
    register_module("head", head);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(drop(backbone(x))); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto loss = torch::nn::functional::cross_entropy(forward(b.data), b.target);
    ctx.log("train_loss", loss, {.prog_bar = true});
    return loss;
  }
  void test_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("test_acc", forward(b.data).argmax(1).eq(b.target).to(torch::kFloat32).mean());
  }
  // The parameters that require gradients: BackboneFinetuning gives the frozen backbone a group of its own.
  torch::optim::Adam configure_optimizers() {
    std::vector<torch::Tensor> trainable;
    for (const auto& p : parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    return torch::optim::Adam(trainable, torch::optim::AdamOptions(2e-3));
  }
};
TORCH_MODULE(ClothingKind);

// Fashion-MNIST's classes as 3 kinds: tops (T-shirt, pullover, coat, shirt), footwear (sandal, sneaker, ankle boot),
// the rest (trouser, dress, bag).
torch::Tensor kind_of(const torch::Tensor& label) {
  const auto kinds = torch::tensor({0, 2, 0, 2, 0, 1, 0, 1, 2, 1}, torch::kLong);
  return kinds.index_select(0, label);
}

// Checks what BackboneFinetuning promises: the backbone's first weight unchanged through the frozen epoch.
struct FrozenWatch {
  torch::Tensor loaded;
  bool* moved_while_frozen;
  template <class T, class M>
  void on_train_epoch_end(T& trainer, M& module) {
    if (trainer.current_epoch() == 0) *moved_while_frozen = !torch::equal(module.backbone->conv1->weight, loaded);
  }
};

/// The data.
struct DataOptions {
  std::string dir = fashion_mnist::default_dir;
  int64_t samples = 2000;
};
constexpr auto volt_fields(const DataOptions*) {
  return volt::fields({{"dir", "the folder of Fashion-MNIST's four *-ubyte.gz files"},
                       {"samples", "labelled images of the new task: the first this many training images"}});
}

/// The pretraining on Fashion-MNIST's 10 classes.
struct PretrainOptions {
  int64_t batches = 200;
};
constexpr auto volt_fields(const PretrainOptions*) {
  return volt::fields({{"batches", "training batches of the one pretraining epoch"}});
}

int run(const volt::TrainerOptions& options, const DataOptions& data, const PretrainOptions& pre,
        const volt::Json& hparams) {
  const auto [train_x, train_y] = fashion_mnist::load(data.dir, /*train=*/true);
  const auto [test_x, test_y] = fashion_mnist::load(data.dir, /*train=*/false);
  const std::string weights = (std::filesystem::path(options.default_root_dir) / "pretrained.safetensors").string();

  // 1. Pretraining: the quick start's network on the 10 classes, its weights saved as safetensors.
  Net pretrained(1);
  volt::TrainerOptions pretrain_options = options;
  pretrain_options.max_epochs = 1;
  pretrain_options.limit_train_batches = volt::Limit(pre.batches);
  pretrain_options.seed = 42;
  auto pretrain = volt::make_trainer(pretrain_options);
  pretrain.save_hyperparameters(hparams);
  pretrain.fit(pretrained, volt::data::TensorLoader(train_x, train_y, {.batch_size = 128, .shuffle = true, .seed = 1}));
  volt::save_safetensors(*pretrained, weights, {{"task", "fashion-mnist 10 classes"}});
  std::cout << "pretrained on " << pre.batches << " batches of 10 classes; weights: " << weights << "\n";

  // 2. The new task, with few labels: the first `data.samples` training images, 3 kinds.
  using namespace torch::indexing;
  const auto few_x = train_x.index({Slice(0, data.samples)}), few_y = kind_of(train_y.index({Slice(0, data.samples)}));
  volt::data::TensorLoader test(test_x, kind_of(test_y), {.batch_size = 512});
  auto fit = [&](ClothingKind& model, auto&&... callbacks) {
    auto trainer = volt::make_trainer(options, std::forward<decltype(callbacks)>(callbacks)...);
    trainer.save_hyperparameters(hparams);
    trainer.fit(model, volt::data::TensorLoader(few_x, few_y, {.batch_size = 64, .shuffle = true, .seed = 2}));
    return trainer.test(model, test).at("test_acc");
  };

  ClothingKind tuned;
  const auto loaded = volt::load_weights(*tuned->backbone, weights, {.skip = {"fc2.", "drop."}});
  std::cout << "loaded " << loaded.loaded.size() << " tensors into the backbone (the old head skipped)\n";
  const torch::Tensor start = tuned->backbone->conv1->weight.detach().clone();
  bool moved_while_frozen = true;
  const double tuned_acc = fit(tuned, volt::BackboneFinetuning({.unfreeze_backbone_at_epoch = 1, .verbose = true}),
                               FrozenWatch{start, &moved_while_frozen});
  const bool trained_after = !torch::equal(tuned->backbone->conv1->weight, start);

  ClothingKind scratch;
  const double scratch_acc = fit(scratch, volt::ProgressBar{});
  std::cout << "fine-tuned from the pretrained weights: test accuracy " << tuned_acc * 100.0 << "%\n"
            << "the same model from scratch:          test accuracy " << scratch_acc * 100.0 << "%\n";
  if (moved_while_frozen || !trained_after) {
    std::cerr << "finetune: the backbone " << (moved_while_frozen ? "moved while frozen" : "never trained")
              << "\n";
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) try {
  volt::TrainerOptions trainer{.max_epochs = 4, .seed = 7, .default_root_dir = "finetune_run"};
  DataOptions data;
  PretrainOptions pretrain;
  volt::Config config("finetune", "Fine-tunes the quick start's pretrained CNN for a new task with few labels.");
  config.add("trainer", trainer).add("data", data).add("pretrain", pretrain);
  if (!config.parse(argc, argv)) return 0;
  if (const auto missing = fashion_mnist::missing_file(data.dir); !missing.empty()) {
    std::cerr << "finetune: no Fashion-MNIST data: " << missing << " is missing. Install it with "
              << "`apt-get install dataset-fashion-mnist` (Debian) or pass --data.dir=FOLDER.\n";
    return 77;
  }
  std::filesystem::create_directories(trainer.default_root_dir);
  return run(trainer, data, pretrain, config.json());
} catch (const volt::ConfigError& e) {
  std::cerr << "finetune: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "finetune: " << e.what() << "\n";
  return 1;
}
