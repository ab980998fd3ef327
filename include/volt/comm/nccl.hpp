#pragma once
/// \file
/// `volt::Nccl`: collectives on CUDA tensors with NCCL, on the tensors' current CUDA stream. The
/// communicator's unique id is made by rank 0 and broadcast over the MPI group. Available when compiled
/// with VOLT_WITH_NCCL=1 (link the `volt::nccl` CMake target); otherwise only declared, and the compile-time
/// rules say what to do.

#include "volt/comm/concept.hpp"

#if VOLT_WITH_NCCL
#include "volt/comm/mesh.hpp"
#include "volt/comm/runtime.hpp"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/types.h>

#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace volt {

namespace detail {
/// The collective timeout for NCCL, as PyTorch's NCCL watchdog: each collective records a CUDA event after it on its
/// stream; the group's heartbeat thread (watchdog.hpp) polls the events in order, marks them complete in the flight
/// recorder, and when the oldest has been in flight for longer than the timeout aborts the communicator
/// (`ncclCommAbort`, which ends the kernels still waiting for peers) and reports it; the rank's next host wait ends
/// the job with that message.
class NcclWatch {
 public:
  NcclWatch(ncclComm_t comm, MpiGroup& group) : comm_(comm), group_(&group) {}
  /// After a collective was queued on `stream` (its number `seq`).
  void queued(uint64_t seq, cudaStream_t stream) {
    cudaEvent_t event = nullptr;
    if (cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) return;
    cudaEventRecord(event, stream);
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back({seq, event, Clock::now()});
  }
  /// On the heartbeat thread: "" while every collective completes in time.
  std::string poll() {
    std::lock_guard<std::mutex> lock(mutex_);
    while (comm_ != nullptr && !pending_.empty()) {
      const InFlight oldest = pending_.front();
      const cudaError_t state = cudaEventQuery(oldest.event);
      if (state == cudaSuccess) {
        group_->recorder().complete(oldest.seq);
        cudaEventDestroy(oldest.event);
        pending_.pop_front();
        continue;
      }
      if (state == cudaErrorNotReady && Clock::now() - oldest.issued < group_->timeout()) return "";
      ncclCommAbort(comm_);
      comm_ = nullptr;
      aborted_ = true;
      const FlightEntry e = group_->recorder().entry(oldest.seq);
      return "volt: rank " + std::to_string(group_->rank()) + " on " + host_name() + ": NCCL " +
             (e.seq != 0 ? describe(e) : "collective #" + std::to_string(oldest.seq)) +
             (state == cudaErrorNotReady ? " did not complete on the GPU within the collective timeout "
                                           "(TrainerOptions::timeout, " + seconds_text(group_->timeout()) + ")"
                                         : std::string(" failed: ") + cudaGetErrorString(state)) +
             "; its communicator was aborted. Rank " + std::to_string(group_->rank()) + "'s last collectives: " +
             group_->recorder().recent(6) + ".";
    }
    return "";
  }
  /// The backend is going: nothing more to watch. Returns whether the watch aborted the communicator already.
  bool close() {
    std::lock_guard<std::mutex> lock(mutex_);
    comm_ = nullptr;
    for (const InFlight& f : pending_) cudaEventDestroy(f.event);
    pending_.clear();
    return aborted_;
  }

 private:
  struct InFlight {
    uint64_t seq;
    cudaEvent_t event;
    Clock::time_point issued;
  };
  std::mutex mutex_;
  ncclComm_t comm_;
  MpiGroup* group_;
  std::deque<InFlight> pending_;
  bool aborted_ = false;
};

inline void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("volt: ") + what + " failed: " + ncclGetErrorString(r));
}
inline ncclDataType_t nccl_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return ncclFloat32;
    case c10::ScalarType::Double: return ncclFloat64;
    case c10::ScalarType::Half: return ncclFloat16;
    case c10::ScalarType::BFloat16: return ncclBfloat16;
    case c10::ScalarType::Long: return ncclInt64;
    case c10::ScalarType::Int: return ncclInt32;
    case c10::ScalarType::Char: return ncclInt8;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool: return ncclUint8;
    default:
      throw std::invalid_argument(std::string("volt: Nccl cannot reduce tensors of type ") + c10::toString(t) + ".");
  }
}
inline ncclRedOp_t nccl_op(Reduce op) {
  switch (op) {
    case Reduce::sum: return ncclSum;
    case Reduce::mean: return ncclAvg;
    case Reduce::max: return ncclMax;
    case Reduce::min: return ncclMin;
  }
  return ncclSum;
}
}  // namespace detail

class Nccl {
 public:
  static constexpr const char* name = "Nccl";
  static constexpr bool supports_cpu = false;
  static constexpr bool supports_cuda = true;

  /// NCCL work is ordered on the stream it was queued on; later kernels on that stream see the result.
  struct Work {
    void wait() {}
  };

