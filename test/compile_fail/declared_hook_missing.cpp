// expect: the type declares volt::hook::on_train_epoch_end in its volt_hooks and has no member named on_train_epoch_end
// A callback that lists the hooks it implements (volt/declared_hooks.hpp) and misspells one of them in its class: the
// misspelt member alone would compile and never be called.
#include <volt/volt.hpp>
struct EpochTimer {
  using volt_hooks = volt::Hooks<volt::hook::on_train_epoch_start, volt::hook::on_train_epoch_end>;
  void on_train_epoch_start(auto&, auto&) {}
  void on_train_epoch_ends(auto&, auto&) {}  // misspelt
};
struct Net : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  Net() { fc = register_module("fc", torch::nn::Linear(2, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return fc(b.data).sum(); }
  volt::optim::SGD configure_optimizers() { return volt::optim::SGD(parameters(), 0.1); }
};
int main() {
  Net net;
  std::vector<torch::data::Example<>> loader;
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU, EpochTimer> trainer({}, EpochTimer{});
  trainer.fit(net, loader);
}
