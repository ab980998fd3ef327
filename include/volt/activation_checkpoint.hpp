#pragma once
/// \file
/// Activation checkpointing: `volt::activation_checkpoint(fn, inputs...)` runs `fn` without keeping the activations
/// its backward would need, and runs it again during backward to get them (PyTorch's `torch.utils.checkpoint`,
/// which LibTorch's C++ API lacks). A stack of blocks then holds one block's activations at a time instead of all of
/// them, for one more forward of each checkpointed block.
/// \code
///   x = volt::activation_checkpoint(block, x);                      // a module holder: block->forward(x)
///   auto [q, k] = volt::activation_checkpoint([&](const at::Tensor& h) { return std::tuple(wq(h), wk(h)); }, x);
///   x = volt::forward_blocks<Block>(blocks, x, volt::ActivationCheckpointing{.every = 2});  // every 2nd of a list
///   x = volt::forward_blocks<Block>(blocks, x, volt::Units{}, volt::ActivationCheckpointing{.every = 1});  // + FSDP units
/// \endcode
///
/// | what | how |
/// |---|---|
/// | `fn` | a module holder (`torch::nn::Linear`, your `TORCH_MODULE`), a module, or any callable; kept until backward: a module by reference, anything else copied (a holder's copy is the same module) |
/// | inputs | tensors (each may or may not require gradients, or be undefined) and other values, passed to `fn` as given |
/// | outputs | a tensor, a `std::tuple` of tensors or a `std::vector<at::Tensor>` |
/// | gradients | of every input that requires them and of every parameter (any leaf tensor that requires gradients) `fn` uses, found by following the graph of the first run: they reach the parameters through the backward that called them, so DDP's and ZeRO's gradient hooks, accumulation and a parameter used in several places behave as without checkpointing |
/// | randomness | the CPU generator's state, and each CUDA device's of the inputs, is put back for the second run (and restored after), so dropout draws the same masks |
/// | autocast | the second run runs under the autocast state (CPU and CUDA, enabled and dtype) of the first |
/// | no gradients | under `torch::NoGradGuard`, `c10::InferenceMode` or when nothing `fn` uses requires gradients, a plain call |
///
/// The first run records the graph of one block (freed when it returns) to find what `fn` uses; its saved tensors
/// live only while `fn` runs, so the peak is one block's activations, the same as during the second run.
/// Refused, with a message: a tensor that requires gradients and was computed outside `fn` but is captured by it
/// (pass it as an input instead), an input `fn` changes in place, a second derivative through a checkpointed block
/// (`create_graph`), and a second backward through it after the graph was freed (as PyTorch's). Hooks registered on
/// a parameter's tensor (`register_hook`) run twice (once where the second run takes its gradient, once where the
/// calling backward accumulates it); DDP's and ZeRO's gradient hooks run after accumulation, once. Outputs that are
/// views of one another lose that link (each is detached): change none of them in place. Both LibTorch lines use the
/// same code: the autograd engine's `execute` with output edges (LibTorch 1.13 and 2.x alike); nothing needs
/// Python's saved-tensor hooks.
/// Not for use inside a step captured by graph mode (`Graphed<GPU>`): the generator states are read on the host.

#include "volt/detail/torch_compat.hpp"
#include "volt/units.hpp"

#include <ATen/SequenceNumber.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/Generator.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Type.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace volt {
namespace detail {

template <class A>
inline constexpr bool is_tensor_arg = std::is_same_v<std::remove_cvref_t<A>, at::Tensor>;

/// The generator states a second run needs: the CPU's and each CUDA device's that an input lives on.
struct RngStates {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static RngStates capture(const std::vector<at::Tensor>& inputs) {
    RngStates r;
    r.add(at::detail::getDefaultCPUGenerator());
    std::vector<c10::DeviceIndex> seen;
    for (const auto& t : inputs) {
      if (!t.defined() || !t.is_cuda()) continue;
      const auto index = t.get_device();
      if (std::find(seen.begin(), seen.end(), index) != seen.end()) continue;
      seen.push_back(index);
      r.add(at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, index)));
    }
    return r;
  }
  /// The states of the same generators now.
  RngStates now() const {
    RngStates r;
    for (const auto& [g, state] : states) r.add(g);
    return r;
  }
  void restore() const {
    for (const auto& [g, state] : states) {
      at::Generator gen = g;
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }

 private:
  void add(at::Generator g) {
    std::lock_guard<std::mutex> lock(g.mutex());
    at::Tensor state = g.get_state();
    states.emplace_back(std::move(g), std::move(state));
  }
};

