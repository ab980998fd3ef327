// ManualParallel example (a): ranks take different numbers of samples per step, so averaging gradients
// over the world size would be wrong; the module sums its own losses and divides the all-reduced gradient
// by the global sample count. Every rank sees the same global batch (ManualParallel leaves loaders alone)
// and takes its own uneven slice of it.
//
//   ./manual_variable_batch            (starts a second rank itself: Script's self-relaunch)
//   mpirun -np 2 ./manual_variable_batch
//
// Rank 0 checks the result against one process training on the whole global batches with the mean loss:
// the two must agree to float tolerance; the exit status says whether they do.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <iostream>

namespace {

constexpr int64_t kGlobalBatch = 10;
constexpr double kLr = 0.05;

torch::nn::Sequential make_net() {
  torch::manual_seed(42);
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 1));
}

std::pair<torch::Tensor, torch::Tensor> make_data() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto x = torch::randn({60, 4}, gen);
  auto y = x.sum(1, true).sin();
  return {x, y};
}

/// Rank 0 takes the first 2 + (batch_idx % 4) samples of each global batch; rank 1 the rest.
std::pair<int64_t, int64_t> my_slice(int rank, int world, int64_t batch_idx, int64_t n) {
  if (world == 1) return {0, n};
  const int64_t first = 2 + batch_idx % 4;
  return rank == 0 ? std::pair<int64_t, int64_t>{0, first} : std::pair<int64_t, int64_t>{first, n - first};
}

struct VariableBatchImpl : torch::nn::Module {
  torch::nn::Sequential net{nullptr};
  VariableBatchImpl() { net = register_module("net", make_net()); }

  void on_fit_start(volt::Context& ctx) {  // the module owns its state: make every rank start from rank 0's
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) ctx.broadcast_(p, 0);
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto [start, len] = my_slice(ctx.global_rank(), ctx.world_size(), ctx.batch_idx(), batch.data.size(0));
    auto x = batch.data.narrow(0, start, len), y = batch.target.narrow(0, start, len);
    local_samples_ = len;
    return (net->forward(x) - y).pow(2).sum();  // a sum: normalised below by the global count
  }
  void on_after_backward(volt::Context& ctx) {
    torch::NoGradGuard no_grad;
    const double global = ctx.all_reduce(torch::tensor({static_cast<double>(local_samples_)}), volt::Reduce::sum).item<double>();
    for (auto& p : parameters()) p.mutable_grad().copy_(ctx.all_reduce(p.grad(), volt::Reduce::sum) / global);
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(kLr)); }

 private:
  int64_t local_samples_ = 0;
};
TORCH_MODULE(VariableBatch);

}  // namespace

int main() {
  at::set_num_threads(1);
  auto [x, y] = make_data();
  VariableBatch model;
  volt::Trainer<volt::ManualParallel<volt::Script>> trainer({.devices = 2, .max_epochs = 3});
  trainer.fit(model, volt::data::TensorLoader(x, y, {.batch_size = kGlobalBatch}));
  if (!trainer.is_global_zero()) return 0;

  // The reference: one process, whole global batches, mean loss.
  auto ref = make_net();
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(kLr));
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (int64_t s = 0; s < x.size(0); s += kGlobalBatch) {
      opt.zero_grad();
      (ref->forward(x.narrow(0, s, kGlobalBatch)) - y.narrow(0, s, kGlobalBatch)).pow(2).mean().backward();
      opt.step();
    }
  }
  double worst = 0;
  auto got = model->net->parameters(), want = ref->parameters();
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, (got[i] - want[i]).abs().max().item<double>());
  const bool ok = worst < 1e-5;
  std::cout << "manual_variable_batch: max |2 ranks - 1 process| = " << worst << (ok ? "  match" : "  MISMATCH") << std::endl;
  return ok ? 0 : 1;
}
