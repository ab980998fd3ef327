#pragma once
/// \file
/// `volt::PredictionWriter`: writes `predict`'s results to files as they are made, one file per rank, as Lightning's
/// `BasePredictionWriter`, for outputs too large to gather or to hold (pass `return_predictions = false` to
/// `predict` so that none are kept). Each result is saved with the data set indices of its batch's samples, so the
/// files of all ranks together give every sample's prediction once, whatever the number of ranks.
///
/// | `write_interval` | files (under `dirpath`, default `<default_root_dir>/predictions`) | contents |
/// |---|---|---|
/// | `epoch` (default) | `predictions_rank<r>.pt`, at the end of the pass | `predictions` (list, in this rank's order), `batch_indices` (list of int64 tensors), `rank`, `world_size` |
/// | `batch` | `batch<k>_rank<r>.pt`, after each batch k of this rank | `prediction`, `batch_indices`, `batch_idx`, `rank`, `world_size` |
///
/// The files are volt checkpoints (volt/checkpoint.hpp: written atomically, read with `volt::checkpoint::read` or
/// Python's `torch.load`). A result must be a tensor or what `c10::IValue` holds; tensors are saved from the CPU.
/// \code
///   auto trainer = volt::make_trainer<volt::DDP<>>({.devices = 4}, volt::PredictionWriter({.dirpath = "out"}));
///   trainer.predict(model, loader, /*return_predictions=*/false);
/// \endcode

#include "volt/batch.hpp"
#include "volt/checkpoint.hpp"
#include "volt/data/predict_gather.hpp"

#include <ATen/core/ivalue.h>
#include <torch/types.h>

#include <filesystem>
#include <string>
#include <utility>

namespace volt {

struct PredictionWriterOptions {
  enum class Interval { batch, epoch };
  /// Where the files go; empty: `<default_root_dir>/predictions`.
  std::string dirpath;
  Interval write_interval = Interval::epoch;
};

class PredictionWriter {
 public:
  using Options = PredictionWriterOptions;
  using Interval = PredictionWriterOptions::Interval;

  explicit PredictionWriter(Options options = {}) : options_(std::move(options)) {}

  template <class T, class M>
  void on_predict_epoch_start(T&, M&) {
    predictions_ = c10::impl::GenericList(c10::AnyType::get());
    indices_ = c10::impl::GenericList(c10::AnyType::get());
  }

  template <class T, class M, class R, class B>
  void on_predict_batch_end(T& trainer, M&, const R& prediction, const B&, int64_t batch_idx) {
    static_assert(detail::GatherableResult<R>,
                  "volt: PredictionWriter saves predict_step's results, which must be a torch::Tensor or what "
                  "c10::IValue holds (a tuple, vector or dict of tensors, numbers, strings).");
    c10::IValue value = to_ivalue(prediction);
    torch::Tensor idx = trainer.batch_indices();
    if (!idx.defined()) idx = torch::empty({0}, torch::kLong);  // a loader that cannot tell
    if (options_.write_interval == Interval::batch) {
      checkpoint::Dict d = header(trainer);
      d.insert("prediction", value);
      d.insert("batch_indices", idx);
      d.insert("batch_idx", batch_idx);
      checkpoint::save(file(trainer, "batch" + std::to_string(batch_idx) + "_rank"), d);
    } else {
      predictions_.push_back(std::move(value));
      indices_.push_back(idx);
    }
  }

  template <class T, class M>
  void on_predict_epoch_end(T& trainer, M&) {
    if (options_.write_interval != Interval::epoch) return;
    checkpoint::Dict d = header(trainer);
    d.insert("predictions", predictions_);
    d.insert("batch_indices", indices_);
    checkpoint::save(file(trainer, "predictions_rank"), d);
  }

  /// The folder the files go to (empty before a predict has run with the default).
  const std::string& dirpath() const { return dir_; }

 private:
  template <class R>
  static c10::IValue to_ivalue(const R& r) {
    if constexpr (MappableBatch<R>) {
      return c10::IValue(map_tensors(r, [](const torch::Tensor& t) { return t.detach().cpu(); }));
    } else {
      return c10::IValue(r);
    }
  }
  template <class T>
  static checkpoint::Dict header(T& trainer) {
    checkpoint::Dict d = checkpoint::make_dict();
    d.insert("rank", static_cast<int64_t>(trainer.strategy().global_rank()));
    d.insert("world_size", static_cast<int64_t>(trainer.strategy().world_size()));
    return d;
  }
  template <class T>
  std::string file(T& trainer, const std::string& stem) {
    dir_ = options_.dirpath.empty() ? (std::filesystem::path(trainer.options().default_root_dir) / "predictions").string()
                                    : options_.dirpath;
    std::filesystem::create_directories(dir_);
    return (std::filesystem::path(dir_) / (stem + std::to_string(trainer.strategy().global_rank()) + ".pt")).string();
  }

  Options options_;
  std::string dir_;
  c10::impl::GenericList predictions_{c10::AnyType::get()};
  c10::impl::GenericList indices_{c10::AnyType::get()};
};

}  // namespace volt
