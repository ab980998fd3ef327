#pragma once
/// \file
/// An optimizer's per-parameter state as tensors: the key LibTorch files a parameter's state under, and for the
/// optimizers whose state is elementwise (LibTorch's `Adam`, `AdamW` and `SGD`, and volt::optim's, whose state is
/// theirs) the state's tensors by name (shaped as the parameter; undefined where the optimizer has none, as Adam's
/// `max_exp_avg_sq` without amsgrad) and its step count. The sharded strategy (strategies/sharded.hpp) cuts such a
/// state into the pieces each rank steps and puts it back together; a sharded checkpoint (checkpoint/sharded.hpp)
/// writes each rank's pieces by name.

#include "volt/detail/optimizer_family.hpp"
#include "volt/errors.hpp"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <array>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace volt::detail {

/// The key LibTorch files the state of the parameter whose TensorImpl is `impl` under (its address as a string on
/// 1.13, the address itself on 2.x).
template <class StateMap>
auto state_key(const StateMap&, const void* impl) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;  // as 1.13's c10::guts::to_string writes it
    text << impl;
    return text.str();
  } else {
    return const_cast<Key>(impl);
  }
}


/// One kind of per-parameter state: its class, its tensors and its step count.
template <class State>
struct StateCodec;

/// Adam's and AdamW's state (two classes with the same fields).
template <class S>
struct AdamStateCodec {
  using State = S;
  static constexpr std::size_t fields = 3;
  static constexpr std::array<const char*, 3> names{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static std::vector<at::Tensor> tensors(const State& s) { return {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}; }
  static std::unique_ptr<State> make(const std::vector<at::Tensor>& t, int64_t step) {
    auto s = std::make_unique<State>();
    s->step(step);
    s->exp_avg(t[0]);
    s->exp_avg_sq(t[1]);
    s->max_exp_avg_sq(t[2]);
    return s;
  }
  static int64_t step(const State& s) { return s.step(); }
};
template <>
struct StateCodec<torch::optim::AdamParamState> : AdamStateCodec<torch::optim::AdamParamState> {};
template <>
struct StateCodec<torch::optim::AdamWParamState> : AdamStateCodec<torch::optim::AdamWParamState> {};

template <>
struct StateCodec<torch::optim::SGDParamState> {
  using State = torch::optim::SGDParamState;
  static constexpr std::size_t fields = 1;
  static constexpr std::array<const char*, 1> names{"momentum_buffer"};
  static std::vector<at::Tensor> tensors(const State& s) { return {s.momentum_buffer()}; }
  static std::unique_ptr<State> make(const std::vector<at::Tensor>& t, int64_t /*step*/) {
    auto s = std::make_unique<State>();
    s->momentum_buffer(t[0]);
    return s;
  }
  static int64_t step(const State&) { return 0; }
};

/// Calls `f(StateCodec<...>{})` for the state kind of `optimizer`; throws, naming the optimizer and what is allowed,
/// for any other.
template <class F>
decltype(auto) with_state_codec(const torch::optim::Optimizer& optimizer, F&& f) {
  switch (optimizer_family(optimizer)) {
    case OptimizerFamily::adamw: return f(StateCodec<torch::optim::AdamWParamState>{});
    case OptimizerFamily::adam: return f(StateCodec<torch::optim::AdamParamState>{});
    case OptimizerFamily::sgd: return f(StateCodec<torch::optim::SGDParamState>{});
    default: break;
  }
  throw ConfigError("volt: ZeRO shards the state of Adam, AdamW and SGD (torch::optim's or volt::optim's), whose state "
                    "is elementwise; configure_optimizers returned a " + optimizer_family_name(optimizer) +
                    ": return one of those, or train with DDP.");
}

/// Whether `optimizer`'s state is one `with_state_codec` knows.
inline bool has_state_codec(const torch::optim::Optimizer& optimizer) {
  const OptimizerFamily f = optimizer_family(optimizer);
  return f == OptimizerFamily::adamw || f == OptimizerFamily::adam || f == OptimizerFamily::sgd;
}

/// Each of `optimizer`'s groups' parameters, in order.
inline std::vector<std::vector<at::Tensor>> param_lists(const torch::optim::Optimizer& optimizer) {
  std::vector<std::vector<at::Tensor>> lists;
  for (const auto& group : optimizer.param_groups()) lists.push_back(group.params());
  return lists;
}

/// The state `optimizer` keeps for `p`, or null.
inline torch::optim::OptimizerParamState* find_state(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  auto& map = optimizer.state();
  const auto it = map.find(state_key(map, p.unsafeGetTensorImpl()));
  return it == map.end() ? nullptr : it->second.get();
}

/// Takes the state `optimizer` keeps for `p` out of it (null when none).
inline std::unique_ptr<torch::optim::OptimizerParamState> take_state(torch::optim::Optimizer& optimizer,
                                                                     const at::Tensor& p) {
  auto& map = optimizer.state();
  const auto it = map.find(state_key(map, p.unsafeGetTensorImpl()));
  if (it == map.end()) return nullptr;
  std::unique_ptr<torch::optim::OptimizerParamState> out = std::move(it->second);
  map.erase(it);
  return out;
}

/// Files `state` as `p`'s in `optimizer`.
inline void put_state(torch::optim::Optimizer& optimizer, const at::Tensor& p,
                      std::unique_ptr<torch::optim::OptimizerParamState> state) {
  auto& map = optimizer.state();
  map[state_key(map, p.unsafeGetTensorImpl())] = std::move(state);
}

/// The bytes of every tensor of `optimizer`'s per-parameter states (what a rank holds of it).
inline std::size_t optimizer_state_bytes(torch::optim::Optimizer& optimizer) {
  std::size_t bytes = 0;
  with_state_codec(optimizer, [&](auto codec) {
    using State = typename decltype(codec)::State;
    for (const auto& [key, state] : optimizer.state()) {
      for (const at::Tensor& t : decltype(codec)::tensors(static_cast<const State&>(*state))) {
        if (t.defined()) bytes += static_cast<std::size_t>(t.numel()) * t.element_size();
      }
    }
  });
  return bytes;
}

}  // namespace volt::detail
