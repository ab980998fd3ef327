#pragma once
// A strategy and a callback written from their concept files alone (volt/strategies/concept.hpp and
// volt/callbacks/concept.hpp), with nothing copied from volt's own policies: they show that the tables there list
// everything volt calls. Catch-free, so the static truth table and the trainer tests both use them.

#include <volt/callbacks/concept.hpp>
#include <volt/strategies/concept.hpp>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace vt {

/// One process on the CPU that counts what the Trainer asks of it. From strategies/concept.hpp: derive from
/// StrategyDefaults, write the rest of the table.
struct CountingStrategy : volt::StrategyDefaults {
  static constexpr bool is_distributed = false;
  static constexpr const char* name = "CountingStrategy";

  /// How often each member was called (shared by copies, so a test reads it after the Trainer took one).
  struct Counts {
    int launches = 0, fit_launches = 0, setups = 0, modules = 0, loaders = 0, pre_backward = 0, post_backward = 0,
        synced_backward = 0, teardowns = 0;
  };
  std::shared_ptr<Counts> counts = std::make_shared<Counts>();
  torch::Device device = torch::kCPU;

  void check_devices(const volt::TrainerOptions& options, int available, const char* accelerator) const {
    if (options.devices != 1 || available < 1) throw volt::ConfigError(std::string("one ") + accelerator + " device");
  }
  template <class F>
  decltype(auto) launch(F&& body) {
    ++counts->launches;
    return std::forward<F>(body)();
  }
  template <class F, class T>
  decltype(auto) launch(F&& body, T& /*transfer: the body runs here*/) {
    ++counts->fit_launches;
    return std::forward<F>(body)();
  }
  void setup_environment(torch::Device d) {
    ++counts->setups;
    device = d;
  }
  void setup_module(torch::nn::Module& m) {
    ++counts->modules;
    m.to(device);
  }
  template <class L>
  L&& process_dataloader(L&& loader, volt::Stage) {
    ++counts->loaders;
    return std::forward<L>(loader);
  }
  int global_rank() const { return 0; }
  int local_rank() const { return 0; }
  int world_size() const { return 1; }
  bool is_global_zero() const { return true; }
  torch::Device root_device() const { return device; }
  torch::Tensor all_reduce(const torch::Tensor& t, volt::Reduce) { return t; }
  bool reduce_boolean_decision(bool decision, bool) { return decision; }
  void barrier() {}
  void pre_backward(bool sync) {
    ++counts->pre_backward;
    if (sync) ++counts->synced_backward;
  }
  void post_backward() { ++counts->post_backward; }
  void teardown() { ++counts->teardowns; }
};

/// Records each epoch's logged training loss and keeps it in checkpoints. From callbacks/concept.hpp: hooks
/// take (trainer, module, ...); state as a map of numbers; monitors_metrics so the module's epoch-end logs are seen.
struct EpochLossLog {
  static constexpr bool monitors_metrics = true;
  std::string metric = "train_loss";
  std::vector<double> losses;

  void on_train_epoch_end(auto& trainer, auto& /*module*/) {
    const auto values = trainer.callback_metric_values();
    if (auto it = values.find(metric); it != values.end()) losses.push_back(it->second);
  }
  std::string state_key() const { return "EpochLossLog[" + metric + "]"; }
  std::map<std::string, double> state_dict() const {
    std::map<std::string, double> s;
    for (std::size_t i = 0; i < losses.size(); ++i) s["epoch" + std::to_string(i)] = losses[i];
    return s;
  }
  void load_state_dict(const std::map<std::string, double>& s) {
    losses.assign(s.size(), 0.0);
    for (std::size_t i = 0; i < losses.size(); ++i) losses[i] = s.at("epoch" + std::to_string(i));
  }
};

}  // namespace vt