  /// A communicator of all of `group`'s members (null: a world of one) on `device`.
  Nccl(detail::MpiGroup* group, torch::Device device) : Nccl(MeshAxis::world(group), device) {}
  /// A communicator of `axis`'s members (which must outlive it), made from a unique id that the axis's first member
  /// sends the others over MPI.
  Nccl(const MeshAxis& axis, torch::Device device) : axis_(axis), group_(axis.group()), device_(device) {
    check_device(device);
    ncclUniqueId id;
    if (axis_.rank() == 0) detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    if (group_ != nullptr) {
      MPI_Request request;
      detail::mpi_check(MPI_Ibcast(&id, sizeof id, MPI_BYTE, 0, axis_.comm(), &request), "MPI_Ibcast");
      group_->wait(request);
    }
    c10::cuda::CUDAGuard guard(device);
    detail::nccl_check(ncclCommInitRank(&comm_, axis_.size(), id, axis_.rank()), "ncclCommInitRank");
    watch();
  }
  /// `axis`'s members' communicator split from `parent`'s (`ncclCommSplit`, the colour and key the mesh split its MPI
  /// communicator with; `parent` must hold every member of the axis, as a mesh's world does).
  Nccl(Nccl& parent, const MeshAxis& axis) : axis_(axis), group_(axis.group()), device_(parent.device_) {
    if (axis.group() != parent.group_ || parent.size() < axis.size()) {
      throw std::invalid_argument(std::string("volt: axis ") + axis.name() + " is not a split of this communicator's " +
                                  "members; split the communicator of the mesh's world.");
    }
    c10::cuda::CUDAGuard guard(device_);
    detail::nccl_check(ncclCommSplit(parent.comm_, axis.color(), axis.rank(), &comm_, nullptr), "ncclCommSplit");
    watch();
  }
  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;
  ~Nccl() {
    if (comm_ == nullptr) return;
    if (watch_ != nullptr && watch_->close()) return;  // the watch aborted it
    if (group_ != nullptr && group_->failed()) {
      ncclCommAbort(comm_);
    } else {
      ncclCommDestroy(comm_);
    }
  }

  int rank() const { return axis_.rank(); }
  int size() const { return axis_.size(); }
  const MeshAxis& axis() const { return axis_; }

