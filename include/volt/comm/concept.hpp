#pragma once
/// \file
/// The collective backend kind: what a distributed strategy reduces, broadcasts and gathers tensors with.
///
/// | member | meaning |
/// |---|---|
/// | `static constexpr const char* name` | for messages |
/// | `static constexpr bool supports_cpu`, `supports_cuda` | which tensors it takes (checked against the accelerator at compile time) |
/// | `Backend(detail::MpiGroup*, torch::Device)` | built once a run knows its processes and device (null group: a world of one) |
/// | `iall_reduce_(t, Reduce) -> Work` | starts an in-place all-reduce; `Work::wait()` finishes it |
/// | `ireduce_scatter_(flat, Reduce) -> Work` | starts a reduce-scatter of a flat tensor of world-size equal blocks, in place: this rank's block (`detail::block_of`) ends up holding the reduction of every rank's block |
/// | `iall_gather_(flat) -> Work` | starts an all-gather of a flat tensor in place: each rank gives its own block and ends up with every rank's |
/// | `all_reduce_(t, Reduce)`, `reduce_scatter_(flat, Reduce)`, `all_gather_(flat)`, `broadcast_(t, root)`, `all_gather(t) -> [world, ...]`, `barrier()` | blocking collectives |
/// | `isend_(t, peer)`, `irecv_(t, peer) -> Work` | a point-to-point send or receive of `t`'s bytes (peer: a rank of the axis) |
/// | `ibatch_(std::vector<P2P>) -> Work` | sends and receives started together (NCCL: one group, so two ranks may send to each other) |
///
/// Every backend runs on the whole group or on one axis of a mesh (`Mpi(axis)`, `Nccl(axis, device)`: mesh.hpp);
/// its ranks are then the coordinates along the axis.
///
/// Backends: `Mpi` (Open MPI; CPU tensors, CUDA ones staged through the host) and `Nccl` (CUDA tensors;
/// needs the `volt::nccl` CMake target, which defines VOLT_WITH_NCCL). `AutoBackend` lets the strategy pick:
/// Nccl on GPU, Mpi on CPU, as Lightning picks nccl and gloo.

#include "volt/reduce.hpp"

#include <c10/util/StringUtil.h>
#include <torch/types.h>

#include <concepts>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifndef VOLT_WITH_NCCL
#define VOLT_WITH_NCCL 0
#endif

namespace volt {

namespace detail {
class MpiGroup;

/// The size of each of `world` equal blocks of the flat tensor `flat` that reduce-scatter and all-gather work on;
/// throws, naming `what`, unless `flat` is 1-D, contiguous and divides evenly into blocks of at most `max_block`
/// elements (MPI counts in `int`).
inline int64_t block_numel(const torch::Tensor& flat, int world, const char* what,
                           int64_t max_block = std::numeric_limits<int64_t>::max()) {
  if (flat.dim() != 1 || !flat.is_contiguous() || world < 1 || flat.numel() % world != 0 ||
      flat.numel() / world > max_block) {
    throw std::invalid_argument(std::string("volt: a flat ") + what + " takes a contiguous 1-D tensor of " +
                                std::to_string(world) + " equal blocks of at most " + std::to_string(max_block) +
                                " elements, got shape " + c10::str(flat.sizes()) +
                                (flat.is_contiguous() ? "" : ", not contiguous") +
                                "; pad it to a multiple of the world size, or make the buckets smaller.");
  }
  return flat.numel() / world;
}

/// The block arithmetic of reduce-scatter and all-gather, in one place (the collectives, ZeRO's reducer and its
/// layout use it): a flat buffer of `numel` elements, a multiple of the world size `world`, cut into `world` equal
/// blocks; rank r's block is [start(r), end(r)).
struct Blocks {
  int64_t numel = 0;
  int world = 1;

  /// `numel` elements padded to the next multiple of `world`.
  static Blocks padded(int64_t numel, int world) { return {(numel + world - 1) / world * world, world}; }
  int64_t size() const { return numel / world; }
  int64_t start(int rank) const { return rank * size(); }
  int64_t end(int rank) const { return (rank + 1) * size(); }
};

/// Rank `rank`'s block of the flat tensor `flat` cut into `world` equal blocks (a view).
inline torch::Tensor block_of(const torch::Tensor& flat, int rank, int world) {
  const Blocks blocks{flat.numel(), world};
  return flat.narrow(0, blocks.start(rank), blocks.size());
}
}  // namespace detail

/// One send or receive of a batch (`Backend::ibatch_`), as torch.distributed's P2POp: `tensor` goes to, or comes
/// from, rank `peer` of the backend's axis.
struct P2P {
  enum Kind : bool { send, recv };
  Kind kind;
  torch::Tensor tensor;
  int peer;
};

class Mpi;
class Nccl;  // defined in volt/comm/nccl.hpp when VOLT_WITH_NCCL

/// Picks the backend from the accelerator: Nccl for CUDA, Mpi otherwise.
struct AutoBackend {};

/// What the compile-time rules need to know of a backend, without its definition.
template <class B>
struct backend_traits {
  static constexpr bool supports_cpu = B::supports_cpu;
  static constexpr bool supports_cuda = B::supports_cuda;
  static constexpr bool available = true;
};
template <>
struct backend_traits<Nccl> {
  static constexpr bool supports_cpu = false;
  static constexpr bool supports_cuda = true;
  static constexpr bool available = VOLT_WITH_NCCL != 0;
};

template <class B>
concept CollectiveBackend = requires(B& b, const torch::Tensor& t) {
  { B::name } -> std::convertible_to<const char*>;
  b.iall_reduce_(t, Reduce::sum).wait();
  b.all_reduce_(t, Reduce::sum);
  b.ireduce_scatter_(t, Reduce::sum).wait();
  b.reduce_scatter_(t, Reduce::sum);
  b.iall_gather_(t).wait();
  b.all_gather_(t);
  b.broadcast_(t, 0);
  { b.all_gather(t) } -> std::convertible_to<torch::Tensor>;
  b.barrier();
  b.isend_(t, 0).wait();
  b.irecv_(t, 0).wait();
  b.ibatch_(std::vector<P2P>{}).wait();
};

}  // namespace volt

namespace volt {

/// `AutoBackend` resolved for an accelerator `A`: Nccl for CUDA devices, Mpi otherwise.
template <class B, class A>
struct resolve_backend {
  using type = B;
};
template <class A>
struct resolve_backend<AutoBackend, A> {
  using type = std::conditional_t<A::device_type == c10::DeviceType::CUDA, Nccl, Mpi>;
};
template <class B, class A>
using resolve_backend_t = typename resolve_backend<B, A>::type;

}  // namespace volt
