#pragma once
/// \file
/// `volt::Mpi`: collectives on tensors over Open MPI. CPU tensors are reduced in place; CUDA tensors (when
/// a GPU run chooses Mpi over Nccl) are staged through host memory; float16/bfloat16 are reduced in
/// float32 (MPI has no type for them). The collectives run blocking on a thread of the backend's own
/// (collective_thread.hpp: Open MPI's tuned algorithms, progressing while the rank computes); sends and receives are
/// MPI's non-blocking ones. Every wait watches the group's failure channel (see runtime.hpp).

#include "volt/comm/collective_thread.hpp"
#include "volt/comm/concept.hpp"
#include "volt/comm/mesh.hpp"
#include "volt/comm/runtime.hpp"
#include "volt/reduce.hpp"

#include <torch/types.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace volt {

namespace detail {

inline MPI_Datatype mpi_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return MPI_FLOAT;
    case c10::ScalarType::Double: return MPI_DOUBLE;
    case c10::ScalarType::Long: return MPI_INT64_T;
    case c10::ScalarType::Int: return MPI_INT32_T;
    case c10::ScalarType::Short: return MPI_INT16_T;
    case c10::ScalarType::Char: return MPI_INT8_T;
    case c10::ScalarType::Byte: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
  }
}

inline MPI_Op mpi_op(Reduce op) {
  switch (op) {
    case Reduce::sum:
    case Reduce::mean: return MPI_SUM;
    case Reduce::max: return MPI_MAX;
    case Reduce::min: return MPI_MIN;
  }
  return MPI_SUM;
}

/// The tensor MPI works on for `t`: `t` itself when it is a contiguous CPU tensor of a type MPI knows,
/// otherwise a contiguous CPU copy in float32 (float16/bfloat16), int64 (bool) or the same type.
inline torch::Tensor mpi_buffer(const torch::Tensor& t) {
  torch::Tensor b = t;
  if (b.scalar_type() == c10::ScalarType::Half || b.scalar_type() == c10::ScalarType::BFloat16) {
    b = b.to(torch::kFloat32);
  } else if (b.scalar_type() == c10::ScalarType::Bool) {
    b = b.to(torch::kLong);
  } else if (mpi_type(b.scalar_type()) == MPI_DATATYPE_NULL) {
    throw std::invalid_argument(std::string("volt: Mpi cannot reduce tensors of type ") + c10::toString(b.scalar_type()) +
                                "; allowed: float16/32/64, bfloat16, int8/16/32/64, uint8, bool.");
  }
  if (!b.device().is_cpu()) b = b.to(torch::kCPU);
  return b.contiguous();
}

}  // namespace detail

/// Collectives, sends and receives over an MPI process group, or over one axis of a mesh of it (mesh.hpp): ranks
/// are then the members' coordinates along the axis. A null group is a world of one (every collective is an identity).
class Mpi {
 public:
  static constexpr const char* name = "Mpi";
  static constexpr bool supports_cpu = true;
  static constexpr bool supports_cuda = true;  // staged through host memory

