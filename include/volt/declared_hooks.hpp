#pragma once
/// \file
/// The names of the members volt calls on a module, a callback or a logger, and the check of the hooks a type says
/// it implements. C++20 cannot list a type's members, so a misspelt optional hook (`on_train_epoch_ends`,
/// `configure_optimizer`, a logger's `finalise`) compiles and is never called: volt checks the signature of a member
/// it finds under a hook's name, not a name it does not find. A type that names the hooks it means to implement,
/// \code
///   struct Timer {
///     using volt_hooks = volt::Hooks<volt::hook::on_train_epoch_start, volt::hook::on_train_epoch_end>;
///     void on_train_epoch_start(auto& trainer, auto& module) { ... }
///     void on_train_epoch_end(auto& trainer, auto& module) { ... }
///   };
/// \endcode
/// gets a compile error for a name in the list that is not a hook (`volt::hook::on_train_epoch_ends` does not exist;
/// GCC asks "did you mean"), and for each hook in the list it has no member of that name for (misspelt or missing),
/// naming the hook. Callbacks and loggers are checked where the Trainer is made, modules where `fit` is called.
/// Every name of `VOLT_DETAIL_HOOKS` (callbacks' and modules' hooks) and of `VOLT_DETAIL_MEMBERS` (the steps, a
/// module's and a callback's other members, a logger's hooks) has its `volt::hook::` tag.

#include <type_traits>

// Every hook, in the order a fit meets them.
#define VOLT_DETAIL_HOOKS(X)                                                                                         \
  X(configure_model)                                                                                                 \
  X(setup)                                                                                                           \
  X(on_optimizers_configured)                                                                                        \
  X(on_fit_start)                                                                                                    \
  X(on_sanity_check_start)                                                                                           \
  X(on_sanity_check_end)                                                                                             \
  X(on_train_start)                                                                                                  \
  X(on_train_epoch_start)                                                                                            \
  X(on_train_batch_start)                                                                                            \
  X(on_before_zero_grad)                                                                                             \
  X(on_before_backward)                                                                                              \
  X(on_after_backward)                                                                                               \
  X(on_before_optimizer_step)                                                                                        \
  X(on_train_batch_end)                                                                                              \
  X(on_train_epoch_end)                                                                                              \
  X(on_validation_start)                                                                                             \
  X(on_validation_epoch_start)                                                                                       \
  X(on_validation_batch_start)                                                                                       \
  X(on_validation_batch_end)                                                                                         \
  X(on_validation_epoch_end)                                                                                         \
  X(on_validation_end)                                                                                               \
  X(on_train_end)                                                                                                    \
  X(on_fit_end)                                                                                                      \
  X(on_test_start)                                                                                                   \
  X(on_test_epoch_start)                                                                                             \
  X(on_test_batch_start)                                                                                             \
  X(on_test_batch_end)                                                                                               \
  X(on_test_epoch_end)                                                                                               \
  X(on_test_end)                                                                                                     \
  X(on_predict_start)                                                                                                \
  X(on_predict_epoch_start)                                                                                          \
  X(on_predict_batch_start)                                                                                          \
  X(on_predict_batch_end)                                                                                            \
  X(on_predict_epoch_end)                                                                                            \
  X(on_predict_end)                                                                                                  \
  X(teardown)                                                                                                        \
  X(on_save_checkpoint)                                                                                              \
  X(on_exception)

// The other members volt calls: a module's steps and optimizers, checkpoint state, a logger's hooks.
#define VOLT_DETAIL_MEMBERS(X)                                                                                       \
  X(training_step)                                                                                                   \
  X(validation_step)                                                                                                 \
  X(test_step)                                                                                                       \
  X(predict_step)                                                                                                    \
  X(configure_optimizers)                                                                                            \
  X(on_load_checkpoint)                                                                                              \
  X(hyper_parameters)                                                                                                \
  X(state_dict)                                                                                                      \
  X(load_state_dict)                                                                                                 \
  X(state_key)                                                                                                       \
  X(log_metrics)                                                                                                     \
  X(log_hyperparams)                                                                                                 \
  X(flush)                                                                                                           \
  X(after_save_checkpoint)                                                                                           \
  X(finalize)

// Internal only: whether a class has a member named `h` of any kind (a member template too, whose address cannot be
// taken): a class derived from it and from one holding an int named `h` finds the name ambiguous exactly when it has
// one. Undefined at the end of this header.
#define VOLT_DETAIL_NAME_PROBE(h)                                                                                    \
  struct name_##h##_fallback {                                                                                       \
    int h;                                                                                                           \
  };                                                                                                                 \
  template <class C>                                                                                                 \
  struct name_##h##_probe : C, name_##h##_fallback {};                                                              \
  template <class C>                                                                                                 \
  constexpr bool has_member_##h() {                                                                                  \
    if constexpr (std::is_final_v<C>) {                                                                              \
      return requires { &C::h; };                                                                                    \
    } else {                                                                                                         \
      return !requires { &name_##h##_probe<C>::h; };                                                                 \
    }                                                                                                                \
  }

// Internal only: the public tag of hook `h`, whose `check<C>()` fails naming the hook where `C` has no such member.
#define VOLT_DETAIL_HOOK_NAME(h)                                                                                     \
  struct h {                                                                                                         \
    static constexpr const char* name = #h;                                                                          \
    template <class C>                                                                                               \
    static constexpr bool check() {                                                                                  \
      static_assert(::volt::detail::has_member_##h<C>(),                                                             \
                    "volt: the type declares volt::hook::" #h " in its volt_hooks and has no member named " #h       \
                    " (misspelt, or missing): volt would never call it.");                                          \
      return true;                                                                                                   \
    }                                                                                                                \
  };

namespace volt {

namespace detail {
VOLT_DETAIL_HOOKS(VOLT_DETAIL_NAME_PROBE)
VOLT_DETAIL_MEMBERS(VOLT_DETAIL_NAME_PROBE)
}  // namespace detail

/// The hooks and members volt calls, by name, for a type's `volt_hooks` (the file comment).
namespace hook {
VOLT_DETAIL_HOOKS(VOLT_DETAIL_HOOK_NAME)
VOLT_DETAIL_MEMBERS(VOLT_DETAIL_HOOK_NAME)
}  // namespace hook

/// The hooks a type says it implements: `using volt_hooks = volt::Hooks<volt::hook::setup, ...>;`.
template <class... H>
struct Hooks {};

namespace detail {

template <class C, class... H>
constexpr bool check_hook_list(Hooks<H...>*) {
  return (H::template check<C>() && ... && true);
}
template <class C>
constexpr bool check_hook_list(void*) {
  static_assert(std::is_same_v<C, void>, "volt: a type's volt_hooks is volt::Hooks<volt::hook::name, ...>.");
  return false;
}

/// Checks the hooks `C` declares in its `volt_hooks`, if it declares any (the file comment); true when it compiles.
template <class C>
constexpr bool check_declared_hooks() {
  if constexpr (requires { typename C::volt_hooks; }) {
    return check_hook_list<C>(static_cast<typename C::volt_hooks*>(nullptr));
  } else {
    return true;
  }
}

}  // namespace detail
}  // namespace volt

#undef VOLT_DETAIL_NAME_PROBE
#undef VOLT_DETAIL_HOOK_NAME
