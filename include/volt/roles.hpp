#pragma once
/// \file
/// The optional roles of a strategy or of a layout's holder, declared, not guessed. C++20 cannot list a type's
/// members, so an optional member found by a probe (`if constexpr (requires { s.state_slices(); })`) falls silently to
/// its default when it is misspelt. volt asks instead what a type declares:
/// \code
///   struct MyStrategy : volt::StrategyDefaults {
///     using volt_roles = volt::Roles<volt::role::writes_shards>;
///     ...  // state_dict_type(), state_slices(), full_param_groups(optimizer)
///   };
/// \endcode
/// A role is a tag (`volt::role::...`, each beside the default it replaces) with its members as one requirement; each
/// optional member volt calls is called where the role is declared and defaulted where it is not. The check
/// (`VOLT_DETAIL_CHECK_ROLE`, where the type is used) makes both mistakes compile errors that name the role: a declared
/// role whose members are missing, misspelt or of another signature, and a type that has every member of a role
/// without declaring it.

#include <type_traits>

namespace volt {

/// The roles a type takes on (its `volt_roles`).
template <class... R>
struct Roles {};

namespace detail {
template <class T>
struct roles_of {
  using type = Roles<>;
};
template <class T>
  requires requires { typename T::volt_roles; }
struct roles_of<T> {
  using type = typename T::volt_roles;
};
template <class R, class List>
inline constexpr bool in_roles = false;
template <class R, class... Rs>
inline constexpr bool in_roles<R, Roles<Rs...>> = (std::is_same_v<R, Rs> || ...);
}  // namespace detail

/// Whether `T` declares role `R` in its `volt_roles`.
template <class T, class R>
inline constexpr bool declares_role = detail::in_roles<R, typename detail::roles_of<std::remove_cvref_t<T>>::type>;

}  // namespace volt

/// Role `R` (a tag of `volt::role`, by its bare name) checked on `T` where its members are `R::met<Args...>`: `kind`
/// names what `T` is in the message ("strategy", "layout's holder").
#define VOLT_DETAIL_CHECK_ROLE(R, kind, T, ...)                                                                      \
  static_assert(!::volt::declares_role<T, ::volt::role::R> || ::volt::role::R::template met<__VA_ARGS__>,            \
                "volt: a " kind " declares volt::role::" #R " in its volt_roles and lacks one of the role's members, " \
                "or has one of another signature: see volt::role::" #R "'s comment for them.");                      \
  static_assert(::volt::declares_role<T, ::volt::role::R> || !::volt::role::R::template met<__VA_ARGS__>,            \
                "volt: a " kind " has every member of volt::role::" #R " without declaring the role, so volt would " \
                "not call them: add volt::role::" #R " to its volt_roles.")