  /// Collectives, sends or receives in flight; `wait()` finishes them, in the order issued: each result, in its
  /// buffer, is divided by the axis size for a mean and copied into its target where the two differ (a staged or
  /// converted copy, reduce-scatter's block, a receive into a tensor MPI cannot write). Inputs are kept alive for MPI
  /// to read until then.
  class Work {
   public:
    Work() = default;
    Work(const MeshAxis& axis, Reduce op)
        : group_(axis.group()), divisor_(axis.size()), op_(op),
          members_(axis.size() == (group_ ? group_->size() : 1) ? std::vector<int>{} : axis.members()) {}
    /// Adds one request (the operation `kind` on `buffer`, recorded in the group's flight recorder with `route`);
    /// returns where MPI writes it.
    MPI_Request* add(detail::Collective kind, torch::Tensor target, torch::Tensor buffer, detail::Route route,
                     torch::Tensor input = {}) {
      const int64_t bytes = static_cast<int64_t>(buffer.nbytes());
      parts_.push_back({std::move(target), std::move(buffer), std::move(input), MPI_REQUEST_NULL, nullptr,
                        group_->record(kind, bytes, route)});
      return &parts_.back().request;
    }
    /// Adds one collective `call` queued on `thread` (the operation `kind` on `buffer`, recorded as add() records).
    void add(detail::CollectiveThread& thread, detail::Collective kind, torch::Tensor target, torch::Tensor buffer,
             detail::Route route, detail::CollectiveThread::Call call) {
      const int64_t bytes = static_cast<int64_t>(buffer.nbytes());
      const uint64_t seq = group_->record(kind, bytes, route);
      parts_.push_back({std::move(target), std::move(buffer), {}, MPI_REQUEST_NULL, thread.submit(std::move(call)), seq});
    }
    void wait() {
      for (Part& p : parts_) {
        if (p.ticket != nullptr) {
          const auto pause = [&p] { p.ticket->wait_for(std::chrono::milliseconds(100)); };
          group_->wait_until([&p] { return p.ticket->done(); }, pause, p.seq, members_);
          detail::mpi_check(p.ticket->error(), "an MPI collective");
        } else {
          group_->wait(p.request, p.seq, members_);
        }
        if (op_ == Reduce::mean) p.buffer.div_(divisor_);
        if (p.target.defined() && p.buffer.data_ptr() != p.target.data_ptr()) {
          p.target.copy_(p.buffer.view_as(p.target));
        }
      }
      parts_.clear();  // nothing of the buckets kept alive after the wait
    }

   private:
    struct Part {
      torch::Tensor target, buffer, input;
      MPI_Request request;                      // a send or receive
      std::shared_ptr<detail::Ticket> ticket;   // or a collective on the backend's thread
      uint64_t seq;
    };
    detail::MpiGroup* group_ = nullptr;
    int divisor_ = 1;
    Reduce op_ = Reduce::sum;
    std::vector<int> members_;  // the axis's world ranks (empty: the whole group)
    std::vector<Part> parts_;   // a std::vector reallocates: add() hands out a pointer used before the next add()
  };

  explicit Mpi(detail::MpiGroup* group = nullptr, torch::Device device = torch::kCPU)
      : Mpi(MeshAxis::world(group), device) {}
  /// On the members of `axis` (which must outlive the backend's work). Collective over them where there are several:
  /// the collective thread's communicator is duplicated from the axis's.
  explicit Mpi(const MeshAxis& axis, torch::Device device = torch::kCPU) : axis_(axis) {
    (void)device;
    if (axis_.size() > 1) thread_ = std::make_shared<detail::CollectiveThread>(*axis_.group(), axis_.comm());
  }

  int rank() const { return axis_.rank(); }
  int size() const { return axis_.size(); }
  const MeshAxis& axis() const { return axis_; }

  /// Starts an all-reduce of `t` in place.
  Work iall_reduce_(const torch::Tensor& t, Reduce op) {
    check_mean(t, op);
    if (size() == 1) return Work();
    torch::Tensor buffer = detail::mpi_buffer(t);
    Work work(axis_, op);
    work.add(*thread_, detail::Collective::all_reduce, t, buffer, axis_.route(), [buffer, op](MPI_Comm c) {
      return MPI_Allreduce(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(buffer.numel()),
                           detail::mpi_type(buffer.scalar_type()), detail::mpi_op(op), c);
    });
    return work;
  }
  /// All-reduces `t` in place (sum, mean, max or min across ranks).
  void all_reduce_(const torch::Tensor& t, Reduce op) { iall_reduce_(t, op).wait(); }

