// expect: the module has no training_step for this loader's batches
#include <volt/volt.hpp>
struct Net : torch::nn::Module {
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<> trainer;
  trainer.fit(net, loader);
}
