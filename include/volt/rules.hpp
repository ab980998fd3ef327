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
///
/// **The three phases of validation.** Every setting is checked as early as it can be known, and said once:
///  - **phase (a), compile time**: the Trainer's type. Each slot holds its kind and the rules above hold;
///    a `static_assert` in `Trainer` says which and how to fix it (volt/trainer.hpp).
///  - **phase (b), construction**: the run-time options and this machine. `Trainer`'s constructor checks
///    every `TrainerOptions` field (`validate_options`, volt/options.hpp), the accelerator's availability and
///    device count, and the strategy's `check_devices` (devices, num_nodes, an outside mpirun/srun job);
///    it throws `ConfigError` and starts nothing.
///  - **phase (c), the first run**: what needs processes or devices (the process group, device
///    selection, the module's placement) is set up lazily when `fit`/`validate`/`test`/`predict` starts, and
///    what depends on the loaders and the module (limits that need a loader's size, the optimizer) is checked then.

#include "volt/accelerators/concept.hpp"
#include "volt/comm/concept.hpp"
#include "volt/precision/concept.hpp"
#include "volt/strategies/concept.hpp"

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

}  // namespace detail
}  // namespace volt
