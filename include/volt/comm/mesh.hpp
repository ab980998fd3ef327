#pragma once
/// \file
/// `volt::Mesh`: the processes of a job laid out on named axes, as PyTorch's DeviceMesh lays them out (`data`, and
/// the `tensor` and `pipe` axes that tensor and pipeline parallelism run on), and `volt::MeshAxis`, the members of
/// one axis a rank belongs to. A backend made on an axis (`Mpi(axis)`, `Nccl(axis, device)`) runs its collectives,
/// sends and receives among those members only.
///
/// Layout: the axes are given outermost first and the world ranks fill the mesh in row-major order, so a 2x2 mesh
/// `{{"data", 2}, {"tensor", 2}}` puts ranks 0 and 1 (then 2 and 3) on one `tensor` line and ranks 0 and 2 (then 1
/// and 3) on one `data` line: the innermost axis joins neighbouring ranks, which share a host where the launcher
/// packs ranks by host, as tensor parallelism wants.
///
/// Each axis is a communicator split from the group's (`MPI_Comm_split`, colour: the index of the rank's line, key:
/// its coordinate along the axis; `Nccl` splits its communicator the same way). Waits on an axis are the group's
/// waits (runtime.hpp): a failing, dead or silent member anywhere in the job, or the collective timeout, ends every
/// rank with one message, and every collective, send and receive is in the group's flight recorder with its axis.

#include "volt/comm/runtime.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace volt {

/// The members of one mesh axis that this rank belongs to: its line through the mesh along the axis. A view: the
/// communicator belongs to the Mesh (or, for `world`, to the group), which must outlive it.
class MeshAxis {
 public:
  /// A world of one (no group): every collective is an identity.
  MeshAxis() = default;

  /// All of `group`'s members, in rank order, on the group's own communicator (null group: a world of one).
  static MeshAxis world(detail::MpiGroup* group) {
    MeshAxis a;
    if (group == nullptr) return a;
    a.group_ = group;
    a.comm_ = group->comm();
    a.rank_ = group->rank();
    a.members_.clear();
    for (int r = 0; r < group->size(); ++r) a.members_.push_back(r);
    return a;
  }

  /// The axis name; "world" for all of a group's members.
  const char* name() const { return name_ == nullptr ? "world" : name_; }
  /// This rank's coordinate along the axis, and the number of members.
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(members_.size()); }
  /// The world ranks of the members, by their coordinate along the axis.
  const std::vector<int>& members() const { return members_; }
  /// The world rank of the member at coordinate `axis_rank`.
  int world_rank(int axis_rank) const {
    if (axis_rank < 0 || axis_rank >= size()) {
      throw std::out_of_range("volt: axis " + std::string(name()) + " has ranks 0.." + std::to_string(size() - 1) +
                              ", got " + std::to_string(axis_rank) + ".");
    }
    return members_[static_cast<std::size_t>(axis_rank)];
  }
  /// The index of this rank's line among the axis's lines (the colour of the split).
  int color() const { return color_; }
  detail::MpiGroup* group() const { return group_; }
  MPI_Comm comm() const { return comm_; }
  /// What the flight recorder notes of a collective on this axis (and of a send to or receive from `peer`, a rank on
  /// the axis): the axis name unless it is the whole group, and the peer's world rank.
  detail::Route route(int peer = -1) const { return {name_, peer < 0 ? -1 : world_rank(peer)}; }

 private:
  friend class Mesh;
  detail::MpiGroup* group_ = nullptr;
  MPI_Comm comm_ = MPI_COMM_NULL;
  const char* name_ = nullptr;  // interned; null: the whole group
  int rank_ = 0, color_ = 0;
  std::vector<int> members_{0};
};

/// The processes of a group on named axes. Made collectively (every member, the same axes); the communicators are
/// freed with the mesh.
class Mesh {
 public:
  struct Dim {
    std::string name;
    int size;  // -1 (for one axis): what the others leave of the group
  };

