// expect: this batch type is unknown to volt.*BatchTraits
#include <volt/volt.hpp>
struct MyBatch { torch::Tensor x; };
struct Net : torch::nn::Module {
  torch::Tensor training_step(const MyBatch& b, volt::Context&) { return b.x.sum(); }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<MyBatch> loader;
  volt::Trainer<volt::SingleDevice, volt::Fp64True> trainer;  // Fp64True casts inputs: volt must see inside
  trainer.fit(net, loader);
}
