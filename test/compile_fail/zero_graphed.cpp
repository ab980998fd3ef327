// expect: use SingleDevice with Graphed<GPU>, or DDP or ZeRO with the GPU without Graphed
#include <volt/volt.hpp>
struct RerunGraph {  // a graph type of one's own, so that the rule is reached on every LibTorch line
  static constexpr bool available = true;
  template <class F> void run_eager(const c10::Device&, F&& f) { f(); }
  template <class F> void capture(const c10::Device&, F&&, const RerunGraph*) {}
  void replay() {}
};
struct GraphCPU : volt::CPU { using graph_type = RerunGraph; };
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
