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

#include "volt/accelerators/concept.hpp"
#include "volt/precision/concept.hpp"
#include "volt/strategies/concept.hpp"

namespace volt {

/// The precision's float16 autocast, if it needs one, exists on the accelerator.
template <class P, class A>
concept Fp16AutocastAvailable = !P::needs_fp16_autocast || A::has_fp16_autocast;

/// The precision's bfloat16 autocast, if it needs one, exists on the accelerator.
template <class P, class A>
concept Bf16AutocastAvailable = !P::needs_bf16_autocast || A::has_bf16_autocast;

namespace detail {

/// The three slots hold their kinds; the pairwise rules are only asked when they do (no cascades).
template <class S, class P, class A>
inline constexpr bool slots_ok = Strategy<S> && Precision<P> && Accelerator<A>;

}  // namespace detail
}  // namespace volt
