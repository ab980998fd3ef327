// expect: train a module with manual optimization under DDP, or let the sharded strategy .ZeRO<1>, ZeRO<2>, FSDP, ModelParallel. step it automatically
#include <volt/volt.hpp>
struct Net : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  Net() { fc = register_module("fc", torch::nn::Linear(2, 1)); }
  static constexpr bool automatic_optimization = false;  // steps its optimizer itself
  void training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.manual_backward(fc(b.data).sum());
    ctx.optimizer().step();
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<volt::ZeRO<2, volt::Script, volt::Mpi>, volt::Fp32, volt::CPU> trainer;
  trainer.fit(net, loader);
}