  /// Starts the sends and receives of `ops` together; `wait()` finishes them all. A receive's tensor must have the
  /// shape and type of the matching send's; the bytes are copied as they are. Sends to one peer arrive in the order
  /// issued (MPI's non-overtaking rule), as do receives from one peer.
  Work ibatch_(const std::vector<P2P>& ops) {
    for (const P2P& op : ops) check_peer(op);
    if (size() == 1) return alone(ops);
    Work work(axis_, Reduce::sum);
    for (const P2P& op : ops) {
      const bool contiguous_cpu = op.tensor.is_cpu() && op.tensor.is_contiguous();
      const bool send = op.kind == P2P::send;
      torch::Tensor buffer = contiguous_cpu ? op.tensor
                             : send         ? op.tensor.to(torch::kCPU).contiguous()
                                            : torch::empty(op.tensor.sizes(), op.tensor.options().device(torch::kCPU));
      MPI_Request* request = work.add(send ? detail::Collective::send : detail::Collective::recv,
                                      send ? torch::Tensor() : op.tensor, buffer, axis_.route(op.peer));
      const int bytes = static_cast<int>(buffer.nbytes());
      detail::mpi_check(send ? MPI_Isend(buffer.data_ptr(), bytes, MPI_BYTE, op.peer, kP2PTag, axis_.comm(), request)
                             : MPI_Irecv(buffer.data_ptr(), bytes, MPI_BYTE, op.peer, kP2PTag, axis_.comm(), request),
                        send ? "MPI_Isend" : "MPI_Irecv");
    }
    return work;
  }
  /// Starts sending `t` to rank `peer` (of the axis), or receiving it from there.
  Work isend_(const torch::Tensor& t, int peer) { return ibatch_({{P2P::send, t, peer}}); }
  Work irecv_(const torch::Tensor& t, int peer) { return ibatch_({{P2P::recv, t, peer}}); }

  /// Copies rank `root`'s `t` into every rank's `t`.
  void broadcast_(const torch::Tensor& t, int root = 0) {
    if (size() == 1) return;
    torch::Tensor buffer = detail::mpi_buffer(t);
    Work work(axis_, Reduce::sum);
    work.add(*thread_, detail::Collective::broadcast, t, buffer, axis_.route(), [buffer, root](MPI_Comm c) {
      return MPI_Bcast(buffer.data_ptr(), static_cast<int>(buffer.numel()), detail::mpi_type(buffer.scalar_type()),
                       root, c);
    });
    work.wait();
  }

  /// Every rank's `t`, stacked: shape [size(), t.sizes()...]. Every rank must give the same shape.
  torch::Tensor all_gather(const torch::Tensor& t) {
    if (size() == 1) return t.unsqueeze(0).clone();
    torch::Tensor buffer = detail::mpi_buffer(t);
    std::vector<int64_t> shape{static_cast<int64_t>(size())};
    for (int64_t s : t.sizes()) shape.push_back(s);
    torch::Tensor out = torch::empty(shape, buffer.options());
    Work work(axis_, Reduce::sum);
    work.add(*thread_, detail::Collective::all_gather, {}, out, axis_.route(), [buffer, out](MPI_Comm c) {
      const MPI_Datatype type = detail::mpi_type(buffer.scalar_type());
      return MPI_Allgather(buffer.data_ptr(), static_cast<int>(buffer.numel()), type, out.data_ptr(),
                           static_cast<int>(buffer.numel()), type, c);
    });
    work.wait();
    return out.to(t.options());
  }

  /// Starts a reduce-scatter of the flat tensor `flat` (1-D, size() equal blocks): once `wait()` returns, this rank's
  /// block (`detail::block_of(flat, rank(), size())`) holds the reduction of every rank's block; the others are
  /// left unspecified. One all-reduce's worth of bytes in two halves, with iall_gather_.
  Work ireduce_scatter_(const torch::Tensor& flat, Reduce op) {
    check_mean(flat, op);
    const int64_t n = detail::block_numel(flat, size(), "reduce-scatter", kMaxBlock);
    if (size() == 1) return Work();
    torch::Tensor input = detail::mpi_buffer(flat);
    torch::Tensor block = block_buffer(n, input.options());
    Work work(axis_, op);
    work.add(*thread_, detail::Collective::reduce_scatter, detail::block_of(flat, rank(), size()), block, axis_.route(),
             [input, block, n, op](MPI_Comm c) {
               return MPI_Reduce_scatter_block(input.data_ptr(), block.data_ptr(), static_cast<int>(n),
                                               detail::mpi_type(input.scalar_type()), detail::mpi_op(op), c);
             });
    return work;
  }
  void reduce_scatter_(const torch::Tensor& flat, Reduce op) { ireduce_scatter_(flat, op).wait(); }

