// ModelParallel example: the module says, in configure_model, which of its parts are sharded (FSDP) along which axis
// of the process mesh and which are replicated (DDP), as Lightning's ModelParallelStrategy lets a LightningModule's
// configure_model do. Here a tower of residual blocks, each block a unit (gathered as it runs, freed after), is sharded
// and the head is replicated; the input layer, in no part, is replicated too.
//
//   model_parallel [--run.mesh=flat|hybrid] [--config FILE] [--print_config] [--help]
//   ./model_parallel                                   (starts a second rank itself: the tower sharded over both ranks)
//   mpirun -np 4 ./model_parallel --run.mesh=hybrid    (a 2x2 mesh: the tower sharded along "shard", replicated
//                                                       along "replicate")
//
// At the end every rank holds the whole model again; rank 0 compares it with one process training the whole model on
// the global batches. The Trainer's options are fixed (not configurable): that loop repeats them. Exits with 2 for an
// option it does not take.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <array>
#include <iostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kWidth = 24, kBatch = 8, kSamples = 256;
constexpr int kBlocks = 4, kEpochs = 3;

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::gelu(fc(x)); }
};
TORCH_MODULE(Block);

struct TowerNetImpl : torch::nn::Module {
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList tower;
  std::string shard_axis = "data";

  TowerNetImpl() {
    torch::manual_seed(3);
    embed = register_module("embed", torch::nn::Linear(16, kWidth));
    tower = register_module("tower", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) tower->push_back(Block());
    head = register_module("head", torch::nn::Linear(kWidth, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(volt::forward_blocks<BlockImpl>(tower, embed(x), volt::Units{}));  // each block one unit
  }
  /// The parts: the tower sharded along the mesh's shard axis, the head replicated (and `embed`, in no part).
  void configure_model(volt::ModelPlan& plan) {
    plan.shard(tower, shard_axis);
    plan.replicate(head);
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto loss = (forward(batch.data) - batch.target).pow(2).mean();
    ctx.log("loss", loss, {.sync_dist = true});
    return loss;
  }
  torch::optim::AdamW configure_optimizers() {
    return torch::optim::AdamW(parameters(), torch::optim::AdamWOptions(3e-3));
  }
};
TORCH_MODULE(TowerNet);

/// The process mesh: one axis of 2 ranks, or 2x2 (sharded along one axis, replicated along the other).
enum class Mesh { flat, hybrid };

constexpr auto volt_enum_names(Mesh) {
  using P = std::pair<Mesh, std::string_view>;
  return std::array{P{Mesh::flat, "flat"}, P{Mesh::hybrid, "hybrid"}};
}

/// How the run goes.
struct RunOptions {
  Mesh mesh = Mesh::flat;
};
constexpr auto volt_fields(const RunOptions*) {
  return volt::fields({{"mesh", "flat: the tower sharded over 2 ranks; hybrid: a 2x2 mesh of 4 ranks (under mpirun)"}});
}

torch::Tensor flat(torch::nn::Module& m) {
  std::vector<torch::Tensor> v;
  for (const auto& p : m.parameters()) v.push_back(p.detach().flatten().cpu());
  return torch::cat(v);
}

}  // namespace

int main(int argc, char** argv) try {
  RunOptions run;
  volt::Config config("model_parallel",
                      "Trains a tower of blocks in parts (ModelParallel) and checks it against one process.");
  config.add("run", run);
  if (!config.parse(argc, argv)) return 0;
  at::set_num_threads(1);
  const bool hybrid = run.mesh == Mesh::hybrid;
  const int world = hybrid ? 4 : 2;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const torch::Tensor x = torch::randn({kSamples, 16}, gen);
  const torch::Tensor y = x.narrow(1, 0, 4).sum(1, true).sin();

  volt::Trainer<volt::ModelParallel<volt::Script>> trainer(
      {.devices = world, .max_epochs = kEpochs, .gradient_clip_val = 1.0});
  if (hybrid) trainer.strategy().set_mesh({{"replicate", 2}, {"shard", 2}});
  TowerNet model;
  model->shard_axis = hybrid ? "shard" : "data";
  trainer.fit(model, volt::data::TensorLoader(x, y, {.batch_size = kBatch}));
  if (!trainer.is_global_zero()) return 0;

  // One process: the global batch i is every rank's batch i (rank r's samples are r, r + world, ...), so, unshuffled,
  // samples [i * kBatch * world, (i + 1) * kBatch * world).
  TowerNet ref;
  torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(3e-3));
  for (int epoch = 0; epoch < kEpochs; ++epoch) {
    for (int64_t s = 0; s < kSamples; s += kBatch * world) {
      opt.zero_grad();
      (ref->forward(x.narrow(0, s, kBatch * world)) - y.narrow(0, s, kBatch * world)).pow(2).mean().backward();
      torch::nn::utils::clip_grad_norm_(ref->parameters(), 1.0);
      opt.step();
    }
  }
  const double diff = (flat(*model) - flat(*ref)).abs().max().item<double>();
  const bool trained = !torch::equal(flat(*ref), flat(*TowerNet()));
  const bool ok = diff < 1e-5 && trained;
  std::cout << "model_parallel (" << (hybrid ? "2x2 mesh, the tower sharded along one axis, replicated along the other"
                                             : "the tower sharded over 2 ranks")
            << ", the head replicated): max |weights - one process| = " << diff << (ok ? "  match" : "  MISMATCH")
            << std::endl;
  return ok ? 0 : 1;
} catch (const volt::ConfigError& e) {
  std::cerr << "model_parallel: " << e.what() << "\n";
  return 2;
}
