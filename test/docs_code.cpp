// The code of the guides under docs/, compiled as written: every ```cpp block of docs/*.md stands here line for line
// (test/docs_check.py checks that, as the test `docs.code`), with what it needs around it. A block that trains on the
// CPU in one process runs here on small data, and what its comments claim is checked; a block for GPUs, several
// processes or a cluster is compiled inside a function template that nothing instantiates: its names, types and
// options are checked, not its run.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <catch2/catch.hpp>

#include "../examples/gpt_model.hpp"
#include "common.hpp"
#include "support/models.hpp"

#include <algorithm>
#include <array>
#include <numeric>
#include <type_traits>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace fs = std::filesystem;

// The blocks stay as the pages write them (test/docs_check.py compares them line for line).
// clang-format off

namespace {

/// A tiny classifier with a backbone and a head (docs/weights.md and the fits below).
struct BackboneImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  BackboneImpl() { fc = register_module("fc", torch::nn::Linear(4, 8)); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(fc(x)); }
};
TORCH_MODULE(Backbone);
struct NetImpl : torch::nn::Module {
  Backbone backbone;
  torch::nn::Linear head{nullptr};
  explicit NetImpl(int64_t classes = 2) {
    register_module("backbone", backbone);
    head = register_module("head", torch::nn::Linear(8, classes));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(backbone(x)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto loss = torch::nn::functional::cross_entropy(forward(b.data), b.target);
    ctx.log("train_loss", loss);
    return loss;
  }
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("val_loss", torch::nn::functional::cross_entropy(forward(b.data), b.target));
    ctx.log("val_acc", forward(b.data).argmax(1).eq(b.target).to(torch::kFloat).mean());
  }
  volt::optim::Adam configure_optimizers() { return volt::optim::Adam(parameters(), 1e-2); }
};
TORCH_MODULE(Net);

struct Data {
  torch::Tensor x = torch::randn({64, 4});
  torch::Tensor y = (x.sum(1) > 0).to(torch::kLong);
  volt::data::TensorLoader loader() const { return volt::data::TensorLoader(x, y, {.batch_size = 16}); }
};

}  // namespace

// ---- docs/configuration.md ---------------------------------------------------------------------------------------
namespace docs_configuration {

struct Seen {
  int64_t max_epochs = 0, width = 0;
  bool fsdp = false;
} seen;

struct ModelOptions;
int train(const volt::TrainerOptions& trainer, const ModelOptions& model);

struct ModelOptions {
  int64_t layers = 4;
  int64_t width = 256;
  double lr = 3e-4;
};
constexpr auto volt_fields(const ModelOptions*) {  // found by argument-dependent lookup
  return volt::fields({{"layers", "transformer blocks"}, {"width", "embedding width"}, {"lr", "AdamW's rate"}});
}

int main(int argc, char** argv) try {
  volt::TrainerOptions trainer{.max_epochs = 5};  // the program's defaults
  ModelOptions model;
  volt::Config config("train", "Trains a small GPT.");
  config.add("trainer", trainer).add("model", model);
  if (!config.parse(argc, argv)) return 0;        // --help or --print_config printed
  return train(trainer, model);                   // trainer and model hold the effective values
} catch (const volt::ConfigError& e) {
  std::cerr << e.what() << "\n";                  // one line: the option, the value, what is allowed
  return 2;
}

int train(const volt::TrainerOptions& trainer, const ModelOptions& model) {
  seen = {trainer.max_epochs.value_or(-1), model.width, false};
  return 0;
}

template <class T>
int train(const volt::TrainerOptions& trainer, const ModelOptions& model) {
  seen = {trainer.max_epochs.value_or(-1), model.width, std::is_same_v<T, volt::Trainer<volt::FSDP<>, volt::Fp32>>};
  return 0;
}

enum class Strategy { single, ddp, fsdp };
constexpr auto volt_enum_names(Strategy) {
  using P = std::pair<Strategy, std::string_view>;
  return std::array{P{Strategy::single, "single"}, P{Strategy::ddp, "ddp"}, P{Strategy::fsdp, "fsdp"}};
}
struct RunOptions {
  Strategy strategy = Strategy::single;
};
constexpr auto volt_fields(const RunOptions*) { return volt::fields({{"strategy", "how the model is spread"}}); }

int run_with(const RunOptions& run, const volt::TrainerOptions& trainer, const ModelOptions& model) {
  switch (run.strategy) {  // --run.strategy=ddp
    case Strategy::single: return train<volt::Trainer<volt::SingleDevice, volt::Fp32>>(trainer, model);
    case Strategy::ddp: return train<volt::Trainer<volt::DDP<>, volt::Fp32>>(trainer, model);
    case Strategy::fsdp: return train<volt::Trainer<volt::FSDP<>, volt::Fp32>>(trainer, model);
  }
  return 2;
}

}  // namespace docs_configuration

