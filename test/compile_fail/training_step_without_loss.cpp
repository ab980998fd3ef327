// expect: return the loss \(a torch::Tensor\) from training_step, or declare `static constexpr bool automatic_optimization = false;`
#include <volt/volt.hpp>
struct Net : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  Net() { lin = register_module("lin", torch::nn::Linear(2, 1)); }
  void training_step(const torch::data::Example<>& b, volt::Context& ctx) { ctx.log("x", lin(b.data).sum()); }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<> trainer;
  trainer.fit(net, loader);
}
