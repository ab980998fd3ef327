#pragma once
/// \file
/// A box of a tensor, the shape of every piece of the sharded checkpoint form (volt/checkpoint/sharded.hpp) and of
/// every read of it (volt/checkpoint/sharded_reader.hpp): offsets and sizes along each dimension of the tensor or of a
/// view of it, and the runs of flat elements it holds, by which two boxes' shared elements are found and copied.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace volt::checkpoint {

/// A box of a tensor: along each dimension of the tensor viewed as `view` (its own shape; `{numel}` for a range of its
/// flattened elements; any shape of as many elements, such as a fused weight's `{3, d, d}`), the elements from
/// `offsets[d]` to `offsets[d] + sizes[d]`. PyTorch's distributed checkpoints call it a chunk (offsets and sizes); the
/// view lets a range of flat buckets' elements, which crosses rows, be one too.
struct Box {
  std::vector<int64_t> view, offsets, sizes;
  int64_t numel() const {
    int64_t n = 1;
    for (const int64_t s : sizes) n *= s;
    return n;
  }
  /// Elements [offset, offset + numel) of a tensor of `total` elements, flattened.
  static Box flat(int64_t total, int64_t offset, int64_t numel) { return {{total}, {offset}, {numel}}; }
  /// All of a tensor of shape `shape`.
  static Box whole(const std::vector<int64_t>& shape) { return {shape, std::vector<int64_t>(shape.size(), 0), shape}; }
  bool operator==(const Box&) const = default;
};

namespace detail {

/// Elements [start, start + length) of a tensor, flattened, found at `local` in a box's own (row-major) order.
struct Run {
  int64_t start = 0, length = 0, local = 0;
  int64_t end() const { return start + length; }
};
/// A box as the runs of the tensor's flat elements it holds, in order (one for a flat range or rows cut whole).
inline std::vector<Run> runs_of(const Box& b) {
  const std::size_t d = b.view.size();
  if (d == 0) return {{0, 1, 0}};
  if (b.numel() == 0) return {};
  std::vector<int64_t> stride(d, 1);
  for (std::size_t i = d - 1; i-- > 0;) stride[i] = stride[i + 1] * b.view[i + 1];
  std::size_t m = d - 1;  // the dimension a run is cut along: those after it are whole
  while (m > 0 && b.sizes[m] == b.view[m]) --m;
  const int64_t length = b.sizes[m] * stride[m];
  std::vector<int64_t> at(m, 0);
  std::vector<Run> out;
  for (int64_t local = 0;; local += length) {
    int64_t start = b.offsets[m] * stride[m];
    for (std::size_t i = 0; i < m; ++i) start += (b.offsets[i] + at[i]) * stride[i];
    out.push_back({start, length, local});
    std::size_t i = m;
    while (i > 0 && ++at[i - 1] == b.sizes[i - 1]) at[--i] = 0;
    if (i == 0) return out;
  }
}
/// Calls `each(a_run, b_run, lo, hi)` for every stretch [lo, hi) of flat elements that runs `a` and `b` (each in
/// order) both hold.
template <class F>
void for_shared(const std::vector<Run>& a, const std::vector<Run>& b, F&& each) {
  for (std::size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    const int64_t lo = std::max(a[i].start, b[j].start), hi = std::min(a[i].end(), b[j].end());
    if (lo < hi) each(a[i], b[j], lo, hi);
    a[i].end() < b[j].end() ? ++i : ++j;
  }
}
/// Whether two boxes' runs share an element.
inline bool share(const std::vector<Run>& a, const std::vector<Run>& b) {
  bool shared = false;
  for_shared(a, b, [&](const Run&, const Run&, int64_t, int64_t) { shared = true; });
  return shared;
}
/// Copies into `to` (box `tb`'s elements in order, `element` bytes each) those of `from` (`fb`'s) that both boxes
/// hold; returns how many.
inline int64_t copy_shared(const std::vector<Run>& tb, char* to, const std::vector<Run>& fb, const char* from,
                           std::size_t element) {
  int64_t copied = 0;
  for_shared(tb, fb, [&](const Run& t, const Run& f, int64_t lo, int64_t hi) {
    std::memcpy(to + (t.local + lo - t.start) * element, from + (f.local + lo - f.start) * element,
                static_cast<std::size_t>(hi - lo) * element);
    copied += hi - lo;
  });
  return copied;
}

}  // namespace detail

}  // namespace volt::checkpoint
