#pragma once
/// \file
/// `volt::ModelPlan`: what a module's `configure_model` hook says of its parts: which are sharded, on which axis of the
/// strategy's mesh, and which are replicated, as Lightning's `ModelParallelStrategy` lets `configure_model` apply
/// FSDP2's `fully_shard` to some modules and leave others replicated.
/// \code
///   void configure_model(volt::ModelPlan& plan) {
///     plan.shard(blocks, "shard");  // FSDP along the mesh's "shard" axis, replicated along the other axis (HSDP)
///     plan.replicate(head);         // DDP over every rank, as whatever no part holds
///     plan.units(blocks);           // the units, in the order the forward runs them: laid out before the first step
///   }
/// \endcode
/// The Trainer calls the hook at the start of every run (fit, validate, test, predict), after the strategy has placed
/// the module and before the precision converts it, under every strategy: `volt::ModelParallel`
/// (strategies/model_parallel.hpp) lays the parts out as planned, and every other strategy leaves its parts unread, so
/// that the same module runs on one device, under DDP or under FSDP as it is. The units of a fully sharded part run
/// where the model calls them (volt/units.hpp); declared here too (`unit`, `units`, in the order the forward runs
/// them), FSDP and ModelParallel's sharded parts lay the parameters out in them at the fit's start, so that its first
/// step runs sharded, and check every step's order against the declaration; undeclared, the first training step runs
/// with the parameters whole and its order is the one later steps keep. What of a sharded part runs in no unit is
/// gathered when a forward starts. A plan names modules, not parameters; a parameter in two parts is refused where
/// the strategy reads the plan.

#include "volt/errors.hpp"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace volt {

class ModelPlan {
 public:
  /// One planned part: a module and the mesh axis it is sharded along (empty: replicated over every rank).
  struct Part {
    torch::nn::Module* module;
    std::string axis;
    bool operator==(const Part&) const = default;
  };

  /// `part` (a module or a module holder) sharded along the mesh axis `axis`, each rank on the axis keeping its shard
  /// of every unit, and replicated along the mesh's other axis where it has two (hybrid sharding, FSDP2's HSDP).
  template <class M>
  void shard(M& part, std::string axis = "data") {
    if (axis.empty()) throw ConfigError("volt: ModelPlan::shard takes the name of a mesh axis, got an empty one.");
    add({module_of(part), std::move(axis)});
  }
  /// `part` replicated over every rank (DDP), as whatever no part holds.
  template <class M>
  void replicate(M& part) {
    add({module_of(part), std::string()});
  }

  /// `unit` (a module or a module holder) is a unit of a fully sharded strategy, run after those declared before it.
  template <class M>
  void unit(M& unit) {
    torch::nn::Module* m = module_of(unit);
    if (std::find(units_.begin(), units_.end(), m) != units_.end()) {
      throw ConfigError("volt: configure_model declared a " + m->name() + " as a unit twice; declare each unit once, "
                        "in the order the forward runs them.");
    }
    units_.push_back(m);
  }
  /// Each module of `list` a unit, in its order (the blocks `forward_blocks` runs with `volt::Units`).
  void units(const torch::nn::ModuleList& list) {
    for (const auto& m : *list) unit(*m);
  }

  const std::vector<Part>& parts() const { return parts_; }
  /// The declared units, in the order the forward runs them (empty: none declared).
  const std::vector<torch::nn::Module*>& declared_units() const { return units_; }
  bool operator==(const ModelPlan&) const = default;

 private:
  template <class M>
  static torch::nn::Module* module_of(M& part) {
    if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
      return &part;
    } else {
      static_assert(requires { part.ptr(); }, "volt: ModelPlan takes a module or a module holder (TORCH_MODULE) as a "
                                              "part: the module's parameters are the part's.");
      return part.ptr().get();
    }
  }
  void add(Part part) {
    for (const Part& p : parts_) {
      if (p.module == part.module) {
        throw ConfigError("volt: configure_model planned a " + part.module->name() + " twice (as " +
                          (p.axis.empty() ? std::string("replicated") : "sharded along " + p.axis) + ", then as " +
                          (part.axis.empty() ? std::string("replicated") : "sharded along " + part.axis) +
                          "); plan each part once.");
      }
    }
    parts_.push_back(std::move(part));
  }

  std::vector<Part> parts_;
  std::vector<torch::nn::Module*> units_;
};

}  // namespace volt
