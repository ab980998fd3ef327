// expect: fit was given a validation loader but the module has no validation_step
#include <volt/volt.hpp>
struct Net : torch::nn::Module {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return b.data.sum(); }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<> trainer;
  trainer.fit(net, loader, loader);
}
