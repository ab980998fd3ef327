#pragma once
/// \file
/// Every rule between policy kinds, in one place, so the whole compatibility matrix reads at once.
/// Each rule reads capability flags only (never the type of a shipped policy), so a user's own policy
/// takes part on equal terms. The Trainer turns each into a `static_assert` with a sentence naming the fix.
///
/// | rule | reads | broken by (example) |
/// |---|---|---|
/// | a precision's autocast dtype exists on the accelerator | `P::needs_fp16_autocast`, `A::has_fp16_autocast`, `P::needs_bf16_autocast`, `A::has_bf16_autocast` | `Trainer<SingleDevice, Fp16Mixed, CPU>` |
/// | each slot holds its kind | the concepts `Strategy`, `Precision`, `Accelerator` | `Trainer<Fp32, SingleDevice, CPU>` |
/// | a strategy's collective backend takes the accelerator's tensors | `backend_traits<B>::supports_cpu` / `supports_cuda` | `Trainer<DDP<Script, Nccl>, Fp32, CPU>` |
/// | the backend was compiled in | `backend_traits<B>::available` (Nccl: VOLT_WITH_NCCL) | `Trainer<DDP<Spawn>, Fp32, GPU>` without `volt::nccl` |
/// | a graphed accelerator can capture | `A::captures_step`, `A::graph_type` | `Trainer<SingleDevice, Fp32, Graphed<CPU>>` |
/// | its graph type was compiled in | `A::graph_type::available` (the GPU's: VOLT_WITH_CUDA) | `Graphed<GPU>` against a LibTorch without CUDA |
/// | graph mode runs in one process (said before the build's rules) | `S::is_distributed`, `A::captures_step` | `Trainer<DDP<Script>, Bf16, Graphed<GPU>>` |
/// | a loss-scaling precision agrees on skipped steps where the gradients are sharded | `S::shards_optimizer_state`, `P::scales_loss`, `P::agree_found_inf` | `Trainer<ZeRO<2>, MyScaledPrecision, GPU>` whose precision keeps `PrecisionDefaults::agree_found_inf` |
///
/// What `fit` is given is checked when `fit` is instantiated (`detail::CheckedFit`): a module, its training_step for the
/// loader's batches, one optimizer unless it declares manual optimization, a validation_step when there is a
/// validation loader, no manual optimization under a strategy that shards the optimizer (ZeRO). Graph mode's rules that need the module's type are in loops/graphed_step.hpp
/// (`detail::CheckedGraphRules`): manual optimization, an optimizer that can be captured, no hooks inside the step.
///
/// **The three phases of validation.** Every setting is checked as early as it can be known, and said once:
///  - **phase (a), compile time**: the Trainer's type. Each slot holds its kind and the rules above hold;
///    a `static_assert` says which and how to fix it (`detail::CheckedSlots` below, which the Trainer instantiates).
///  - **phase (b), construction**: the run-time options and this machine. `Trainer`'s constructor checks
///    every `TrainerOptions` field (`validate_options`, volt/options.hpp), the accelerator's availability and
///    device count, and the strategy's `check_devices` (devices, num_nodes, an outside mpirun/srun job);
///    it throws `ConfigError` and starts nothing.
///  - **phase (c), the first run**: what needs processes or devices (the process group, device
///    selection, the module's placement) is set up lazily when `fit`/`validate`/`test`/`predict` starts, and
///    what depends on the loaders and the module (limits that need a loader's size, the optimizer) is checked then.

#include "volt/accelerators/concept.hpp"
#include "volt/accelerators/cpu.hpp"
#include "volt/declared_hooks.hpp"
#include "volt/accelerators/graphed.hpp"
#include "volt/comm/concept.hpp"
#include "volt/context.hpp"
#include "volt/loops/evaluation.hpp"
#include "volt/module.hpp"
#include "volt/precision/concept.hpp"
#include "volt/precision/fp32.hpp"
#include "volt/strategies/concept.hpp"
#include "volt/strategies/single_device.hpp"

#include <type_traits>

