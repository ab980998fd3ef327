// expect: return a volt::optim optimizer \(Adam, AdamW, SGD\) from configure_optimizers.*cannot be captured
#include "../support/rerun_graph.hpp"  // RerunGraph, GraphCPU: graph mode on every LibTorch line
struct Net : torch::nn::Module {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return b.data.sum(); }
  torch::optim::Adam configure_optimizers() { return torch::optim::Adam(parameters()); }  // reads its steps on the host
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::Graphed<GraphCPU>> trainer;
  trainer.fit(net, loader);
}
