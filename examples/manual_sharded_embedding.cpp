// ManualParallel example (b): an embedding table sharded by rows. Rank r holds rows
// [r*V/W, (r+1)*V/W) as its own parameter; a lookup fills the rows it owns, and an all-reduce (inside an
// autograd Function) assembles the full embeddings on every rank. The head after it is replicated: every
// rank computes the same loss, so the head's gradients agree without communication and each shard gets
// exactly its rows' gradient. Nothing here is averaged by the strategy.
//
//   ./manual_sharded_embedding            (starts a second rank itself)
//   mpirun -np 2 ./manual_sharded_embedding
//
// At the end the shards are gathered and compared with one process training the whole table.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <iostream>
#include <optional>

namespace {

constexpr int64_t kRows = 12, kDim = 4;
constexpr double kLr = 0.1;

torch::Tensor initial_table() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  return torch::randn({kRows, kDim}, gen);
}
torch::nn::Linear make_head() {
  torch::manual_seed(23);
  return torch::nn::Linear(kDim, 1);
}

/// Sum across ranks forward; identity backward (the loss after it is the same on every rank).
struct AllReduceSum : torch::autograd::Function<AllReduceSum> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& local, volt::Context* ctx) {
    return ctx->all_reduce(local, volt::Reduce::sum);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list grad) {
    return {grad[0], torch::Tensor()};
  }
};

struct ShardedEmbeddingImpl : torch::nn::Module {
  torch::Tensor shard;  // this rank's rows
  torch::nn::Linear head{nullptr};
  int64_t lo = 0, rows = kRows;

  explicit ShardedEmbeddingImpl(int rank, int world) {
    rows = kRows / world;
    lo = rank * rows;
    shard = register_parameter("shard", initial_table().narrow(0, lo, rows).clone());
    head = register_module("head", make_head());
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    const torch::Tensor idx = batch.data;
    const torch::Tensor mine = (idx >= lo) & (idx < lo + rows);
    const torch::Tensor local = torch::embedding(shard, (idx - lo).clamp(0, rows - 1)) * mine.unsqueeze(1).to(shard.dtype());
    const torch::Tensor full = AllReduceSum::apply(local, &ctx);
    return (head(full) - batch.target).pow(2).mean();
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(kLr)); }
};
TORCH_MODULE(ShardedEmbedding);

}  // namespace

int main() {
  at::set_num_threads(1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const torch::Tensor idx = torch::randint(0, kRows, {64}, gen, torch::kLong);
  const torch::Tensor y = torch::randn({64, 1}, gen);

  volt::Trainer<volt::ManualParallel<volt::Script>> trainer({.devices = 2, .max_epochs = 4});
  // The module's shape depends on its rank, so join (or start) the job first: with Script, a launch makes
  // this process a rank, and the strategy knows which.
  std::optional<ShardedEmbedding> model;
  trainer.strategy().launch([] { return 0; });
  model.emplace(trainer.strategy().global_rank(), trainer.strategy().world_size());
  trainer.fit(*model, volt::data::TensorLoader(idx, y, {.batch_size = 8}));

  // Gather the shards (a collective: every rank takes part), then compare on rank 0.
  auto& strategy = trainer.strategy();
  const torch::Tensor table = strategy.all_gather((*model)->shard.detach()).reshape({kRows, kDim});
  if (!trainer.is_global_zero()) return 0;

  torch::Tensor ref_table = initial_table().requires_grad_(true);
  auto ref_head = make_head();
  std::vector<torch::Tensor> params{ref_table};
  for (auto& p : ref_head->parameters()) params.push_back(p);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(kLr));
  for (int epoch = 0; epoch < 4; ++epoch) {
    for (int64_t s = 0; s < 64; s += 8) {
      opt.zero_grad();
      (ref_head(torch::embedding(ref_table, idx.narrow(0, s, 8))) - y.narrow(0, s, 8)).pow(2).mean().backward();
      opt.step();
    }
  }
  const double table_diff = (table - ref_table).abs().max().item<double>();
  const double head_diff = ((*model)->head->weight - ref_head->weight).abs().max().item<double>();
  const bool ok = table_diff < 1e-5 && head_diff < 1e-5;
  std::cout << "manual_sharded_embedding: max |table diff| = " << table_diff << ", max |head diff| = " << head_diff
            << (ok ? "  match" : "  MISMATCH") << std::endl;
  return ok ? 0 : 1;
}
