// expect: use SingleDevice with Graphed<GPU>, or the distributed strategy .DDP, ZeRO, FSDP, ModelParallel. with the GPU without Graphed
// Graph mode under a distributed strategy is refused first, before the build's rules: against a LibTorch without CUDA
// (Graphed<GPU> not compiled in, DDP's automatic backend NCCL) the sentence is still this one, whose fix is the one
// that helps, not a CUDA build that would only bring it next.
#include <volt/volt.hpp>
struct Net : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  Net() { fc = register_module("fc", torch::nn::Linear(2, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return fc(b.data).sum(); }
  volt::optim::SGD configure_optimizers() { return volt::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<volt::DDP<volt::Script>, volt::Fp32, volt::Graphed<volt::GPU>> trainer;
  trainer.fit(net, loader);
}