  Work iall_reduce_(const torch::Tensor& t, Reduce op) {
    with_contiguous(t, [&](const torch::Tensor& c) {
      issue(detail::Collective::all_reduce, c, [&] {
        return ncclAllReduce(c.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()),
                             detail::nccl_type(c.scalar_type()), detail::nccl_op(op), comm_, stream(c));
      });
    });
    return {};
  }
  void all_reduce_(const torch::Tensor& t, Reduce op) { iall_reduce_(t, op); }

  void broadcast_(const torch::Tensor& t, int root = 0) {
    with_contiguous(t, [&](const torch::Tensor& c) {
      issue(detail::Collective::broadcast, c, [&] {
        return ncclBroadcast(c.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()),
                             detail::nccl_type(c.scalar_type()), root, comm_, stream(c));
      });
    });
  }

  torch::Tensor all_gather(const torch::Tensor& t) {
    check(t);
    const torch::Tensor c = t.contiguous();
    std::vector<int64_t> shape{static_cast<int64_t>(size())};
    for (int64_t s : t.sizes()) shape.push_back(s);
    torch::Tensor out = torch::empty(shape, c.options());
    issue(detail::Collective::all_gather, c, [&] {
      return ncclAllGather(c.data_ptr(), out.data_ptr(), static_cast<size_t>(c.numel()),
                           detail::nccl_type(c.scalar_type()), comm_, stream(c));
    });
    return out;
  }

  /// In-place reduce-scatter of `flat` (size() equal blocks): this rank's block receives the reduction
  /// (`ncclReduceScatter` with the receive buffer inside the send buffer, as NCCL allows).
  Work ireduce_scatter_(const torch::Tensor& flat, Reduce op) {
    check(flat);
    const int64_t n = detail::block_numel(flat, size(), "reduce-scatter");
    char* base = static_cast<char*>(flat.data_ptr());
    issue(detail::Collective::reduce_scatter, flat, [&] {
      return ncclReduceScatter(base, base + rank() * n * flat.element_size(), static_cast<size_t>(n),
                               detail::nccl_type(flat.scalar_type()), detail::nccl_op(op), comm_, stream(flat));
    });
    return {};
  }
  void reduce_scatter_(const torch::Tensor& flat, Reduce op) { ireduce_scatter_(flat, op); }

  /// In-place all-gather of `flat` (size() equal blocks): each rank gives its own block (`ncclAllGather` with the
  /// send buffer inside the receive buffer).
  Work iall_gather_(const torch::Tensor& flat) {
    check(flat);
    const int64_t n = detail::block_numel(flat, size(), "all-gather");
    char* base = static_cast<char*>(flat.data_ptr());
    issue(detail::Collective::all_gather, flat, [&] {
      return ncclAllGather(base + rank() * n * flat.element_size(), base, static_cast<size_t>(n),
                           detail::nccl_type(flat.scalar_type()), comm_, stream(flat));
    });
    return {};
  }
  void all_gather_(const torch::Tensor& flat) { iall_gather_(flat); }

  /// Queues the sends and receives of `ops` as one NCCL group on the current stream of the first tensor's device (so two
  /// ranks may send to each other in one batch); the bytes are copied as they are.
  Work ibatch_(const std::vector<P2P>& ops) {
    if (ops.empty()) return {};
    for (const P2P& op : ops) {
      check(op.tensor);
      if (!op.tensor.is_contiguous() || op.peer < 0 || op.peer >= size()) {
        throw std::invalid_argument(std::string("volt: Nccl sends and receives contiguous tensors to ranks 0..") +
                                    std::to_string(size() - 1) + " of axis " + axis_.name() + "; got rank " +
                                    std::to_string(op.peer) + (op.tensor.is_contiguous() ? "" : ", not contiguous") + ".");
      }
    }
    const cudaStream_t s = stream(ops.front().tensor);
    std::vector<uint64_t> seqs;
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (const P2P& op : ops) {
      const bool send = op.kind == P2P::send;
      if (group_ != nullptr) {
        seqs.push_back(group_->record(send ? detail::Collective::send : detail::Collective::recv,
                                      static_cast<int64_t>(op.tensor.nbytes()), axis_.route(op.peer)));
      }
      const auto count = static_cast<size_t>(op.tensor.nbytes());
      const ncclResult_t r = send ? ncclSend(op.tensor.data_ptr(), count, ncclUint8, op.peer, comm_, s)
                                  : ncclRecv(op.tensor.data_ptr(), count, ncclUint8, op.peer, comm_, s);
      if (r != ncclSuccess) {
        ncclGroupEnd();
        detail::nccl_check(r, send ? "ncclSend" : "ncclRecv");
      }
    }
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    if (watch_ != nullptr) {
      for (uint64_t seq : seqs) watch_->queued(seq, s);
    }
    return {};
  }
  Work isend_(const torch::Tensor& t, int peer) { return ibatch_({{P2P::send, t, peer}}); }
  Work irecv_(const torch::Tensor& t, int peer) { return ibatch_({{P2P::recv, t, peer}}); }

  void barrier() {
    torch::Tensor one = torch::ones({1}, torch::TensorOptions().device(device_));
    all_reduce_(one, Reduce::sum);
    c10::cuda::getCurrentCUDAStream(device_.index()).synchronize();
  }

 private:
  static void check_device(torch::Device device) {
    if (!device.is_cuda()) {
      throw std::invalid_argument("volt: Nccl needs a CUDA device, got " + device.str() + "; use volt::Mpi on CPU.");
    }
  }
  /// Has the group's heartbeat watch this communicator's work.
  void watch() {
    if (group_ == nullptr) return;
    watch_ = std::make_shared<detail::NcclWatch>(comm_, *group_);
    group_->add_watcher([watch = watch_] { return watch->poll(); });
  }
  void check(const torch::Tensor& t) const {
    if (!t.is_cuda()) {
      throw std::invalid_argument("volt: Nccl reduces CUDA tensors, got one on " + t.device().str() + ".");
    }
  }
  static cudaStream_t stream(const torch::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
  /// Queues one NCCL collective on `t`'s stream (`call` returns its result), recorded in the group's flight recorder
  /// and watched until it completes.
  template <class F>
  void issue(detail::Collective kind, const torch::Tensor& t, F&& call) {
    const uint64_t seq = group_ != nullptr ? group_->record(kind, static_cast<int64_t>(t.nbytes()), axis_.route()) : 0;
    if (const ncclResult_t r = call(); r != ncclSuccess) failed(r, kind);
    if (watch_ != nullptr) watch_->queued(seq, stream(t));
  }
  [[noreturn, gnu::cold, gnu::noinline]] static void failed(ncclResult_t r, detail::Collective kind) {
    throw std::runtime_error(std::string("volt: NCCL ") + detail::to_string(kind) + " failed: " + ncclGetErrorString(r));
  }
  template <class F>
  void with_contiguous(const torch::Tensor& t, F&& f) {
    check(t);
    if (t.is_contiguous()) {
      f(t);
    } else {
      torch::Tensor c = t.contiguous();
      f(c);
      t.copy_(c);
    }
  }

  MeshAxis axis_;
  detail::MpiGroup* group_;
  torch::Device device_;
  ncclComm_t comm_ = nullptr;
  std::shared_ptr<detail::NcclWatch> watch_;
};

static_assert(CollectiveBackend<Nccl>);

}  // namespace volt
#endif  // VOLT_WITH_NCCL
