// expect: fit needs a torch::nn::Module .* with configure_optimizers
#include <volt/volt.hpp>
struct Net : torch::nn::Module {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return b.data.sum(); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<> trainer;
  trainer.fit(net, loader);
}