namespace volt {

/// The precision's float16 autocast, if it needs one, exists on the accelerator.
template <class P, class A>
concept Fp16AutocastAvailable = !P::needs_fp16_autocast || A::has_fp16_autocast;

/// The precision's bfloat16 autocast, if it needs one, exists on the accelerator.
template <class P, class A>
concept Bf16AutocastAvailable = !P::needs_bf16_autocast || A::has_bf16_autocast;

namespace detail {
/// The strategy's collective backend (`void` for none, as `StrategyDefaults`). The fallback only keeps a
/// type that is no strategy at all from adding errors after the one that says so.
template <class S>
struct strategy_backend {
  using type = void;
};
template <class S>
  requires requires { typename S::backend_type; }
struct strategy_backend<S> {
  using type = typename S::backend_type;
};
}  // namespace detail

/// The strategy's collective backend (if it has one) reduces tensors of the accelerator's device type.
template <class S, class A>
concept BackendRunsOn = std::is_void_v<typename detail::strategy_backend<S>::type> ||
                        (A::device_type == c10::DeviceType::CPU
                             ? backend_traits<typename detail::strategy_backend<S>::type>::supports_cpu
                             : backend_traits<typename detail::strategy_backend<S>::type>::supports_cuda);

/// The strategy's collective backend (if it has one) was compiled in.
template <class S>
concept BackendCompiledIn = std::is_void_v<typename detail::strategy_backend<S>::type> ||
                            backend_traits<typename detail::strategy_backend<S>::type>::available;

namespace detail {

/// The strategy a Trainer runs for accelerator `A`: `S::with_accelerator<A>` when S has it (DDP picks its
/// backend there), else S itself.
template <class S, class A>
struct bind_strategy {
  using type = S;
};
template <class S, class A>
  requires requires { typename S::template with_accelerator<A>; }
struct bind_strategy<S, A> {
  using type = typename S::template with_accelerator<A>;
};
template <class S, class A>
using bind_strategy_t = typename bind_strategy<S, A>::type;

/// The three slots hold their kinds; the pairwise rules are only asked when they do (no cascades).
template <class S, class P, class A>
inline constexpr bool slots_ok = Strategy<S> && Precision<P> && Accelerator<A>;

/// The three arguments are a strategy, a precision and an accelerator, given in another order.
template <class S, class P, class A>
inline constexpr bool slots_permuted = !slots_ok<S, P, A> && (slots_ok<S, A, P> || slots_ok<P, S, A> ||
                                                              slots_ok<P, A, S> || slots_ok<A, S, P> ||
                                                              slots_ok<A, P, S>);

/// The rules between the slots, in the order they are said.
enum class Rule { none, graph_device, graph_distributed, graph_compiled, fp16_autocast, backend_device,
                  backend_compiled, bf16_autocast, sharded_inf_unagreed };

/// The first rule between the slots that is broken (`none` also when a slot does not hold its kind: that is said
/// first, and alone).
template <class S, class P, class A>
constexpr Rule first_broken_rule() {
  if constexpr (!slots_ok<S, P, A>) {
    return Rule::none;
  } else {
    using B = bind_strategy_t<S, A>;
    if (graph_without_device<A>) return Rule::graph_device;
    // before the build's: under a distributed strategy graph mode is refused whatever LibTorch was built with
    if (captures_step<A> && S::is_distributed) return Rule::graph_distributed;
    if (graph_not_compiled<A>()) return Rule::graph_compiled;
    if (!Fp16AutocastAvailable<P, A>) return Rule::fp16_autocast;
    if (!BackendRunsOn<B, A>) return Rule::backend_device;
    if (!BackendCompiledIn<B>) return Rule::backend_compiled;
    if (!Bf16AutocastAvailable<P, A>) return Rule::bf16_autocast;
    if (shards_optimizer_state<S> && P::scales_loss && default_inf_agreement<P>) return Rule::sharded_inf_unagreed;
    return Rule::none;
  }
}

/// Every slot holds its kind and every rule holds.
template <class S, class P, class A>
inline constexpr bool rules_ok = slots_ok<S, P, A> && first_broken_rule<S, P, A>() == Rule::none;

template <bool ok, class S, class A>
struct bound_strategy_if {
  using type = SingleDevice;
};
template <class S, class A>
struct bound_strategy_if<true, S, A> {
  using type = bind_strategy_t<S, A>;
};

/// Phase (a): the rules as `static_assert`s, each one sentence that names the fix first. Only the first broken
/// rule speaks (each is asked only when the ones before it hold), and where one is broken the Trainer is built
/// from stand-ins (SingleDevice, Fp32, CPU), so no error follows the sentence.
template <class S, class P, class A>
struct CheckedSlots {
  static_assert(!slots_permuted<S, P, A>,
                "volt: write the policies in the order Trainer<Strategy, Precision, Accelerator, Callbacks...>, as "
                "Trainer<volt::SingleDevice, volt::Fp32, volt::CPU>: these are a strategy, a precision and an "
                "accelerator in another order.");
  static_assert(slots_permuted<S, P, A> || Strategy<S>,
                "volt: give a strategy as the first Trainer argument (SingleDevice, DDP<Script>, DDP<Spawn>, "
                "ManualParallel<...>): the order is Trainer<Strategy, Precision, Accelerator, Callbacks...>.");
  static_assert(slots_permuted<S, P, A> || !Strategy<S> || Precision<P>,
                "volt: give a precision as the second Trainer argument (Fp32, Fp64True, Bf16Mixed, Fp16Mixed, "
                "Bf16True): the order is Trainer<Strategy, Precision, Accelerator, Callbacks...>.");
  static_assert(slots_permuted<S, P, A> || !Strategy<S> || !Precision<P> || Accelerator<A>,
                "volt: give an accelerator as the third Trainer argument (CPU, GPU): the order is "
                "Trainer<Strategy, Precision, Accelerator, Callbacks...>.");
  static_assert(first_broken_rule<S, P, A>() != Rule::graph_device,
                "volt: use Graphed<volt::GPU>, or the CPU without Graphed: graph mode captures steps in CUDA graphs, and "
                "this accelerator has no graph type (A::graph_type), so its steps cannot be captured.");
  static_assert(first_broken_rule<S, P, A>() != Rule::graph_distributed,
                "volt: use SingleDevice with Graphed<GPU>, or the distributed strategy (DDP, ZeRO, FSDP, ModelParallel) "
                "with the GPU without Graphed (they keep the fused optimizers): graph mode runs in one process, since "
                "the distributed strategies reduce gradients (and FSDP gathers parameters) from host hooks during "
                "forward and backward, which a captured step would run only once.");
  static_assert(first_broken_rule<S, P, A>() != Rule::graph_compiled,
                "volt: build against a LibTorch with CUDA (pip's torch, or PyTorch's LibTorch archive for CUDA) through "
                "volt's CMake target, which defines VOLT_WITH_CUDA=1, or train on volt::CPU: this accelerator's graphs "
                "are not compiled in (for the GPU: VOLT_WITH_CUDA is 0), and a build without CUDA runs neither CUDA "
                "graphs nor the GPU.");
  static_assert(first_broken_rule<S, P, A>() != Rule::fp16_autocast,
                "volt: use Bf16Mixed or Fp32 on the CPU, or the GPU accelerator for Fp16Mixed: this precision "
                "autocasts to float16, which the accelerator does not offer (CPU has no float16 autocast).");
  static_assert(first_broken_rule<S, P, A>() != Rule::backend_device,
                "volt: use volt::Mpi (DDP<Launcher, volt::Mpi>), or leave the backend out (DDP<Script> picks Mpi on "
                "CPU and Nccl on GPU): the strategy's collective backend (Nccl) reduces CUDA tensors only, and the "
                "accelerator is CPU.");
  static_assert(first_broken_rule<S, P, A>() != Rule::backend_compiled,
                "volt: link the volt::nccl CMake target (it finds nccl.h and libnccl and defines VOLT_WITH_NCCL=1), "
                "or choose DDP<Launcher, volt::Mpi> to reduce through host memory: this run reduces with NCCL, which "
                "is not compiled in (VOLT_WITH_NCCL is 0).");
  static_assert(first_broken_rule<S, P, A>() != Rule::bf16_autocast,
                "volt: use Fp32, or an accelerator with has_bf16_autocast: this precision autocasts to bfloat16, "
                "which the accelerator does not offer.");
  static_assert(first_broken_rule<S, P, A>() != Rule::sharded_inf_unagreed,
                "volt: give the precision an agree_found_inf(optimizer, max_over_ranks) that passes its inf/NaN flag to "
                "max_over_ranks (as Fp16Mixed's does), or train under DDP: it scales the loss, and under ZeRO each rank "
                "checks only its shard of the gradients, so ranks that did not agree would skip different steps.");

