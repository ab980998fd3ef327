#pragma once
/// \file
/// The fields of a plain options struct, found at compile time: how many there are (`field_count`), a tuple of
/// references to them (`tie`), and, with GCC, each one's name as the compiler spells it (`field_name`). This is what
/// lets volt's configuration (volt/config.hpp) check a struct's table of fields against the struct itself: a field
/// added to `TrainerOptions` and not to its table is a compile error that names it.
///
/// The struct must be an aggregate without base classes, arrays or references (as `TrainerOptions` is), with at most
/// 40 fields. The technique is Boost.PFR's: count the fields by aggregate initialisation from values that convert to
/// anything, bind them with a structured binding of that many names, and read a field's name from the signature of a
/// function templated on a pointer to it (GCC prints `&object.Struct::field`).

#include <array>
#include <cstddef>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace volt::config::detail {

template <std::size_t N>
using Arity = std::integral_constant<std::size_t, N>;

/// The most fields a configurable struct may have (the structured bindings below go this far).
inline constexpr std::size_t max_fields = 40;

template <class T>
T& unsafe_reference() noexcept {  // only ever named in unevaluated operands
  std::remove_reference_t<T>* p = nullptr;
  return *p;
}

/// Converts to a reference of any type: `T{AnyField{}, ...}` compiles while T has at least that many fields.
struct AnyField {
  template <class T>
  constexpr operator T&() const&& noexcept {
    return unsafe_reference<T>();
  }
};

template <class T, std::size_t... I>
constexpr bool initialisable_from(std::index_sequence<I...>) {
  return requires { T{(static_cast<void>(I), AnyField{})...}; };
}

/// The number of fields of the aggregate T.
template <class T, std::size_t N = 0>
constexpr std::size_t field_count() {
  if constexpr (N > max_fields || !initialisable_from<T>(std::make_index_sequence<N + 1>{})) {
    return N;
  } else {
    return field_count<T, N + 1>();
  }
}

template <class T> constexpr auto tie(T& v, Arity<1>) { auto& [f0] = v; return std::tie(f0); }
template <class T> constexpr auto tie(T& v, Arity<2>) { auto& [f0, f1] = v; return std::tie(f0, f1); }
template <class T> constexpr auto tie(T& v, Arity<3>) { auto& [f0, f1, f2] = v; return std::tie(f0, f1, f2); }
template <class T> constexpr auto tie(T& v, Arity<4>) { auto& [f0, f1, f2, f3] = v; return std::tie(f0, f1, f2, f3); }
template <class T>
constexpr auto tie(T& v, Arity<5>) {
  auto& [f0, f1, f2, f3, f4] = v;
  return std::tie(f0, f1, f2, f3, f4);
}
template <class T>
constexpr auto tie(T& v, Arity<6>) {
  auto& [f0, f1, f2, f3, f4, f5] = v;
  return std::tie(f0, f1, f2, f3, f4, f5);
}
template <class T>
constexpr auto tie(T& v, Arity<7>) {
  auto& [f0, f1, f2, f3, f4, f5, f6] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6);
}
template <class T>
constexpr auto tie(T& v, Arity<8>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7);
}
template <class T>
constexpr auto tie(T& v, Arity<9>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8);
}
template <class T>
constexpr auto tie(T& v, Arity<10>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9);
}
template <class T>
constexpr auto tie(T& v, Arity<11>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10);
}
template <class T>
constexpr auto tie(T& v, Arity<12>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11);
}
template <class T>
constexpr auto tie(T& v, Arity<13>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12);
}
template <class T>
constexpr auto tie(T& v, Arity<14>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13);
}
template <class T>
constexpr auto tie(T& v, Arity<15>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14);
}
template <class T>
constexpr auto tie(T& v, Arity<16>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15);
}
template <class T>
constexpr auto tie(T& v, Arity<17>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16);
}
template <class T>
constexpr auto tie(T& v, Arity<18>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17);
}
template <class T>
constexpr auto tie(T& v, Arity<19>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18);
}
template <class T>
constexpr auto tie(T& v, Arity<20>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19);
}
template <class T>
constexpr auto tie(T& v, Arity<21>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20);
}
template <class T>
constexpr auto tie(T& v, Arity<22>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21);
}
template <class T>
constexpr auto tie(T& v, Arity<23>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22);
}
template <class T>
constexpr auto tie(T& v, Arity<24>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22,
         f23] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23);
}
template <class T>
constexpr auto tie(T& v, Arity<25>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24);
}
template <class T>
constexpr auto tie(T& v, Arity<26>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25);
}
template <class T>
constexpr auto tie(T& v, Arity<27>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26);
}
template <class T>
constexpr auto tie(T& v, Arity<28>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27);
}
template <class T>
constexpr auto tie(T& v, Arity<29>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28);
}
template <class T>
constexpr auto tie(T& v, Arity<30>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29);
}
template <class T>
constexpr auto tie(T& v, Arity<31>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30);
}
template <class T>
constexpr auto tie(T& v, Arity<32>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31);
}
template <class T>
constexpr auto tie(T& v, Arity<33>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31, f32] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32);
}
template <class T>
constexpr auto tie(T& v, Arity<34>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31, f32, f33] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33);
}
template <class T>
constexpr auto tie(T& v, Arity<35>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34);
}
template <class T>
constexpr auto tie(T& v, Arity<36>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35);
}
template <class T>
constexpr auto tie(T& v, Arity<37>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36);
}
template <class T>
constexpr auto tie(T& v, Arity<38>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37);
}
template <class T>
constexpr auto tie(T& v, Arity<39>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38);
}
template <class T>
constexpr auto tie(T& v, Arity<40>) {
  auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23,
         f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39] = v;
  return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21,
                  f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39);
}