  /// Starts an all-gather of the flat tensor `flat` in place (1-D, size() equal blocks): each rank gives its own
  /// block; once `wait()` returns, every block holds its rank's. The bytes are copied as they are (float16 and
  /// bfloat16 too).
  Work iall_gather_(const torch::Tensor& flat) {
    const int64_t n = detail::block_numel(flat, size(), "all-gather", kMaxBlock);
    if (size() == 1) return Work();
    torch::Tensor buffer = flat.is_cpu() && flat.is_contiguous() ? flat : flat.to(torch::kCPU).contiguous();
    Work work(axis_, Reduce::sum);
    const int bytes = static_cast<int>(n * buffer.element_size());
    work.add(*thread_, detail::Collective::all_gather, flat, buffer, axis_.route(), [buffer, bytes](MPI_Comm c) {
      return MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer.data_ptr(), bytes, MPI_BYTE, c);
    });
    return work;
  }
  void all_gather_(const torch::Tensor& flat) { iall_gather_(flat).wait(); }

  void barrier() {
    if (size() == 1) return;
    Work work(axis_, Reduce::sum);
    work.add(*thread_, detail::Collective::barrier, {}, torch::empty({0}), axis_.route(),
             [](MPI_Comm c) { return MPI_Barrier(c); });
    work.wait();
  }

 private:
  /// The largest block MPI's int counts reach (all-gather counts bytes: 8 per element at most).
  static constexpr int64_t kMaxBlock = std::numeric_limits<int>::max() / 8;
  static void check_mean(const torch::Tensor& t, Reduce op) {
    if (op == Reduce::mean && !t.is_floating_point()) {
      throw std::invalid_argument(std::string("volt: a mean all-reduce needs a floating-point tensor, got ") +
                                  c10::toString(t.scalar_type()) + "; use Reduce::sum, or convert it first.");
    }
  }

  /// A block-sized buffer for a reduce-scatter's result, reused once nothing else holds it: fresh pages for every call
  /// cost as much as the transfer (64 MiB across 2 hosts: 0.72x of Open MPI's blocking reduce-scatter with a fresh
  /// buffer per call or in place, 1.01x reused).
  torch::Tensor block_buffer(int64_t n, const torch::TensorOptions& options) {
    for (const torch::Tensor& b : blocks_) {
      if (b.use_count() == 1 && b.numel() == n && b.dtype() == options.dtype()) return b;
    }
    torch::Tensor b = torch::empty({n}, options);
    if (blocks_.size() == kKeptBlocks) blocks_.erase(blocks_.begin());
    blocks_.push_back(b);
    return b;
  }
  static constexpr std::size_t kKeptBlocks = 4;

  /// A send or receive's peer is a rank of the axis, and its bytes fit MPI's int count.
  void check_peer(const P2P& op) const {
    if (op.peer < 0 || op.peer >= size() || (size() == 1 && op.peer != rank())) {
      throw std::invalid_argument(std::string("volt: a ") + (op.kind == P2P::send ? "send to" : "receive from") +
                                  " rank " + std::to_string(op.peer) + " on axis " + axis_.name() + ", whose ranks are 0.." +
                                  std::to_string(size() - 1) + ".");
    }
    if (op.tensor.nbytes() > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
      throw std::invalid_argument("volt: a send or receive of " + std::to_string(op.tensor.nbytes()) +
                                  " bytes is more than one MPI message holds (2 GiB); split the tensor.");
    }
  }
  /// A world of one: each receive takes the next send's tensor (both to and from this rank).
  static Work alone(const std::vector<P2P>& ops) {
    std::size_t next = 0;
    for (const P2P& op : ops) {
      if (op.kind != P2P::recv) continue;
      while (next < ops.size() && ops[next].kind != P2P::send) ++next;
      if (next == ops.size()) throw std::invalid_argument("volt: a receive from this rank with no send to it in the batch.");
      op.tensor.copy_(ops[next++].tensor);
    }
    return Work();
  }
  static constexpr int kP2PTag = 31020;

  MeshAxis axis_;
  std::shared_ptr<detail::CollectiveThread> thread_;  // where there are several members; shared by copies
  std::vector<torch::Tensor> blocks_;                 // reduce-scatter results, reused (block_buffer)
};

static_assert(CollectiveBackend<Mpi>);

}  // namespace volt
