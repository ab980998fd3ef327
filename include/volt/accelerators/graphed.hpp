#pragma once
/// \file
/// `volt::Graphed<GPU>`: the GPU, with each training step captured once in a CUDA graph and replayed after that.
/// \code
///   volt::Trainer<volt::SingleDevice, volt::Bf16, volt::Graphed<volt::GPU>> trainer({.max_epochs = 10});
/// \endcode
/// Capture is about how the device runs the step, so it wraps the accelerator; the strategy and the precision keep
/// their meaning. Small and medium models on a GPU are bound by kernel launches and the host, not by arithmetic:
/// a replay launches the whole step (forward, backward, unscale and inf check, clipping, the fused optimizer step,
/// the loss scale's update) as one graph.
///
/// **What a fit does in graph mode.** The first `WarmupBatches` training batches are real, eager steps, on the stream
/// captures will use. The next batch is captured: the module's `training_step` runs once on the host while its
/// device work is recorded, then every batch is copied into the graph's inputs and the graph replayed. Gradient
/// accumulation captures up to four variants (a window's first, middle and last micro-batch, and a window of one);
/// each is captured the first time it is needed. Only a batch's tensors are copied in; its other values (numbers,
/// strings, a map's keys, which optionals are there) are the captured batch's in every replay, so they are part of its
/// layout (`detail::batch_layout`). A batch of another shape or layout (the epoch's last, partial batch) runs eagerly;
/// one anywhere else is an error that quotes both. What `ctx.log` records inside `training_step` is read from the
/// graph's outputs after each replay, so the progress bar, loggers and callbacks see every step's value; the loss
/// `on_train_batch_end` gets is a copy where a hook may keep it (volt/callbacks/concept.hpp). LR schedulers,
/// validation (eager), checkpoints and exact resume work as without graphs.
///
/// **Rules, checked at compile time** (each a sentence that says the fix):
///  - the accelerator has a graph type (`A::graph_type`; the GPU's is a CUDA graph, compiled in where LibTorch has
///    CUDA): `Graphed<CPU>` is refused;
///  - the optimizer can be captured: configure_optimizers returns a `volt::optim` optimizer by value, in a pointer,
///    or in a `volt::OptimizerConfigOf<O>` (LibTorch's optimizers read their step counts on the host, and a plain
///    `OptimizerConfig` does not say which optimizer it holds);
///  - no module or callback hook would run inside the captured region (`on_before_backward`, `on_after_backward`,
///    `on_before_optimizer_step`): it would run once, at capture;
///  - the strategy is not distributed (DDP's gradient hooks run on the host during backward).
/// What only a run can show fails at capture with a message naming the cause: a host wait inside `training_step`
/// (`.item()`, printing a tensor, shapes that depend on data), or a parameter that gets a gradient only then.
///
/// **A graph type** (`A::graph_type`, for an accelerator of your own) is default-constructible and has:
///
/// | member | meaning |
/// |---|---|
/// | `static constexpr bool available` | it is compiled in (false: `Graphed<A>` is refused) |
/// | `run_eager(c10::Device, F&& f)` | runs `f` now, where captures run (warm-up and eager steps) |
/// | `capture(c10::Device, F&& f, const G* shared)` | records `f`'s device work, running none of it; `shared`: a graph captured before, whose memory it may share |
/// | `replay()` | runs the recorded work again, on the inputs' current values |

#include "volt/accelerators/concept.hpp"
#include "volt/accelerators/gpu.hpp"

#include <cstdint>
#include <type_traits>

namespace volt {

/// Accelerator `A` with every training step captured once and replayed (`A::graph_type` says how). The first
/// `WarmupBatches` training batches run eagerly (3, as PyTorch's recipe for whole-network capture).
template <class A, int64_t WarmupBatches = 3>
struct Graphed : A {
  static_assert(Accelerator<A>, "volt: Graphed<A> takes an accelerator (volt::GPU): Graphed<volt::GPU>.");
  static_assert(WarmupBatches >= 1, "volt: Graphed<A, WarmupBatches> needs at least one eager batch before capture.");
  /// The accelerator that runs the math.
  using accelerator = A;
  static constexpr bool captures_step = true;
  static constexpr int64_t warmup_batches = WarmupBatches;
};

namespace detail {

/// Whether accelerator `A` runs training steps from captured graphs (`Graphed<...>`).
template <class A>
concept captures_step = requires {
  requires A::captures_step;
};

/// The graph type of `A` (`void` for none).
template <class A>
struct graph_type_of {
  using type = void;
};
template <class A>
  requires requires { typename A::graph_type; }
struct graph_type_of<A> {
  using type = typename A::graph_type;
};

/// `A` is graphed and its accelerator has no graph type (`Graphed<CPU>`).
template <class A>
inline constexpr bool graph_without_device = captures_step<A> && std::is_void_v<typename graph_type_of<A>::type>;

/// `A` is graphed and its graph type is not compiled in (`Graphed<GPU>` with a LibTorch built without CUDA).
template <class A>
constexpr bool graph_not_compiled() {
  if constexpr (!captures_step<A> || graph_without_device<A>) {
    return false;
  } else {
    return !graph_type_of<A>::type::available;
  }
}

}  // namespace detail
}  // namespace volt
