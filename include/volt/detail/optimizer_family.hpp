#pragma once
/// \file
/// Which LibTorch optimizer family an optimizer object belongs to, told once: the checkpoint names it (and refuses
/// to resume one family's state into another), ZeRO picks the codec of its elementwise state by it. volt::optim's
/// optimizers derive from LibTorch's, whose state they keep, so they belong to the LibTorch family they extend. (Which
/// optimizer *type* a module's configure_optimizers returns, known at compile time, is `module_optimizer_t` in
/// volt/module.hpp: graph mode asks it whether the step can be captured.)

#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <string>
#include <typeinfo>

namespace volt::detail {

enum class OptimizerFamily { adamw, adam, sgd, rmsprop, adagrad, lbfgs, other };

/// The family of `optimizer` (AdamW asked before Adam: a class may derive from both lines' Adam).
inline OptimizerFamily optimizer_family(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) return OptimizerFamily::adamw;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) return OptimizerFamily::adam;
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr) return OptimizerFamily::sgd;
  if (dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr) return OptimizerFamily::rmsprop;
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr) return OptimizerFamily::adagrad;
  if (dynamic_cast<const torch::optim::LBFGS*>(&optimizer) != nullptr) return OptimizerFamily::lbfgs;
  return OptimizerFamily::other;
}

/// The LibTorch class whose state `optimizer` keeps ("torch::optim::Adam" for volt::optim::Adam too), or the type's
/// own name for an optimizer of another family.
inline std::string optimizer_family_name(const torch::optim::Optimizer& optimizer) {
  switch (optimizer_family(optimizer)) {
    case OptimizerFamily::adamw: return "torch::optim::AdamW";
    case OptimizerFamily::adam: return "torch::optim::Adam";
    case OptimizerFamily::sgd: return "torch::optim::SGD";
    case OptimizerFamily::rmsprop: return "torch::optim::RMSprop";
    case OptimizerFamily::adagrad: return "torch::optim::Adagrad";
    case OptimizerFamily::lbfgs: return "torch::optim::LBFGS";
    case OptimizerFamily::other: break;
  }
  return c10::demangle(typeid(optimizer).name());
}

}  // namespace volt::detail