TEST_CASE("docs/configuration.md: the program reads flags, and a configuration picks a compiled Trainer type",
          "[docs]") {
  using namespace docs_configuration;
  std::vector<std::string> args = {"train", "--trainer.max_epochs=7", "--model.width=128"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  CHECK(docs_configuration::main(static_cast<int>(argv.size()), argv.data()) == 0);
  CHECK(seen.max_epochs == 7);
  CHECK(seen.width == 128);
  std::vector<std::string> bad = {"train", "--model.widht=128"};
  std::vector<char*> bad_argv;
  for (auto& a : bad) bad_argv.push_back(a.data());
  CHECK(docs_configuration::main(static_cast<int>(bad_argv.size()), bad_argv.data()) == 2);

  RunOptions run;
  volt::TrainerOptions trainer;
  ModelOptions model;
  volt::Config config("train", "");
  config.add("trainer", trainer).add("model", model).add("run", run);
  const char* flags[] = {"train", "--run.strategy=fsdp"};
  REQUIRE(config.parse(2, flags));
  CHECK(run_with(run, trainer, model) == 0);
  CHECK(seen.fsdp);

  // The configuration as the run's hyper-parameters: in the checkpoint and beside the logs.
  const fs::path dir = scratch("docs_hparams");
  trainer.default_root_dir = dir.string();
  trainer.max_epochs = 1;
  auto fit = [&](volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU, volt::CSVLogger>& trainer) {
    trainer.save_hyperparameters(config.json());
    Data d;
    auto loader = d.loader();
    Net net;
    trainer.fit(net, loader);
    CHECK(trainer.hyper_parameters()["run"]["strategy"] == "fsdp");
    CHECK(fs::exists(trainer.template callback<volt::CSVLogger>().log_dir() / "hparams.yaml"));
  };
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU, volt::CSVLogger> t(trainer, volt::CSVLogger{});
  fit(t);
  fs::remove_all(dir);
}

// ---- docs/checkpoints.md, docs/logging.md, docs/weights.md: one-process fits ------------------------------------
TEST_CASE("docs/checkpoints.md, logging.md, weights.md: the fits and weight moves as written", "[docs]") {
  const fs::path dir = scratch("docs_code");
  const fs::path old = fs::current_path();
  fs::current_path(dir);  // the blocks write relative paths: checkpoints/, volt_logs/, model.safetensors
  struct Back {  // the folder the test started in, and the scratch folder removed, also when a check throws
    fs::path to, scratch;
    ~Back() {
      fs::current_path(to);
      std::error_code ec;
      fs::remove_all(scratch, ec);
    }
  } back{old, dir};
  torch::manual_seed(1);
  Data d;
  auto train = d.loader(), val = d.loader();
  Net model;

  {
    auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
        volt::TrainerOptions{.max_epochs = 10},
        volt::ModelCheckpoint(volt::ModelCheckpoint::Options{.monitor = "val_loss", .save_top_k = 3, .save_last = true,
                                                             .every_n_train_steps = 500}));
    trainer.fit(model, train, val, "last");   // resumes from checkpoints/last.ckpt when there is one
    CHECK(trainer.global_step() == 40);      // 4 batches x 10 epochs
    CHECK(fs::exists("checkpoints/last.ckpt"));
  }
  {
    auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
        volt::TrainerOptions{.max_epochs = 3, .log_every_n_steps = 50},
        volt::ModelSummary{}, volt::CSVLogger{},
        volt::TensorBoardLogger(volt::TensorBoardLogger::Options{.hparams = {{"lr", 2e-3}, {"optimizer", "Adam"}},
                                                                 .hparam_metrics = {"val_acc"}}),
        volt::ThroughputMonitor{}, volt::DeviceStatsMonitor{});
    Net fresh_model;
    trainer.fit(fresh_model, train, val);
    CHECK(fs::exists(trainer.template callback<volt::CSVLogger>().metrics_file()));
  }
  {
    // pretrained.safetensors: a backbone's tensors under "encoder." (another program's names)
    Backbone encoder_weights;
    volt::save_safetensors(*encoder_weights, "pretrained_plain.safetensors");
    volt::TensorFile renamed = volt::safetensors::read("pretrained_plain.safetensors");
    for (auto& [name, t] : renamed.tensors) name = "encoder." + name;
    volt::safetensors::write("pretrained.safetensors", renamed);

    volt::save_safetensors(*model, "model.safetensors");       // Python: net.load_state_dict(load_file(path))
    Net fresh(/*classes=*/3);                                   // another head
    auto r = volt::load_weights(*fresh, "model.safetensors", {.skip = {"head."}, .strict = false});
    // r.loaded: the backbone's names, r.missing: {"head.bias", "head.weight"}
    volt::load_weights(*fresh->backbone, "pretrained.safetensors", {.rename = {{"encoder.", ""}}, .strict = false});
    volt::freeze(*fresh->backbone);                             // requires_grad off; batch norms stay trainable

    CHECK(r.loaded == std::vector<std::string>{"backbone.fc.bias", "backbone.fc.weight"});
    CHECK(r.missing == std::vector<std::string>{"head.bias", "head.weight"});
    CHECK(torch::equal(fresh->backbone->fc->weight, encoder_weights->fc->weight));
    CHECK_FALSE(fresh->backbone->fc->weight.requires_grad());
    CHECK(fresh->head->weight.requires_grad());
  }
}

