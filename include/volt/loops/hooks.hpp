#pragma once
/// \file
/// Hooks: what calling one of the hooks of the one list of their names (`VOLT_DETAIL_HOOKS`, volt/declared_hooks.hpp)
/// means, and the fan-out the loops use.
///
/// For each name `h` in the list, `hooks::h` is a tag type with two static functions:
///   - `hooks::h::module(module, ctx, args...)`: `module.h(args..., ctx)` or `module.h(args...)`, or nothing;
///   - `hooks::h::callback(callback, trainer, module, args...)`: `callback.h(trainer, module, args...)`, or nothing.
/// A member named `h` that fits neither form is a compile error naming the hook, so a misspelt signature is
/// never silently skipped.
///
/// The loops call hooks through the fan-out only:
///   - `call_hook<hooks::h>(callbacks, trainer, module, ctx, args...)`: every callback in pack order, then the
///     module (Lightning's order); returns what the module's hook returns;
///   - `call_callbacks<hooks::h, Watch>(callbacks, trainer, module, args...)`: callbacks only, all of them or
///     only those that do (or do not) declare `monitors_metrics` (see callbacks/concept.hpp).
/// Adding a hook: one entry in `VOLT_DETAIL_HOOKS` (volt/declared_hooks.hpp), one call site in a loop, one row in the hook tables of
/// module.hpp and callbacks/concept.hpp.

#include "volt/callbacks/concept.hpp"
#include "volt/context.hpp"
#include "volt/declared_hooks.hpp"  // VOLT_DETAIL_HOOKS: the one list of hook names

#include <tuple>
#include <type_traits>
#include <utility>

// Internal only: the tag type of one hook; undefined at the end of this header.
#define VOLT_DETAIL_HOOK_TAG(h)                                                                                      \
  struct h {                                                                                                         \
    static constexpr const char* name = #h;                                                                          \
    template <class M, class... A>                                                                                   \
    static decltype(auto) module(M& m, Context& ctx, A&&... a) {                                                     \
      if constexpr (requires { m.h(std::forward<A>(a)..., ctx); }) {                                                 \
        return m.h(std::forward<A>(a)..., ctx);                                                                      \
      } else if constexpr (requires { m.h(std::forward<A>(a)...); }) {                                               \
        return m.h(std::forward<A>(a)...);                                                                           \
      } else {                                                                                                       \
        static_assert(!requires { &M::h; }, "volt: the module's " #h                                                 \
                      " has a signature volt does not call; see the hook table in volt/module.hpp for its "          \
                      "arguments (a trailing volt::Context& is optional).");                                         \
      }                                                                                                              \
    }                                                                                                                \
    /* Whether module(m, ctx, a...) / callback(c, trainer, module, a...) calls a member (graph mode asks). */       \
    template <class M, class... A>                                                                                   \
    static constexpr bool module_has = requires(M& m, Context& ctx, A&... a) { m.h(a..., ctx); } ||                  \
                                       requires(M& m, A&... a) { m.h(a...); };                                       \
    template <class C, class T, class M, class... A>                                                                 \
    static constexpr bool callback_has = requires(C& c, T& trainer, M& module, A&... a) {                            \
      c.h(trainer, module, a...);                                                                                    \
    };                                                                                                               \
    template <class C, class T, class M, class... A>                                                                 \
    static void callback(C& c, T& trainer, M& module, A&&... a) {                                                    \
      if constexpr (requires { c.h(trainer, module, std::forward<A>(a)...); }) {                                     \
        c.h(trainer, module, std::forward<A>(a)...);                                                                 \
      } else {                                                                                                       \
        static_assert(!requires { &C::h; }, "volt: a callback's " #h                                                 \
                      " has a signature volt does not call; see the hook table in volt/callbacks/concept.hpp.");     \
      }                                                                                                              \
    }                                                                                                                \
  };

namespace volt::detail {

namespace hooks {
VOLT_DETAIL_HOOKS(VOLT_DETAIL_HOOK_TAG)
}  // namespace hooks

/// Which callbacks a `call_callbacks` reaches.
enum class Watch { all, not_monitoring, monitoring };

/// Runs hook `H` on the callbacks in pack order (those `W` selects).
template <class H, Watch W = Watch::all, class... Cs, class T, class M, class... A>
void call_callbacks(std::tuple<Cs...>& callbacks, T& trainer, M& module, A&&... args) {
  for_each_callback(callbacks, [&](auto& c) {
    constexpr bool monitors = monitors_metrics<std::remove_cvref_t<decltype(c)>>;
    if constexpr (W == Watch::all || (W == Watch::monitoring) == monitors) H::callback(c, trainer, module, args...);
  });
}

/// Runs hook `H` on every callback, then on the module; returns the module hook's result.
template <class H, class... Cs, class T, class M, class... A>
decltype(auto) call_hook(std::tuple<Cs...>& callbacks, T& trainer, M& module, Context& ctx, A&&... args) {
  call_callbacks<H>(callbacks, trainer, module, args...);
  return H::module(module, ctx, std::forward<A>(args)...);
}

}  // namespace volt::detail

#undef VOLT_DETAIL_HOOK_TAG
