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

/// What the ranks along a mesh axis share (torchtitan's `dp_replicate`/`dp_shard`, `tp`, `pp`). `data`: each trains on
/// its own share of every batch; whether a part of the module is replicated or sharded along it is the model plan's
/// choice (volt/model_plan.hpp), so both of torchtitan's data roles are this one. `tensor` and `pipe`: they share each
/// batch (a layer's pieces, a pipeline's stages), so the loaders' split, `sync_dist` and every gradient's average run
/// over the data axes only (`Mesh::data()`, the data axes flattened).
enum class AxisRole { data, tensor, pipe };

inline const char* role_name(AxisRole r) {
  return r == AxisRole::data ? "data" : r == AxisRole::tensor ? "tensor" : "pipe";
}

/// The processes of a group on named axes. Made collectively (every member, the same axes); the communicators are
/// freed with the mesh.
class Mesh {
 public:
  struct Dim {
    std::string name;
    int size;  // -1 (for one axis): what the others leave of the group
    AxisRole role = AxisRole::data;
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
    for (std::size_t k = 0; k < dims_.size(); ++k) axes_.push_back(make_axis({k}, coord, rank, dims_[k].name));
    std::vector<std::size_t> data;
    for (std::size_t k = 0; k < dims_.size(); ++k) {
      if (dims_[k].role == AxisRole::data) data.push_back(k);
    }
    data_ = flatten(data, coord, rank, "data");
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
    for (auto& [axes, a] : flat_) {
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
  const std::vector<Dim>& dims() const { return dims_; }
  /// The role of the axis called `name` (throws as `axis` does).
  AxisRole role(std::string_view name) const { return dims_[index(name)].role; }
  /// The data axes flattened (torchtitan's `dp`): the ranks that share every coordinate but those of the data axes,
  /// ordered row-major along them; what loaders are split over and `sync_dist` reduces over. With no data axis, this
  /// rank alone.
  const MeshAxis& data() const { return data_; }
  /// The members of the data line through world rank 0 (every other coordinate 0), in their order along it: the ranks
  /// whose batches, together, are every batch once.
  std::vector<int> data_line_of_rank_zero() const {
    int world = 1;
    for (const Dim& d : dims_) world *= d.size;
    std::vector<int> out;
    for (int w = 0; w < world; ++w) {
      bool on_line = true;
      for (std::size_t k = dims_.size(), rest = static_cast<std::size_t>(w); k-- > 0;) {
        const auto coord = static_cast<int>(rest % static_cast<std::size_t>(dims_[k].size));
        rest /= static_cast<std::size_t>(dims_[k].size);
        if (dims_[k].role != AxisRole::data && coord != 0) on_line = false;
      }
      if (on_line) out.push_back(w);
    }
    return out;
  }
  /// The data axes but `along` flattened (`along`: one of them): where a part sharded along `along` is replicated
  /// (hybrid sharding averages its blocks across it); null where the mesh has no other data axis.
  const MeshAxis* data_except(std::string_view along) const {
    const std::size_t skip = index(along);
    std::vector<std::size_t> others;
    for (std::size_t k = 0; k < dims_.size(); ++k) {
      if (k != skip && dims_[k].role == AxisRole::data) others.push_back(k);
    }
    if (others.empty()) return nullptr;
    if (others.size() == 1) return &axes_[others.front()];
    const auto it = std::find_if(flat_.begin(), flat_.end(), [&](const auto& f) { return f.first == others; });
    if (it == flat_.end()) throw std::logic_error("volt: a mesh's flattened data axes are made with it.");
    return &it->second;
  }
  /// "data=2 x tensor=2 (tensor)": each axis's size, and its role where it is not data.
  std::string shape() const {
    std::string s;
    for (const Dim& d : dims_) {
      s += (s.empty() ? "" : " x ") + d.name + "=" + std::to_string(d.size) +
           (d.role == AxisRole::data ? "" : std::string(" (") + role_name(d.role) + ")");
    }
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

  std::size_t index(std::string_view name) const {
    for (std::size_t k = 0; k < dims_.size(); ++k) {
      if (name == dims_[k].name) return k;
    }
    throw std::invalid_argument("volt: the mesh has no axis \"" + std::string(name) + "\"; its axes: " + shape() + ".");
  }

  /// Axes `ks` (in the mesh's order) flattened into one, as rank `rank` (at `coord`) sees it: the members that share
  /// every other coordinate, ordered row-major along `ks`, and the split communicator. Every rank makes the same ones.
  MeshAxis make_axis(const std::vector<std::size_t>& ks, const std::vector<int>& coord, int rank, const std::string& name) {
    MeshAxis a;
    a.group_ = group_;
    a.name_ = detail::intern(name);
    std::vector<int> stride(dims_.size(), 1);  // of each axis in world ranks
    for (std::size_t j = dims_.size() - 1; j-- > 0;) stride[j] = stride[j + 1] * dims_[j + 1].size;
    int first = rank, size = 1;
    for (const std::size_t k : ks) {
      a.rank_ = a.rank_ * dims_[k].size + coord[k];
      first -= coord[k] * stride[k];
      size *= dims_[k].size;
    }
    a.members_.clear();
    for (int i = 0; i < size; ++i) {  // the i-th member: i's digits along ks, row-major
      int world = first;
      for (std::size_t n = ks.size(), rest = static_cast<std::size_t>(i); n-- > 0;) {
        world += static_cast<int>(rest % static_cast<std::size_t>(dims_[ks[n]].size)) * stride[ks[n]];
        rest /= static_cast<std::size_t>(dims_[ks[n]].size);
      }
      a.members_.push_back(world);
    }
    for (std::size_t j = 0; j < dims_.size(); ++j) {  // the line's index: the other coordinates, row-major
      if (std::find(ks.begin(), ks.end(), j) == ks.end()) a.color_ = a.color_ * dims_[j].size + coord[j];
    }
    if (group_ == nullptr) return a;
    MPI_Request request;  // every member there before the split, which is not watched (MPI has no MPI_Comm_isplit)
    detail::mpi_check(MPI_Ibarrier(group_->comm(), &request), "MPI_Ibarrier");
    group_->wait(request);
    detail::mpi_check(MPI_Comm_split(group_->comm(), a.color_, a.rank_, &a.comm_), "MPI_Comm_split");
    MPI_Comm_set_errhandler(a.comm_, MPI_ERRORS_RETURN);
    return a;
  }

  /// The data axes `ks` flattened as `data()` is, and every set of all of them but one (`data_except`); one axis is
  /// itself, none is this rank alone.
  MeshAxis flatten(const std::vector<std::size_t>& ks, const std::vector<int>& coord, int rank, const std::string& name) {
    for (std::size_t skip = 0; ks.size() > 2 && skip < ks.size(); ++skip) {
      std::vector<std::size_t> others = ks;
      others.erase(others.begin() + static_cast<std::ptrdiff_t>(skip));
      flat_.emplace_back(others, make_axis(others, coord, rank, joined(others)));
    }
    if (ks.size() == 1) return axes_[ks.front()];
    flat_.emplace_back(ks, make_axis(ks, coord, rank, name));
    return flat_.back().second;
  }
  std::string joined(const std::vector<std::size_t>& ks) const {
    std::string s;
    for (const std::size_t k : ks) s += (s.empty() ? "" : "*") + dims_[k].name;
    return s;
  }

  detail::MpiGroup* group_;
  std::vector<Dim> dims_;
  std::vector<MeshAxis> axes_;
  std::vector<std::pair<std::vector<std::size_t>, MeshAxis>> flat_;  // flattened axes, by the axes they join (own comms)
  MeshAxis data_;  // a copy: of an axis of `axes_` or of `flat_` (it does not free its communicator)
};

}  // namespace volt
