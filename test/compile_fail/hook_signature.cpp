// expect: the module's on_train_epoch_end has a signature volt does not call
#include <volt/volt.hpp>
struct Net : torch::nn::Module {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return b.data.sum(); }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.1); }
  void on_train_epoch_end(int epoch) {}  // volt passes no epoch: it is in the Context
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<> trainer;
  trainer.fit(net, loader);
}