/// Autocast's state for the CPU and CUDA: enabled and dtype.
struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static AutocastState now() {
    return {autocast_enabled(c10::DeviceType::CPU), autocast_enabled(c10::DeviceType::CUDA),
            autocast_dtype(c10::DeviceType::CPU), autocast_dtype(c10::DeviceType::CUDA)};
  }
  bool any() const { return cpu || cuda; }
  void apply() const {
    set_autocast_enabled(c10::DeviceType::CPU, cpu);
    set_autocast_dtype(c10::DeviceType::CPU, cpu_dtype);
    set_autocast_enabled(c10::DeviceType::CUDA, cuda);
    set_autocast_dtype(c10::DeviceType::CUDA, cuda_dtype);
  }
};

/// The second run's surroundings: the first run's generator states and autocast state, gradients on; what was
/// there before comes back on leaving (the generators' states too, so the second run draws nothing for later code).
class SecondRunGuard {
 public:
  SecondRunGuard(const RngStates& rng, const AutocastState& autocast)
      : rng_before_(rng.now()), autocast_before_(AutocastState::now()) {
    rng.restore();
    autocast.apply();
    at::autocast::increment_nesting();
  }
  SecondRunGuard(const SecondRunGuard&) = delete;
  SecondRunGuard& operator=(const SecondRunGuard&) = delete;
  ~SecondRunGuard() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    autocast_before_.apply();
    rng_before_.restore();
  }

 private:
  RngStates rng_before_;
  AutocastState autocast_before_;
  at::AutoGradMode grad_on_{true};
};

/// The function of a checkpointed call on its tensor inputs (the other arguments bound), returning flat outputs.
using CheckpointRun = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// The gradient edges of what the first run's graph (from `outputs`) reaches beyond the inputs: every leaf that
/// requires gradients (parameters), each once. Nodes made during the run have sequence numbers in [from, to); a node
/// outside that range is a tensor computed before the call and captured by `fn`: refused.
inline torch::autograd::edge_list leaf_edges(const std::vector<at::Tensor>& outputs,
                                             const std::vector<at::Tensor>& inputs, uint64_t from, uint64_t to) {
  namespace ag = torch::autograd;
  std::unordered_set<const ag::Node*> inputs_acc, seen;
  for (const auto& x : inputs) {
    if (x.defined() && x.requires_grad()) inputs_acc.insert(ag::impl::try_get_grad_accumulator(x).get());
  }
  ag::edge_list leaves;
  std::vector<ag::Edge> stack;
  for (const auto& o : outputs) {
    if (o.defined() && o.requires_grad()) stack.push_back(ag::impl::gradient_edge(o));
  }
  while (!stack.empty()) {
    const ag::Edge e = std::move(stack.back());
    stack.pop_back();
    ag::Node* node = e.function.get();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (dynamic_cast<ag::AccumulateGrad*>(node) != nullptr) {
      if (inputs_acc.count(node) == 0) leaves.emplace_back(e.function, 0);
      continue;
    }
    if (node->sequence_nr() < from || node->sequence_nr() >= to) {
      throw std::invalid_argument(
          "volt: activation_checkpoint: the function uses a tensor that requires gradients and was computed before "
          "the call (its gradient function is " + node->name() +
          "); a checkpointed function may capture parameters but not such tensors: pass it as an input instead.");
    }
    for (const auto& next : node->next_edges()) {
      if (next.is_valid()) stack.push_back(next);
    }
  }
  return leaves;
}

/// The backward of a checkpointed call: runs the function again on its saved inputs and takes the gradients of the
/// inputs and leaves through the autograd engine, stopping at them (their accumulation is the calling backward's).
class ActivationCheckpointBackward final : public torch::autograd::Node {
 public:
  ActivationCheckpointBackward(CheckpointRun run, const std::vector<at::Tensor>& inputs, std::vector<bool> output_used,
                               RngStates rng, AutocastState autocast)
      : run_(std::move(run)), output_used_(std::move(output_used)), rng_(std::move(rng)), autocast_(autocast) {
    for (const auto& x : inputs) {
      saved_.emplace_back(x, /*is_output=*/false);
      requires_grad_.push_back(x.defined() && x.requires_grad());
    }
  }

