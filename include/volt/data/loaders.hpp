#pragma once
/// \file
/// Several validation or test loaders in one run, as Lightning's list of `val_dataloaders` (its "sequential" mode):
/// one evaluation run goes through each loader in turn, with one epoch start and one epoch end around all of them;
/// each loader's batches see `ctx.dataloader_idx()` (and callbacks `trainer.dataloader_idx()`), and what they log is
/// named `<name>/dataloader_idx_<i>`. The loaders may yield different batch types: the module then has a
/// `validation_step` (or `test_step`) for each.
/// \code
///   trainer.fit(model, train, volt::data::loaders(val_clean, val_noisy));
///   trainer.test(model, volt::data::loaders(test_a, test_b));
/// \endcode

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace volt::data {

/// The loaders of one evaluation run, in order. Built by `loaders(...)`, which keeps a reference to a loader given
/// as an lvalue and the loader itself when given a temporary.
template <class... L>
class Loaders {
  static_assert(sizeof...(L) >= 1, "volt: data::loaders needs at least one loader.");

 public:
  static constexpr std::size_t count = sizeof...(L);

  explicit Loaders(L... loaders) : loaders_(std::forward<L>(loaders)...) {}

  /// Calls `f(loader, index)` for each loader in order.
  template <class F>
  void for_each(F&& f) {
    for_each_impl(f, std::index_sequence_for<L...>{});
  }
  /// The loaders `f` makes of each (a strategy's shard of each), in order: references where `f` returns one.
  template <class F>
  auto map(F&& f) {
    return map_impl(f, std::index_sequence_for<L...>{});
  }
  std::tuple<L...>& tuple() { return loaders_; }

 private:
  template <class F, std::size_t... I>
  void for_each_impl(F& f, std::index_sequence<I...>) {
    (f(std::get<I>(loaders_), I), ...);
  }
  template <class F, std::size_t... I>
  auto map_impl(F& f, std::index_sequence<I...>) {
    return Loaders<decltype(f(std::get<I>(loaders_)))...>(f(std::get<I>(loaders_))...);
  }

  std::tuple<L...> loaders_;
};

/// Several loaders for one validation or test run: `fit(model, train, volt::data::loaders(val_a, val_b))`.
template <class... L>
Loaders<L...> loaders(L&&... loaders) {
  return Loaders<L...>(std::forward<L>(loaders)...);
}

template <class T>
inline constexpr bool is_loaders_v = false;
template <class... L>
inline constexpr bool is_loaders_v<Loaders<L...>> = true;

/// Calls `f(loader, index, count)` for each of several loaders, or once for a single one (index 0 of 1).
template <class L, class F>
void for_each_loader(L& loader, F&& f) {
  if constexpr (is_loaders_v<std::remove_cv_t<L>>) {
    loader.for_each([&](auto& one, std::size_t i) { f(one, i, L::count); });
  } else {
    f(loader, std::size_t{0}, std::size_t{1});
  }
}

}  // namespace volt::data