  /// Lays `group`'s members (null: a world of one) out on `dims`, outermost first.
  Mesh(detail::MpiGroup* group, std::vector<Dim> dims) : group_(group), dims_(std::move(dims)) {
    const int world = group ? group->size() : 1, rank = group ? group->rank() : 0;
    resolve_sizes(world);
    std::vector<int> coord(dims_.size());
    for (std::size_t k = dims_.size(), rest = static_cast<std::size_t>(rank); k-- > 0;) {
      coord[k] = static_cast<int>(rest % static_cast<std::size_t>(dims_[k].size));
      rest /= static_cast<std::size_t>(dims_[k].size);
    }
    for (std::size_t k = 0; k < dims_.size(); ++k) axes_.push_back(make_axis(k, coord, rank));
  }
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;
  ~Mesh() {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized || (group_ != nullptr && group_->failed())) return;  // a failed job never frees (peers may be dead)
    for (MeshAxis& a : axes_) {
      if (a.comm_ != MPI_COMM_NULL) MPI_Comm_free(&a.comm_);
    }
  }

  /// The axis called `name`; throws naming the mesh's axes.
  const MeshAxis& axis(std::string_view name) const {
    for (const MeshAxis& a : axes_) {
      if (name == a.name()) return a;
    }
    throw std::invalid_argument("volt: the mesh has no axis \"" + std::string(name) + "\"; its axes: " + shape() + ".");
  }
  const std::vector<MeshAxis>& axes() const { return axes_; }
  /// "data=2 x tensor=2".
  std::string shape() const {
    std::string s;
    for (const Dim& d : dims_) s += (s.empty() ? "" : " x ") + d.name + "=" + std::to_string(d.size);
    return s.empty() ? "no axes" : s;
  }

 private:
  /// Checks the axes and fills in a size of -1; throws saying what was given and what is allowed.
  void resolve_sizes(int world) {
    int known = 1, rest = -1;
    for (std::size_t k = 0; k < dims_.size(); ++k) {
      const Dim& d = dims_[k];
      const bool repeated = std::count_if(dims_.begin(), dims_.end(), [&](const Dim& e) { return e.name == d.name; }) > 1;
      if (d.name.empty() || d.name == "world" || repeated || (d.size < 1 && d.size != -1) || (d.size == -1 && rest >= 0)) {
        throw std::invalid_argument("volt: a mesh takes named axes (distinct names, not \"world\") of sizes >= 1, one "
                                    "of them -1 at most (what the others leave); got axis \"" + d.name + "\" of size " +
                                    std::to_string(d.size) + " in " + shape() + ".");
      }
      if (d.size == -1) rest = static_cast<int>(k);
      else known *= d.size;
    }
    if (rest >= 0 && known > 0 && world % known == 0) dims_[static_cast<std::size_t>(rest)].size = world / known;
    if (dims_.empty() || (rest < 0 && known != world) || (rest >= 0 && world % known != 0)) {
      throw std::invalid_argument("volt: a mesh of " + shape() + " does not fit a job of " + std::to_string(world) +
                                  " ranks: the axis sizes must multiply to " + std::to_string(world) + ".");
    }
  }

  /// Axis `k` as rank `rank` (at `coord`) sees it: its line's members, and the split communicator.
  MeshAxis make_axis(std::size_t k, const std::vector<int>& coord, int rank) {
    MeshAxis a;
    a.group_ = group_;
    a.name_ = detail::intern(dims_[k].name);
    a.rank_ = coord[k];
    std::size_t stride = 1;
    for (std::size_t j = k + 1; j < dims_.size(); ++j) stride *= static_cast<std::size_t>(dims_[j].size);
    a.members_.clear();
    const int first = rank - coord[k] * static_cast<int>(stride);
    for (int i = 0; i < dims_[k].size; ++i) a.members_.push_back(first + i * static_cast<int>(stride));
    for (std::size_t j = 0; j < dims_.size(); ++j) {  // the line's index: the other coordinates, row-major
      if (j != k) a.color_ = a.color_ * dims_[j].size + coord[j];
    }
    if (group_ == nullptr) return a;
    MPI_Request request;  // every member there before the split, which is not watched (MPI has no MPI_Comm_isplit)
    detail::mpi_check(MPI_Ibarrier(group_->comm(), &request), "MPI_Ibarrier");
    group_->wait(request);
    detail::mpi_check(MPI_Comm_split(group_->comm(), a.color_, a.rank_, &a.comm_), "MPI_Comm_split");
    MPI_Comm_set_errhandler(a.comm_, MPI_ERRORS_RETURN);
    return a;
  }

  detail::MpiGroup* group_;
  std::vector<Dim> dims_;
  std::vector<MeshAxis> axes_;
};

}  // namespace volt