  std::string name() const override { return "volt::ActivationCheckpointBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    namespace ag = torch::autograd;
    if (released_) {
      throw std::logic_error(
          "volt: activation_checkpoint: a second backward through a checkpointed call; its inputs were released "
          "after the first (call backward once per forward, as PyTorch's checkpoint asks).");
    }
    if (at::GradMode::is_enabled()) {
      throw std::logic_error(
          "volt: activation_checkpoint: a backward with create_graph (a second derivative) through a checkpointed "
          "call is not supported; call it without volt::activation_checkpoint.");
    }
    std::vector<at::Tensor> inputs;
    for (std::size_t i = 0; i < saved_.size(); ++i) inputs.push_back(leaf_copy(saved_[i].unpack(), requires_grad_[i]));
    std::vector<at::Tensor> outputs;
    {
      SecondRunGuard guard(rng_, autocast_);
      outputs = run_(inputs);
    }
    ag::edge_list roots;
    ag::variable_list root_grads;
    std::size_t k = 0;
    for (std::size_t j = 0; j < outputs.size(); ++j) {
      if (!output_used_[j]) continue;
      const at::Tensor& g = grads[k++];
      if (g.defined() && outputs[j].requires_grad()) {
        roots.push_back(ag::impl::gradient_edge(outputs[j]));
        root_grads.push_back(g);
      }
    }
    ag::edge_list wanted;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (requires_grad_[i]) wanted.push_back(ag::impl::gradient_edge(inputs[i]));
    }
    for (std::size_t i = wanted.size(); i < num_outputs(); ++i) wanted.push_back(next_edge(i));
    // An output that is itself an input or a parameter (a leaf) passes its gradient straight on: as a root the
    // engine would run its accumulator here.
    std::vector<std::pair<std::size_t, at::Tensor>> direct;
    for (std::size_t r = roots.size(); r-- > 0;) {
      if (dynamic_cast<ag::AccumulateGrad*>(roots[r].function.get()) == nullptr) continue;
      for (std::size_t i = 0; i < wanted.size(); ++i) {
        if (wanted[i].function == roots[r].function) direct.emplace_back(i, root_grads[r]);
      }
      roots.erase(roots.begin() + static_cast<std::ptrdiff_t>(r));
      root_grads.erase(root_grads.begin() + static_cast<std::ptrdiff_t>(r));
    }
    ag::variable_list result = roots.empty() ? ag::variable_list(num_outputs())
                                             : ag::Engine::get_default_engine().execute(
                                                   roots, root_grads, /*keep_graph=*/false, /*create_graph=*/false,
                                                   /*accumulate_grad=*/false, wanted);
    for (auto& [i, g] : direct) result[i] = result[i].defined() ? result[i] + g : g;
    return result;
  }

  void release_variables() override {
    saved_.clear();
    run_ = nullptr;
    released_ = true;
  }

  /// A tensor as the function sees it in either run: no history, requiring gradients as the caller's did.
  static at::Tensor leaf_copy(const at::Tensor& x, bool requires_grad) {
    if (!x.defined()) return x;
    at::Tensor d = x.detach();
    if (requires_grad) d.requires_grad_(true);
    return d;
  }

 private:
  CheckpointRun run_;
  std::vector<torch::autograd::SavedVariable> saved_;
  std::vector<bool> requires_grad_;
  std::vector<bool> output_used_;
  RngStates rng_;
  AutocastState autocast_;
  bool released_ = false;
};

