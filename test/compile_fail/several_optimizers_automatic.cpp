// expect: declare `static constexpr bool automatic_optimization = false;` in the module and step the optimizers
#include <volt/volt.hpp>
struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  Net() {
    a = register_module("a", torch::nn::Linear(2, 2));
    b = register_module("b", torch::nn::Linear(2, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& x, volt::Context&) { return b(a(x.data)).sum(); }
  std::tuple<torch::optim::SGD, torch::optim::Adam> configure_optimizers() {  // two optimizers, automatic mode
    return {torch::optim::SGD(a->parameters(), 0.1), torch::optim::Adam(b->parameters())};
  }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<> trainer;
  trainer.fit(net, loader);
}
