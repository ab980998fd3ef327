// expect: return a volt::optim optimizer \(Adam, AdamW, SGD\) from configure_optimizers.*cannot be captured
#include <volt/volt.hpp>
struct RerunGraph {  // a graph type of one's own, so that the rule is reached on every LibTorch line
  static constexpr bool available = true;
  template <class F> void run_eager(const c10::Device&, F&& f) { f(); }
  template <class F> void capture(const c10::Device&, F&&, const RerunGraph*) {}
  void replay() {}
};
struct GraphCPU : volt::CPU { using graph_type = RerunGraph; };
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