// ---- docs/data.md ------------------------------------------------------------------------------------------------
namespace docs_data {

struct Images {  // a data set read one sample at a time; get is const and runs on several threads
  int64_t size() const;
  torch::data::Example<> get(int64_t index, at::Generator& gen) const;  // random augmentation from gen only
};
volt::data::SampleLoader train(Images{}, volt::data::LoaderOptions{.batch_size = 64, .shuffle = true, .seed = 1,
                                                               .num_workers = 2, .prefetch_factor = 2,
                                                               .pin_memory = true});
int64_t Images::size() const { return 256; }
torch::data::Example<> Images::get(int64_t index, at::Generator& gen) const {
  auto image = torch::full({1, 4, 4}, static_cast<double>(index));
  const bool flip = torch::randint(2, {1}, gen).item<int64_t>() == 1;
  return {flip ? image.flip({2}) : image, torch::tensor(index)};
}

}  // namespace docs_data

TEST_CASE("docs/data.md: the SampleLoader block reads every sample once an epoch, with workers", "[docs]") {
  std::vector<int64_t> seen;
  for (const auto& batch : docs_data::train) {
    for (int64_t i = 0; i < batch.target.size(0); ++i) seen.push_back(batch.target[i].item<int64_t>());
  }
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(256);
  std::iota(all.begin(), all.end(), 0);
  CHECK(seen == all);
}

