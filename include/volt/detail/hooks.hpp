#pragma once
/// \file
/// Calls to optional hooks, found at compile time. For each hook name `h` this defines
///   - `module_hook::h(module, ctx, args...)`: `module.h(args..., ctx)` or `module.h(args...)`, or nothing;
///   - `callback_hook::h(callback, trainer, module, args...)`: `callback.h(trainer, module, args...)`, or nothing.
/// A member named `h` that fits neither form is a compile error naming the hook, so a misspelt signature is
/// never silently skipped.

#include "volt/context.hpp"

#include <utility>

// Internal only: generates the two callers of one hook, then is undefined at the end of this header.
#define VOLT_DETAIL_HOOK(h)                                                                                          \
  namespace volt::detail::module_hook {                                                                             \
  template <class M, class... A>                                                                                     \
  decltype(auto) h(M& m, Context& ctx, A&&... a) {                                                                  \
    if constexpr (requires { m.h(std::forward<A>(a)..., ctx); }) {                                                   \
      return m.h(std::forward<A>(a)..., ctx);                                                                        \
    } else if constexpr (requires { m.h(std::forward<A>(a)...); }) {                                                 \
      return m.h(std::forward<A>(a)...);                                                                             \
    } else {                                                                                                         \
      static_assert(!requires { &M::h; }, "volt: the module's " #h                                                   \
                    " has a signature volt does not call; see the hook table in volt/module.hpp for its arguments " \
                    "(a trailing volt::Context& is optional).");                                                     \
    }                                                                                                                \
  }                                                                                                                  \
  }                                                                                                                  \
  namespace volt::detail::callback_hook {                                                                           \
  template <class C, class T, class M, class... A>                                                                   \
  void h(C& c, T& trainer, M& module, A&&... a) {                                                                    \
    if constexpr (requires { c.h(trainer, module, std::forward<A>(a)...); }) {                                       \
      c.h(trainer, module, std::forward<A>(a)...);                                                                   \
    } else {                                                                                                         \
      static_assert(!requires { &C::h; }, "volt: a callback's " #h                                                   \
                    " has a signature volt does not call; see the hook table in volt/callbacks/concept.hpp.");       \
    }                                                                                                                \
  }                                                                                                                  \
  }

VOLT_DETAIL_HOOK(setup)
VOLT_DETAIL_HOOK(teardown)
VOLT_DETAIL_HOOK(on_fit_start)
VOLT_DETAIL_HOOK(on_fit_end)
VOLT_DETAIL_HOOK(on_sanity_check_start)
VOLT_DETAIL_HOOK(on_sanity_check_end)
VOLT_DETAIL_HOOK(on_train_start)
VOLT_DETAIL_HOOK(on_train_end)
VOLT_DETAIL_HOOK(on_validation_start)
VOLT_DETAIL_HOOK(on_validation_end)
VOLT_DETAIL_HOOK(on_test_start)
VOLT_DETAIL_HOOK(on_test_end)
VOLT_DETAIL_HOOK(on_predict_start)
VOLT_DETAIL_HOOK(on_predict_end)
VOLT_DETAIL_HOOK(on_train_epoch_start)
VOLT_DETAIL_HOOK(on_train_epoch_end)
VOLT_DETAIL_HOOK(on_validation_epoch_start)
VOLT_DETAIL_HOOK(on_validation_epoch_end)
VOLT_DETAIL_HOOK(on_test_epoch_start)
VOLT_DETAIL_HOOK(on_test_epoch_end)
VOLT_DETAIL_HOOK(on_predict_epoch_start)
VOLT_DETAIL_HOOK(on_predict_epoch_end)
VOLT_DETAIL_HOOK(on_train_batch_start)
VOLT_DETAIL_HOOK(on_train_batch_end)
VOLT_DETAIL_HOOK(on_validation_batch_start)
VOLT_DETAIL_HOOK(on_validation_batch_end)
VOLT_DETAIL_HOOK(on_test_batch_start)
VOLT_DETAIL_HOOK(on_test_batch_end)
VOLT_DETAIL_HOOK(on_predict_batch_start)
VOLT_DETAIL_HOOK(on_predict_batch_end)
VOLT_DETAIL_HOOK(on_before_zero_grad)
VOLT_DETAIL_HOOK(on_before_backward)
VOLT_DETAIL_HOOK(on_after_backward)
VOLT_DETAIL_HOOK(on_before_optimizer_step)
VOLT_DETAIL_HOOK(on_exception)

#undef VOLT_DETAIL_HOOK
