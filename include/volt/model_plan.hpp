#pragma once
/// \file
/// `volt::ModelPlan`: what a module's `configure_model` hook says of its parts: which are sharded, on which axis of the
/// strategy's mesh, and which are replicated, as Lightning's `ModelParallelStrategy` lets `configure_model` apply
/// FSDP2's `fully_shard` to some modules and leave others replicated.
/// \code
///   void configure_model(volt::ModelPlan& plan) {
///     plan.shard(blocks, "shard");  // FSDP along the mesh's "shard" axis, replicated along the other axis (HSDP)
///     plan.replicate(head);         // DDP over every rank, as whatever no part holds
///   }
/// \endcode
/// The Trainer calls the hook at the start of every run (fit, validate, test, predict), after the strategy has placed
/// the module and before the precision converts it, under every strategy: `volt::ModelParallel`
/// (strategies/model_parallel.hpp) lays the parts out as planned, and every other strategy leaves the plan unread, so
/// that the same module runs on one device, under DDP or under FSDP as it is. Units inside a sharded part are declared
/// where the model runs (volt/units.hpp); what of a sharded part runs in no unit is gathered when a forward starts.
/// A plan names modules, not parameters; a parameter in two parts is refused where the strategy reads the plan.

#include "volt/errors.hpp"

#include <torch/nn/module.h>

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

  const std::vector<Part>& parts() const { return parts_; }
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
};

}  // namespace volt
