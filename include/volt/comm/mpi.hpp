#pragma once
/// \file
/// `volt::Mpi`: collectives on tensors over Open MPI. CPU tensors are reduced in place; CUDA tensors (when
/// a GPU run chooses Mpi over Nccl) are staged through host memory; float16/bfloat16 are reduced in
/// float32 (MPI has no type for them). Every wait watches the group's failure channel (see runtime.hpp).

#include "volt/comm/concept.hpp"
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

/// Collectives over an MPI process group. A null group is a world of one (every collective is an identity).
class Mpi {
 public:
  static constexpr const char* name = "Mpi";
  static constexpr bool supports_cpu = true;
  static constexpr bool supports_cuda = true;  // staged through host memory

  /// A collective in flight; `wait()` finishes it: the result, in `buffer`, is divided by the world size for a mean
  /// and copied into `target` where the two differ (a staged or converted copy, or reduce-scatter's block).
  /// `input` is kept alive for MPI to read until then.
  class Work {
   public:
    Work() = default;
    /// Records the collective (`kind`, the bytes of `buffer`) in the group's flight recorder.
    Work(detail::MpiGroup* group, detail::Collective kind, torch::Tensor target, torch::Tensor buffer, Reduce op,
         torch::Tensor input = {})
        : group_(group), target_(std::move(target)), buffer_(std::move(buffer)), input_(std::move(input)), op_(op),
          seq_(group->record(kind, static_cast<int64_t>(buffer_.nbytes()))) {}
    MPI_Request* request() { return &request_; }
    void wait() {
      if (group_ == nullptr) return;
      group_->wait(request_, seq_);
      if (op_ == Reduce::mean) buffer_.div_(group_->size());
      if (buffer_.unsafeGetTensorImpl() != target_.unsafeGetTensorImpl()) target_.copy_(buffer_.view_as(target_));
      group_ = nullptr;
      target_ = buffer_ = input_ = torch::Tensor();  // nothing of the buckets kept alive after the wait
    }

   private:
    detail::MpiGroup* group_ = nullptr;
    torch::Tensor target_, buffer_, input_;
    Reduce op_ = Reduce::sum;
    uint64_t seq_ = 0;
    MPI_Request request_ = MPI_REQUEST_NULL;
  };

  explicit Mpi(detail::MpiGroup* group = nullptr, torch::Device device = torch::kCPU) : group_(group) { (void)device; }

  int rank() const { return group_ ? group_->rank() : 0; }
  int size() const { return group_ ? group_->size() : 1; }

  /// Starts an all-reduce of `t` in place.
  Work iall_reduce_(const torch::Tensor& t, Reduce op) {
    check_mean(t, op);
    if (group_ == nullptr) return Work();
    torch::Tensor buffer = detail::mpi_buffer(t);
    Work work(group_, detail::Collective::all_reduce, t, buffer, op);
    detail::mpi_check(MPI_Iallreduce(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(buffer.numel()),
                                     detail::mpi_type(buffer.scalar_type()), detail::mpi_op(op), group_->comm(),
                                     work.request()),
                      "MPI_Iallreduce");
    return work;
  }
  /// All-reduces `t` in place (sum, mean, max or min across ranks).
  void all_reduce_(const torch::Tensor& t, Reduce op) { iall_reduce_(t, op).wait(); }

  /// Copies rank `root`'s `t` into every rank's `t`.
  void broadcast_(const torch::Tensor& t, int root = 0) {
    if (group_ == nullptr) return;
    torch::Tensor buffer = detail::mpi_buffer(t);
    MPI_Request request;
    const uint64_t seq = group_->record(detail::Collective::broadcast, static_cast<int64_t>(buffer.nbytes()));
    detail::mpi_check(MPI_Ibcast(buffer.data_ptr(), static_cast<int>(buffer.numel()),
                                 detail::mpi_type(buffer.scalar_type()), root, group_->comm(), &request),
                      "MPI_Ibcast");
    group_->wait(request, seq);
    if (buffer.unsafeGetTensorImpl() != t.unsafeGetTensorImpl()) t.copy_(buffer.view_as(t));
  }