/// The checkpointed call on flat tensor inputs (see `activation_checkpoint`).
inline std::vector<at::Tensor> checkpointed_call(const CheckpointRun& run, const std::vector<at::Tensor>& inputs) {
  namespace ag = torch::autograd;
  RngStates rng = RngStates::capture(inputs);
  const AutocastState autocast = AutocastState::now();
  std::vector<at::Tensor> firsts;
  for (const auto& x : inputs) {
    firsts.push_back(ActivationCheckpointBackward::leaf_copy(x, x.defined() && x.requires_grad()));
  }
  // Casts of parameters made before the call would be nodes outside it; the second run makes its own.
  if (autocast.any()) at::autocast::clear_cache();
  std::vector<uint32_t> versions;
  for (const auto& x : inputs) versions.push_back(x.defined() ? x._version() : 0);
  const uint64_t from = at::sequence_number::peek();
  std::vector<at::Tensor> outputs = run(firsts);
  const uint64_t to = at::sequence_number::peek();
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i]._version() != versions[i]) {
      throw std::invalid_argument("volt: activation_checkpoint: the function changed its tensor input " +
                                  std::to_string(i) + " in place; its second run would start from the changed "
                                  "values. Change a copy (x = x + ..., or x.clone()) instead.");
    }
  }
  ag::edge_list leaves = leaf_edges(outputs, firsts, from, to);
  if (autocast.any()) at::autocast::clear_cache();
  ag::edge_list edges;
  for (const auto& x : inputs) {
    if (x.defined() && x.requires_grad()) edges.push_back(ag::impl::gradient_edge(x));
  }
  if (edges.empty() && leaves.empty()) return outputs;  // nothing to differentiate
  edges.insert(edges.end(), leaves.begin(), leaves.end());
  std::vector<bool> used;
  for (auto& o : outputs) {
    used.push_back(o.defined() && o.requires_grad());
    if (o.defined()) o = o.detach();
  }
  std::shared_ptr<ActivationCheckpointBackward> node(
      new ActivationCheckpointBackward(run, inputs, used, std::move(rng), autocast), ag::deleteNode);
  node->set_next_edges(std::move(edges));
  for (std::size_t j = 0; j < outputs.size(); ++j) {
    if (used[j]) ag::set_history(outputs[j], node);
  }
  return outputs;
}

/// The position of argument `I` among the tensor arguments of `Args`.
template <std::size_t I, class... Args>
constexpr std::size_t tensor_position() {
  constexpr bool is_tensor[] = {is_tensor_arg<Args>..., false};
  std::size_t n = 0;
  for (std::size_t j = 0; j < I; ++j) n += is_tensor[j] ? 1 : 0;
  return n;
}

/// Argument `I` as a run passes it: a tensor input is its entry of `tensors`, anything else the kept value.
template <std::size_t I, class... Args, class Kept>
decltype(auto) substitute(const Kept& kept, const std::vector<at::Tensor>& tensors) {
  if constexpr (is_tensor_arg<std::tuple_element_t<I, std::tuple<Args...>>>) {
    return static_cast<const at::Tensor&>(tensors[tensor_position<I, Args...>()]);
  } else {
    return static_cast<const std::tuple_element_t<I, Kept>&>(std::get<I>(kept));
  }
}

/// What is kept of an argument until backward: a tensor input is kept by the node (so nothing here), the rest copied.
template <class Arg>
std::remove_cvref_t<Arg> kept(const Arg& arg) {
  if constexpr (is_tensor_arg<Arg>) {
    return at::Tensor();
  } else {
    return arg;
  }
}

/// Calls `f` with `args`: a callable (a module holder, a lambda) directly, a module through its `forward`.
template <class F, class... Args>
decltype(auto) invoke_block(F& f, Args&&... args) {
  if constexpr (std::is_invocable_v<F&, Args...>) {
    return std::invoke(f, std::forward<Args>(args)...);
  } else {
    return f.forward(std::forward<Args>(args)...);
  }
}

}  // namespace detail

/// Runs `fn(args...)` keeping only its inputs for backward, and runs it again there (see the file's comment).
/// Returns what `fn` returns. A plain call where gradients are off.
template <class F, class... Args>
auto activation_checkpoint(F&& fn, Args&&... args) {
  using Fn = std::remove_reference_t<F>;
  using R = std::remove_cvref_t<decltype(detail::invoke_block(fn, args...))>;
  if (!at::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) return R(detail::invoke_block(fn, args...));
  std::vector<at::Tensor> inputs;
  (
      [&] {
        if constexpr (detail::is_tensor_arg<Args>) inputs.push_back(args);
      }(),
      ...);
  // The function and the non-tensor arguments are kept until backward: a module by reference, anything else (a
  // lambda, a module holder) as a copy, so a callable made in forward outlives it.
  using Kept = std::conditional_t<std::is_base_of_v<torch::nn::Module, std::remove_cv_t<Fn>>,
                                  std::reference_wrapper<Fn>, std::remove_cv_t<Fn>>;
  auto bound = [f = Kept(std::forward<F>(fn)), kept = std::tuple(detail::kept(args)...)](
                   const std::vector<at::Tensor>& tensors) mutable -> std::vector<at::Tensor> {
    Fn& callee = f;
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return detail::TensorResult<R>::flatten(
          detail::invoke_block(callee, detail::substitute<I, Args...>(kept, tensors)...));
    }(std::index_sequence_for<Args...>{});
  };
  return detail::TensorResult<R>::build(detail::checkpointed_call(std::move(bound), inputs));
}

