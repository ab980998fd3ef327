// expect: use the accelerator without Graphed for a module with manual optimization
#include "../support/rerun_graph.hpp"  // RerunGraph, GraphCPU: graph mode on every LibTorch line
struct Net : torch::nn::Module {
  static constexpr bool automatic_optimization = false;  // steps its optimizer itself
  void training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.manual_backward(b.data.sum());
    ctx.optimizer().step();
  }
  volt::optim::SGD configure_optimizers() { return volt::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::Graphed<GraphCPU>> trainer;
  trainer.fit(net, loader);
}