  /// Every rank's `t`, stacked: shape [world_size, t.sizes()...]. Every rank must give the same shape.
  torch::Tensor all_gather(const torch::Tensor& t) {
    if (group_ == nullptr) return t.unsqueeze(0).clone();
    torch::Tensor buffer = detail::mpi_buffer(t);
    std::vector<int64_t> shape{static_cast<int64_t>(size())};
    for (int64_t s : t.sizes()) shape.push_back(s);
    torch::Tensor out = torch::empty(shape, buffer.options());
    MPI_Request request;
    const MPI_Datatype type = detail::mpi_type(buffer.scalar_type());
    const uint64_t seq = group_->record(detail::Collective::all_gather, static_cast<int64_t>(buffer.nbytes()));
    detail::mpi_check(MPI_Iallgather(buffer.data_ptr(), static_cast<int>(buffer.numel()), type, out.data_ptr(),
                                     static_cast<int>(buffer.numel()), type, group_->comm(), &request),
                      "MPI_Iallgather");
    group_->wait(request, seq);
    return out.to(t.options());
  }

  /// Starts a reduce-scatter of the flat tensor `flat` (1-D, size() equal blocks): once `wait()` returns, this rank's
  /// block (`detail::block_of(flat, rank(), size())`) holds the reduction of every rank's block; the others are
  /// left unspecified. One all-reduce's worth of bytes in two halves, with iall_gather_.
  Work ireduce_scatter_(const torch::Tensor& flat, Reduce op) {
    check_mean(flat, op);
    const int64_t n = detail::block_numel(flat, size(), "reduce-scatter", kMaxBlock);
    if (group_ == nullptr) return Work();
    torch::Tensor input = detail::mpi_buffer(flat);
    torch::Tensor block = torch::empty({n}, input.options());
    Work work(group_, detail::Collective::reduce_scatter, detail::block_of(flat, rank(), size()), block, op, input);
    detail::mpi_check(MPI_Ireduce_scatter_block(input.data_ptr(), block.data_ptr(), static_cast<int>(n),
                                                detail::mpi_type(input.scalar_type()), detail::mpi_op(op),
                                                group_->comm(), work.request()),
                      "MPI_Ireduce_scatter_block");
    return work;
  }
  void reduce_scatter_(const torch::Tensor& flat, Reduce op) { ireduce_scatter_(flat, op).wait(); }

  /// Starts an all-gather of the flat tensor `flat` in place (1-D, size() equal blocks): each rank gives its own
  /// block; once `wait()` returns, every block holds its rank's. The bytes are copied as they are (float16 and
  /// bfloat16 too).
  Work iall_gather_(const torch::Tensor& flat) {
    const int64_t n = detail::block_numel(flat, size(), "all-gather", kMaxBlock);
    if (group_ == nullptr) return Work();
    torch::Tensor buffer = flat.is_cpu() && flat.is_contiguous() ? flat : flat.to(torch::kCPU).contiguous();
    Work work(group_, detail::Collective::all_gather, flat, buffer, Reduce::sum);
    const int bytes = static_cast<int>(n * buffer.element_size());
    detail::mpi_check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer.data_ptr(), bytes, MPI_BYTE,
                                     group_->comm(), work.request()),
                      "MPI_Iallgather");
    return work;
  }
  void all_gather_(const torch::Tensor& flat) { iall_gather_(flat).wait(); }

  void barrier() {
    if (group_ == nullptr) return;
    MPI_Request request;
    const uint64_t seq = group_->record(detail::Collective::barrier, 0);
    detail::mpi_check(MPI_Ibarrier(group_->comm(), &request), "MPI_Ibarrier");
    group_->wait(request, seq);
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

  detail::MpiGroup* group_;
};

static_assert(CollectiveBackend<Mpi>);

}  // namespace volt