/// Which blocks of a stack run under `activation_checkpoint`, chosen where the model is built: none (`every = 0`),
/// all (`every = 1`) or every k-th from the first (`every = k`: torchtitan's selective checkpointing by layer).
struct ActivationCheckpointing {
  std::size_t every = 0;
  /// Whether block `index` (from 0) is checkpointed.
  bool applies(std::size_t index) const { return every != 0 && index % every == 0; }
};

namespace detail {
/// The module type a block list holds for `Block`: `Block` itself, or for a `TORCH_MODULE` holder (`TransformerBlock`)
/// the `...Impl` it holds, which is what the list's entries are.
template <class Block>
struct block_impl {
  using type = Block;
};
template <class Block>
  requires std::is_base_of_v<torch::nn::ModuleHolder<typename Block::ContainedType>, Block>
struct block_impl<Block> {
  using type = typename Block::ContainedType;
};

/// `forward_blocks`' loop: each block under `activation_checkpoint` where `which` says, and as one unit of a fully
/// sharded strategy where `units` (volt/units.hpp).
template <class Block, class... Extra>
at::Tensor run_blocks(const torch::nn::ModuleList& blocks, at::Tensor x, bool units, ActivationCheckpointing which,
                      const Extra&... extra) {
  for (std::size_t i = 0; i < blocks->size(); ++i) {
    Block* block = blocks->ptr(i)->template as<Block>();
    if (block == nullptr) {
      throw std::invalid_argument("volt: forward_blocks: block " + std::to_string(i) + " of the list is a " +
                                  blocks->ptr(i)->name() + ", not the block type given (" +
                                  c10::demangle_type<Block>() + ").");
    }
    auto run = [&]() -> at::Tensor {
      return which.applies(i) ? activation_checkpoint(*block, x, extra...) : block->forward(x, extra...);
    };
    x = units ? in_unit(*block, run) : run();
  }
  return x;
}
/// The same over a `torch::nn::Sequential` whose modules each take and return one tensor.
inline at::Tensor run_blocks(torch::nn::Sequential blocks, at::Tensor x, bool units, ActivationCheckpointing which) {
  std::size_t i = 0;
  for (torch::nn::AnyModule& m : *blocks) {
    auto run = [&]() -> at::Tensor {
      return which.applies(i) ? activation_checkpoint([&m](const at::Tensor& in) { return m.forward(in); }, x)
                              : m.forward(x);
    };
    x = units ? in_unit(*m.ptr(), run) : run();
    ++i;
  }
  return x;
}
}  // namespace detail

/// Runs `x` through every block of `blocks` in order (`Block` each block's type: `blocks[i]->as<Block>()`), the ones
/// `which` names under `activation_checkpoint`; `extra` is passed to every block after `x` (a mask, say).
/// `Block` may be the module's `...Impl` type or its `TORCH_MODULE` holder.
template <class Block, class... Extra>
at::Tensor forward_blocks(const torch::nn::ModuleList& blocks, at::Tensor x, ActivationCheckpointing which,
                          const Extra&... extra) {
  return detail::run_blocks<typename detail::block_impl<Block>::type>(blocks, std::move(x), false, which, extra...);
}

/// The same with each block one unit of a fully sharded strategy (volt/units.hpp; a plain call under any other).
template <class Block, class... Extra>
at::Tensor forward_blocks(const torch::nn::ModuleList& blocks, at::Tensor x, Units /*each_block*/,
                          ActivationCheckpointing which = {}, const Extra&... extra) {
  return detail::run_blocks<typename detail::block_impl<Block>::type>(blocks, std::move(x), true, which, extra...);
}

/// The same over a `torch::nn::Sequential` whose modules each take and return one tensor.
inline at::Tensor forward_blocks(torch::nn::Sequential blocks, at::Tensor x, ActivationCheckpointing which) {
  return detail::run_blocks(std::move(blocks), std::move(x), false, which);
}
inline at::Tensor forward_blocks(torch::nn::Sequential blocks, at::Tensor x, Units /*each_block*/,
                                 ActivationCheckpointing which = {}) {
  return detail::run_blocks(std::move(blocks), std::move(x), true, which);
}

}  // namespace volt
