// expect: use SingleDevice with Graphed<GPU>, or the distributed strategy .DDP, ZeRO, FSDP, ModelParallel. with the GPU without Graphed
#include "../support/rerun_graph.hpp"  // RerunGraph, GraphCPU: graph mode on every LibTorch line
struct Net : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  Net() { fc = register_module("fc", torch::nn::Linear(2, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return fc(b.data).sum(); }
  volt::optim::SGD configure_optimizers() { return volt::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<volt::ZeRO<2, volt::Script, volt::Mpi>, volt::Fp32, volt::Graphed<GraphCPU>> trainer;
  trainer.fit(net, loader);
}
