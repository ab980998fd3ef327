#pragma once
/// \file
/// `BackboneFinetuning`: a pretrained backbone kept frozen for the first epochs while a new head learns, then
/// trained at a learning rate of its own that grows each epoch, as Lightning's `BackboneFinetuning`.

#include "volt/callbacks/concept.hpp"
#include "volt/stage.hpp"
#include "volt/errors.hpp"
#include "volt/weights.hpp"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace volt {

/// What BackboneFinetuning freezes, when it lets go, and the backbone's learning rate: at epoch
/// `unfreeze_backbone_at_epoch` it is `backbone_initial_lr`, or `backbone_initial_ratio_lr` times the first
/// parameter group's; at each later epoch `e` the previous one times `lambda_func(e + 1)` (Lightning's
/// `multiplicative`: 1.5), at most the first group's when `should_align`.
struct BackboneFinetuningOptions {
  std::string backbone = "backbone";  ///< the submodule's dotted name in the module (`module.backbone` in Lightning)
  int64_t unfreeze_backbone_at_epoch = 10;
  std::function<double(int64_t)> lambda_func;  ///< empty: 1.5 whatever the epoch
  double backbone_initial_ratio_lr = 0.1;
  std::optional<double> backbone_initial_lr;
  bool should_align = true;
  bool train_bn = true;  ///< the backbone's batch norms train while it is frozen (volt::freeze)
  bool verbose = false;  ///< print the learning rates each epoch (rank zero)
};

/// Freezes the module's backbone when a fit is set up, before `configure_optimizers` (so an optimizer given the
/// parameters that require gradients leaves it out, as under Lightning), and trains it from
/// `unfreeze_backbone_at_epoch` on in a parameter group of the first optimizer with its own learning rate.
///
/// Where volt departs from Lightning: the backbone's group is added to the optimizer when the fit configures it,
/// with learning rate 0 and frozen parameters (which have no gradients, so no optimizer touches them), instead of at
/// the epoch it unfreezes. The optimizer's groups are then the same for the whole fit, so a checkpoint from any
/// epoch loads into a new fit's optimizer as it is (Lightning rebuilds the groups from the callback's state), and
/// ZeRO shards the group with the rest. A learning-rate monitor shows the group at 0 until it unfreezes. A resume
/// inside an epoch does not apply that epoch's change a second time.
class BackboneFinetuning {
 public:
  explicit BackboneFinetuning(BackboneFinetuningOptions o = {}) : o_(std::move(o)) {
    if (o_.unfreeze_backbone_at_epoch < 0) {
      throw ConfigError("BackboneFinetuning: unfreeze_backbone_at_epoch = " +
                        std::to_string(o_.unfreeze_backbone_at_epoch) + "; allowed: 0 or more");
    }
    if (!o_.lambda_func) o_.lambda_func = [](int64_t) { return 1.5; };
  }

  template <class T, class M>
  void setup(T&, M& module, Stage stage) {
    if (stage != Stage::train) return;
    freeze(backbone_of(module), {.train_bn = o_.train_bn});
  }
  /// The backbone's group, learning rate 0, in the first optimizer: its parameters that the optimizer does not hold.
  template <class T, class M>
  void on_optimizers_configured(T& trainer, M& module) {
    torch::optim::Optimizer* opt = trainer.optimizer();
    if (opt == nullptr) return;
    std::set<const void*> held;
    for (const auto& group : opt->param_groups()) {
      for (const auto& p : group.params()) held.insert(p.unsafeGetTensorImpl());
    }
    std::vector<at::Tensor> params;
    for (const auto& p : backbone_of(module).parameters()) {
      if (!held.count(p.unsafeGetTensorImpl())) params.push_back(p);
    }
    group_ = -1;
    if (params.empty()) {
      if (trainer.is_global_zero()) {
        std::cerr << "volt: BackboneFinetuning: the optimizer already holds every parameter of \"" << o_.backbone
                  << "\", so it trains at the optimizer's own rate once unfrozen; give configure_optimizers only the "
                     "parameters that require gradients to let BackboneFinetuning set the backbone's rate.\n";
      }
      return;
    }
    auto options = opt->defaults().clone();
    options->set_lr(0.0);
    opt->add_param_group(torch::optim::OptimizerParamGroup(params, std::move(options)));
    group_ = static_cast<int64_t>(opt->param_groups().size()) - 1;
  }
  /// A resumed fit past the unfreezing: the backbone trains again (setup froze it).
  template <class T, class M>
  void on_fit_start(T&, M& module) {
    if (last_epoch_ >= o_.unfreeze_backbone_at_epoch) unfreeze(backbone_of(module));
  }
  template <class T, class M>
  void on_train_epoch_start(T& trainer, M& module) {
    const int64_t epoch = trainer.current_epoch();
    torch::optim::Optimizer* opt = trainer.optimizer();
    // An epoch's change is made once: volt runs no epoch-start hooks for an epoch resumed after some of its batches,
    // but a checkpoint written by a later callback in this epoch's start hooks would come back at batch 0.
    if (epoch <= last_epoch_ || epoch < o_.unfreeze_backbone_at_epoch || opt == nullptr) return;
    last_epoch_ = epoch;
    const double current = opt->param_groups().front().options().get_lr();
    double lr = 0.0;
    if (epoch == o_.unfreeze_backbone_at_epoch) {
      unfreeze(backbone_of(module));
      lr = o_.backbone_initial_lr ? *o_.backbone_initial_lr : current * o_.backbone_initial_ratio_lr;
    } else {
      lr = o_.lambda_func(epoch + 1) * previous_lr_;
      if (o_.should_align && lr > current) lr = current;
    }
    previous_lr_ = lr;
    if (group_ >= 0) opt->param_groups().at(static_cast<std::size_t>(group_)).options().set_lr(lr);
    if (o_.verbose && trainer.is_global_zero()) {
      std::cout << "BackboneFinetuning: epoch " << epoch << ": the optimizer's learning rate " << current
                << ", the backbone's " << lr << "\n";
    }
  }

  /// The backbone's learning rate last set (0 before it unfreezes).
  double backbone_lr() const { return previous_lr_; }

  std::map<std::string, double> state_dict() const {
    return {{"previous_backbone_lr", previous_lr_}, {"last_epoch", static_cast<double>(last_epoch_)}};
  }
  void load_state_dict(const std::map<std::string, double>& state) {
    previous_lr_ = state.at("previous_backbone_lr");
    last_epoch_ = static_cast<int64_t>(state.at("last_epoch"));
  }

 private:
  torch::nn::Module& backbone_of(torch::nn::Module& module) const {
    for (const auto& item : module.named_modules("", /*include_self=*/false)) {
      if (item.key() == o_.backbone) return *item.value();
    }
    std::string names;
    for (const auto& item : module.named_children()) names += (names.empty() ? "" : ", ") + item.key();
    throw ConfigError("BackboneFinetuning: the module has no submodule \"" + o_.backbone +
                      "\"; its submodules: " + (names.empty() ? "none" : names) + " (dotted names reach deeper)");
  }

  BackboneFinetuningOptions o_;
  int64_t group_ = -1;      // the backbone's parameter group in the first optimizer; -1: none
  int64_t last_epoch_ = -1;  // the last epoch whose learning rate was set
  double previous_lr_ = 0.0;
};

}  // namespace volt