// ---- docs/manual_optimization.md ----------------------------------------------------------------------------------
namespace docs_manual {

using Batch = torch::data::Example<>;

struct Gan : torch::nn::Module {
  static constexpr bool automatic_optimization = false;
  torch::nn::Linear generator = register_module("generator", torch::nn::Linear(8, 4));  // noise to a sample
  torch::nn::Linear discriminator = register_module("discriminator", torch::nn::Linear(4, 1));
  std::tuple<volt::optim::Adam, volt::optim::Adam> configure_optimizers();  // the generator's, the discriminator's
  void training_step(const Batch& batch, volt::Context& ctx) {
    auto opts = ctx.optimizers();
    ctx.toggle_optimizer(opts[1]);  // only the discriminator's parameters require gradients
    auto d_loss = discriminator_loss(batch);
    opts[1].zero_grad();
    ctx.manual_backward(d_loss);    // the precision's loss scaling, DDP's gradient averaging
    ctx.clip_gradients(opts[1], 1.0);
    opts[1].step();                 // unscaling and inf skip, global_step, its step-interval scheduler
    ctx.untoggle_optimizer(opts[1]);
    ctx.toggle_optimizer(opts[0]);  // the generator's step, likewise
    auto g_loss = generator_loss(batch);
    opts[0].zero_grad();
    ctx.manual_backward(g_loss);
    opts[0].step();
    ctx.untoggle_optimizer(opts[0]);
  }
  torch::Tensor discriminator_loss(const Batch& batch);
  torch::Tensor generator_loss(const Batch& batch);
};
std::tuple<volt::optim::Adam, volt::optim::Adam> Gan::configure_optimizers() {
  return {volt::optim::Adam(generator->parameters(), 1e-3), volt::optim::Adam(discriminator->parameters(), 1e-3)};
}
torch::Tensor Gan::discriminator_loss(const Batch& batch) {
  const auto noise = torch::randn({batch.data.size(0), 8});
  const auto real = discriminator(batch.data), fake = discriminator(generator(noise).detach());
  return torch::softplus(-real).mean() + torch::softplus(fake).mean();
}
torch::Tensor Gan::generator_loss(const Batch& batch) {
  return torch::softplus(-discriminator(generator(torch::randn({batch.data.size(0), 8})))).mean();
}

}  // namespace docs_manual

TEST_CASE("docs/manual_optimization.md: the GAN block steps both players each batch", "[docs]") {
  const fs::path dir = scratch("docs_manual");
  Data d;
  auto loader = d.loader();
  docs_manual::Gan gan;
  const auto g0 = gan.generator->weight.clone(), d0 = gan.discriminator->weight.clone();
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      volt::TrainerOptions{.max_epochs = 1, .default_root_dir = dir.string()});
  trainer.fit(gan, loader);
  CHECK(trainer.global_step() == 8);  // 4 batches, two optimizer steps each
  CHECK_FALSE(torch::equal(gan.generator->weight, g0));
  CHECK_FALSE(torch::equal(gan.discriminator->weight, d0));
  fs::remove_all(dir);
}

// ---- docs/transformers.md -----------------------------------------------------------------------------------------
namespace docs_transformers {

/// The summed loss over the batch's real tokens (id 0 is padding) and their count (the block's model predicts the
/// next token of `b.data`; here the targets are the ids themselves).
inline std::pair<torch::Tensor, torch::Tensor> masked_cross_entropy(const torch::data::Example<>& b) {
  const auto real = b.target.ne(0);
  const auto none = torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone);
  const auto losses = torch::nn::functional::cross_entropy(b.data.flatten(0, 1), b.target.flatten(), none);
  return {(losses * real.flatten()).sum(), real.sum()};
}

struct LanguageModelImpl : torch::nn::Module {
  gpt::GPT net{nullptr};  // built with .checkpointing = volt::ActivationCheckpointing{.every = 1}
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto [sum, count] = masked_cross_entropy(b);          // over the real tokens of the batch
    ctx.weigh_loss(count);                                // its loss is a mean over `count` tokens
    ctx.log("train_loss", sum / count, {.batch_size = count.item<int64_t>()});  // epoch mean per token too
    return sum / count;
  }
  volt::OptimizerConfig configure_optimizers() {
    const auto defaults = torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95});
    auto opt = std::make_shared<volt::optim::AdamW>(volt::optim::weight_decay_groups(*this, 0.1, defaults), defaults);
    auto warm = std::make_shared<volt::optim::LinearLR>(*opt, volt::optim::LinearLROptions{.start_factor = 0.01,
                                                                                          .total_iters = 60});
    auto decay = std::make_shared<volt::optim::CosineAnnealingLR>(
        *opt, volt::optim::CosineAnnealingLROptions{.t_max = 540, .eta_min = 3e-4});
    return {.optimizer = opt,
            .scheduler = std::make_shared<volt::optim::SequentialLR>(*opt, volt::optim::Schedules{warm, decay},
                                                                     std::vector<int64_t>{60}),
            .interval = volt::Interval::step};
  }
};

}  // namespace docs_transformers