  static constexpr bool ok = rules_ok<S, P, A>;
  using strategy = typename bound_strategy_if<ok, S, A>::type;
  using precision = std::conditional_t<ok, P, Fp32>;
  using accelerator = std::conditional_t<ok, A, CPU>;
};

/// Several optimizers from a module without manual optimization (false where `M` is no Module: that is said first).
template <class M>
constexpr bool several_optimizers_automatic() {
  if constexpr (Module<M>) {
    return returns_several_optimizers<M> && !manual_optimization<M>;
  } else {
    return false;
  }
}

/// Whether the module has a validation_step for batches of type `ValBatch` (`void`: fit has no validation loader;
/// `Batches<B...>`: several loaders, one for each).
template <class M, class ValBatch>
constexpr bool validates_on() {
  if constexpr (std::is_void_v<ValBatch>) {
    return true;
  } else {
    return has_step<ValidationKind, module_impl_t<M>, ValBatch>;
  }
}

/// A strategy that shards the optimizer's state (ZeRO) steps the optimizer itself, after the gradients' reduce-scatter,
/// and gathers the parameters after it: a module with manual optimization would bypass both.
template <class S, class M>
inline constexpr bool sharded_manual = shards_optimizer_state<S> && manual_optimization<M>;

/// Phase (a) for `fit`: the module against the loaders it is given and the strategy, each rule said alone with its
/// fix (`ok`: all hold). `Batch` is the training loader's batch type, `ValBatch` the validation loader's (`void`:
/// none).
template <class M, class Batch, class ValBatch, class S = SingleDevice>
struct CheckedFit {
  static_assert(Module<M>,
                "volt: fit needs a torch::nn::Module (or its TORCH_MODULE holder) with configure_optimizers() "
                "returning an optimizer, a shared_ptr/unique_ptr to one, or a volt::OptimizerConfig.");
  static constexpr bool has_step = requires(module_impl_t<M>& m, Batch& b, Context& c) { m.training_step(b, c); };
  static_assert(has_step,
                "volt: the module has no training_step for this loader's batches. Add "
                "`torch::Tensor training_step(const Batch& batch, volt::Context& ctx)` returning the loss.");
  static_assert(!has_step || TrainableOn<M, Batch>,
                "volt: return the loss (a torch::Tensor) from training_step, or declare `static constexpr bool "
                "automatic_optimization = false;` and run backward and the optimizer steps yourself: automatic "
                "optimization runs backward on what training_step returns, and this one returns no tensor.");
  static_assert(!several_optimizers_automatic<M>(),
                "volt: declare `static constexpr bool automatic_optimization = false;` in the module and step the "
                "optimizers in training_step (ctx.optimizers(), ctx.manual_backward(loss), opt.step()), or return "
                "one optimizer from configure_optimizers: automatic optimization steps one optimizer, and this "
                "configure_optimizers returns several (a tuple or a vector).");
  static_assert(validates_on<M, ValBatch>(),
                "volt: fit was given a validation loader but the module has no validation_step for its batches. Add "
                "`void validation_step(const Batch& batch, volt::Context& ctx)`, or call fit without the loader.");
  static_assert(!sharded_manual<S, M>,
                "volt: train a module with manual optimization under DDP, or let the sharded strategy (ZeRO<1>, "
                "ZeRO<2>, FSDP, ModelParallel) step it automatically: a sharded strategy steps each rank's shard of "
                "the optimizer after the gradients' reduce-scatter and gathers the parameters after it, which a "
                "training_step's own optimizer.step() would bypass.");
  // the hooks the module declares in its volt_hooks, each a member it has (volt/declared_hooks.hpp)
  static constexpr bool hooks_declared = check_declared_hooks<module_impl_t<M>>();
  static constexpr bool ok = Module<M> && TrainableOn<M, Batch> && !several_optimizers_automatic<M>() &&
                             validates_on<M, ValBatch>() && !sharded_manual<S, M> && hooks_declared;
};

}  // namespace detail
}  // namespace volt
