// expect: use the accelerator without Graphed for a module with manual optimization
#include <volt/volt.hpp>
struct RerunGraph {  // a graph type of one's own, so that the rule is reached on every LibTorch line
  static constexpr bool available = true;
  template <class F> void run_eager(const c10::Device&, F&& f) { f(); }
  template <class F> void capture(const c10::Device&, F&&, const RerunGraph*) {}
  void replay() {}
};
struct GraphCPU : volt::CPU { using graph_type = RerunGraph; };
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