// ---- blocks for GPUs, several processes or a cluster: compiled, not run -------------------------------------------
namespace docs_compiled_only {

// The GPU blocks name Trainer types that reduce with NCCL: compiled where volt_tests links volt::nccl (the 2.11 lane).
#if VOLT_WITH_NCCL
// docs/architecture.md
template <class Model, class Loader>
void architecture(Model& model, Loader& train_loader, Loader& val_loader) {
  volt::Trainer<volt::DDP<volt::Spawn>, volt::Bf16Mixed, volt::GPU> trainer({.devices = 4, .max_epochs = 10});
  trainer.fit(model, train_loader, val_loader);
}
#endif

// docs/distributed.md
template <class Model>
void several_processes(Model& model, const torch::Tensor& x, const torch::Tensor& y) {
  volt::Trainer<volt::DDP<volt::Script>> trainer(volt::TrainerOptions{.devices = 2, .max_epochs = 5});  // CPU, Open MPI
  trainer.fit(model, volt::data::TensorLoader(x, y, volt::data::LoaderOptions{.batch_size = 64, .shuffle = true}));
}
template <class Model, class Loader>
void cluster(Model& model, Loader& loader) {
  volt::Trainer<volt::DDP<volt::Script>> trainer(volt::TrainerOptions{.devices = 2, .num_nodes = 2, .max_epochs = 10});
  trainer.fit(model, loader, "last");   // the first run finds no checkpoint and starts from the beginning
}

#if VOLT_WITH_NCCL
// docs/sharding.md
template <class Block, class Blocks, class Encoder>
void sharding(Blocks& blocks, torch::Tensor x, Encoder& encoder, torch::Tensor h, const torch::Tensor& mask) {
  {
    volt::Trainer<volt::ZeRO<2, volt::Spawn>, volt::Bf16Mixed, volt::GPU> trainer(volt::TrainerOptions{.devices = 8});
    volt::Trainer<volt::ZeRO<1, volt::Script, volt::Mpi>, volt::Fp32, volt::CPU> cpu(volt::TrainerOptions{.devices = 4});
  }
  volt::Trainer<volt::FSDP<volt::Spawn>, volt::Bf16Mixed, volt::GPU> trainer(volt::TrainerOptions{.devices = 8});
  // in the model's forward: each block one unit (a plain call under any other strategy)
  x = volt::forward_blocks<Block>(blocks, x, volt::Units{}, volt::ActivationCheckpointing{.every = 1});
  h = volt::sharded_call(encoder, h, mask);  // an irregular model: this module's parameters, one unit
}
#endif
template <class Module>
void model_parallel(Module&) {
  auto trainer = volt::make_trainer<volt::ModelParallel<volt::Script, volt::Mpi>>({.devices = 4});
  trainer.strategy().set_mesh({{"replicate", 2}, {"shard", 2}});  // default: {{"data", -1}}, one axis of every rank
  trainer.strategy().set_mesh({{"replicate", 1}, {"shard", 2}, {"tensor", 2, volt::AxisRole::tensor}});
}
struct PlannedModule : torch::nn::Module {
  torch::nn::Linear tower{nullptr}, head{nullptr};
  void configure_model(volt::ModelPlan& plan) {
    plan.shard(tower, "shard");  // FSDP along "shard", replicated along "replicate" (hybrid sharding, FSDP2's HSDP)
    plan.replicate(head);        // DDP, as whatever no part holds
  }
};

}  // namespace docs_compiled_only
// clang-format on
