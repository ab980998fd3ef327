// expect: move the module's on_before_backward, on_after_backward or on_before_optimizer_step.*once, at capture
#include "../support/rerun_graph.hpp"  // RerunGraph, GraphCPU: graph mode on every LibTorch line
struct Net : torch::nn::Module {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return b.data.sum(); }
  volt::optim::SGD configure_optimizers() { return volt::optim::SGD(parameters(), 0.1); }
  void on_after_backward() {}  // would run inside the captured step
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::Graphed<GraphCPU>> trainer;
  trainer.fit(net, loader);
}