/// References to every field of `v`, in declaration order.
template <class T>
constexpr auto tie(T& v) {
  constexpr std::size_t n = field_count<std::remove_const_t<T>>();
  static_assert(n >= 1 && n <= max_fields, "volt: a configurable struct has between 1 and 40 fields.");
  return tie(v, Arity<n>{});
}

/// The type of field I of T.
template <class T, std::size_t I>
using field_type = std::remove_cvref_t<std::tuple_element_t<I, decltype(tie(std::declval<T&>()))>>;

template <class T>
struct Wrapper {
  const T value;
};
/// Never defined: only the addresses of its fields are used, as template arguments.
template <class T>
extern const Wrapper<T> fake_object;

template <auto Pointer>
consteval std::string_view signature() {
  return __PRETTY_FUNCTION__;
}

/// Whether field names can be read here (GCC's signatures spell a subobject pointer; Clang 14 rejects one as a
/// template argument).
#if defined(__GNUC__) && !defined(__clang__)
inline constexpr bool names_known = true;
#else
inline constexpr bool names_known = false;
#endif

/// The name of field I of T as declared (GCC; elsewhere empty).
template <class T, std::size_t I>
consteval std::string_view field_name() {
  if constexpr (names_known) {
    constexpr std::string_view s = signature<&std::get<I>(tie(fake_object<T>.value))>();
    const std::size_t from = s.find("Pointer = ");
    std::size_t to = s.find_first_of(";]", from);
    while (to > from && s[to - 1] == ')') --to;
    const std::size_t last = s.find_last_of(":.", to - 1);
    return s.substr(last + 1, to - last - 1);
  } else {
    return {};
  }
}

/// A string as a template argument, so that a compile error can show it.
template <std::size_t N>
struct FixedString {
  char text[N + 1] = {};
  constexpr explicit FixedString(std::string_view s) {
    for (std::size_t i = 0; i < N; ++i) text[i] = s[i];
  }
};

}  // namespace volt::config::detail
