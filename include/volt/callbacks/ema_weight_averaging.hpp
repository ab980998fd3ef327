#pragma once

#include "volt/callbacks/concept.hpp"
#include "volt/checkpoint.hpp"
#include "volt/stage.hpp"
#include "volt/errors.hpp"

#include <torch/nn/module.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace volt {

/// An exponential moving average of the module's weights, as Lightning's EMAWeightAveraging (PyTorch's
/// `AveragedModel` with `get_ema_multi_avg_fn`): after an optimizer step, `average = lerp(average, weight, 1 - decay)`
/// (the first update copies the weights). Updates come after the training batches whose step index
/// (`global_step - 1`) is a multiple of `update_every_n_steps`, from `update_starting_at_step` on, and at the end of
/// every epoch from `update_starting_at_epoch` on (when given). With `use_buffers` floating-point buffers (a batch
/// norm's running statistics) are averaged too, and integer ones (its batch count) take the current value; without,
/// the average's buffers are the module's at the last update.
///
/// As in Lightning: the average is swapped in for every validation run (the sanity check too) and swapped back after;
/// when training ends it is copied into the module for good, so `test`, `predict` and Spawn's returned weights use it;
/// a checkpoint's `state_dict` holds the average (a model loaded from it for inference gets the averaged weights)
/// while this callback's state holds the weights training goes on from, and the update counters, so a resumed fit
/// goes on bit for bit. A checkpoint written without this callback resumes with average = its weights and no update
/// made yet (the next one copies the weights). Under DDP every rank holds the same average of the parameters (they
/// are the same after each step); buffers that each rank updates on its own data (a batch norm's running
/// statistics) differ across ranks, averaged or not. It works with manual optimization (one update per batch that
/// stepped) and graph mode (updates run outside the captured step).
///
/// Order in the pack: a ModelCheckpoint before this callback saves before the batch's update; the resumed fit then
/// makes that update first, so the result is the same in either order. When a fit resumes, the module holds the
/// file's weights (the average) until this callback's on_fit_start puts the training weights back: callbacks before
/// it see the average in their own on_fit_start. A run that fails during validation gets its weights back.
class EMAWeightAveraging {
 public:
  struct Options {
    /// Weight of the old average in each update (PyTorch's and Lightning's default).
    double decay = 0.999;
    /// Average floating-point buffers too (Lightning's default).
    bool use_buffers = true;
    /// Update after every n-th optimizer step (0: never after steps).
    int64_t update_every_n_steps = 1;
    /// First step index (global_step - 1) that updates (unset: from the first).
    std::optional<int64_t> update_starting_at_step;
    /// From this epoch on, also update at each epoch's end (unset: never at epochs' ends).
    std::optional<int64_t> update_starting_at_epoch;
  };

  EMAWeightAveraging() = default;
  explicit EMAWeightAveraging(Options options) : options_(options) {
    auto refuse = [](const std::string& what, const std::string& allowed) {
      throw std::invalid_argument("volt: EMAWeightAveraging " + what + " is not allowed: " + allowed + ".");
    };
    if (!(options_.decay >= 0.0 && options_.decay <= 1.0)) refuse("decay=" + std::to_string(options_.decay), "give 0 <= decay <= 1");
    if (options_.update_every_n_steps < 0) {
      refuse("update_every_n_steps=" + std::to_string(options_.update_every_n_steps), "give 0 (never after steps) or more");
    }
    if (options_.update_starting_at_step && *options_.update_starting_at_step < 0) {
      refuse("update_starting_at_step=" + std::to_string(*options_.update_starting_at_step), "give a step index >= 0");
    }
    if (options_.update_starting_at_epoch && *options_.update_starting_at_epoch < 0) {
      refuse("update_starting_at_epoch=" + std::to_string(*options_.update_starting_at_epoch), "give an epoch >= 0");
    }
  }

  /// Updates made so far (PyTorch's `n_averaged`).
  int64_t num_updates() const { return n_averaged_; }
  /// The average of each parameter and buffer, by name (empty before the first fit starts).
  std::vector<std::pair<std::string, torch::Tensor>> average() const {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& e : entries_) out.emplace_back(e.name, (swapped_ ? e.current : e.average).detach().clone());
    return out;
  }

  // ---- hooks ----
  template <class T, class M>
  void setup(T&, M&, Stage stage) {
    if (stage != Stage::train) return;
    n_averaged_ = 0;
    latest_update_step_ = 0;
    latest_update_epoch_ = -1;
    resumed_current_.reset();
    entries_.clear();
    swapped_ = false;
  }
  template <class T, class M>
  void on_fit_start(T& trainer, M& module) {
    bind(module);
    if (!resumed_current_) return;
    // The module holds the file's state_dict, the average: each goes back where it belongs (all checked first).
    for (const auto& e : entries_) {
      const bool fits = resumed_current_->contains(e.name) && resumed_current_->at(e.name).isTensor() &&
                        resumed_current_->at(e.name).toTensor().sizes() == e.current.sizes();
      if (!fits) {
        throw CheckpointError("volt: EMAWeightAveraging's state in " + trainer.ckpt_path() + " has no weights of " +
                              e.name + "'s shape; it was written for another module.");
      }
    }
    {
      torch::NoGradGuard no_grad;
      for (auto& e : entries_) {
        e.average.copy_(e.current);
        e.current.copy_(resumed_current_->at(e.name).toTensor());
      }
    }
    resumed_current_.reset();
    // A checkpoint saved before its batch's update (a ModelCheckpoint earlier in the pack): make it now.
    if (trainer.global_step() > latest_update_step_ && should_update_at_step(trainer.global_step() - 1)) {
      update(trainer.global_step());
    }
  }
  template <class T, class M, class L, class B>
  void on_train_batch_end(T& trainer, M&, const L&, const B&, int64_t) {
    if (trainer.global_step() > latest_update_step_ && should_update_at_step(trainer.global_step() - 1)) {
      update(trainer.global_step());
    }
  }
  template <class T, class M>
  void on_train_epoch_end(T& trainer, M&) {
    const int64_t epoch = trainer.current_epoch();
    if (options_.update_starting_at_epoch && epoch >= *options_.update_starting_at_epoch && epoch > latest_update_epoch_) {
      update(latest_update_step_);
      latest_update_epoch_ = epoch;
    }
  }
  /// (only while fitting: a validate() after the fit runs on the module as it is, which holds the average by then)
  template <class T, class M>
  void on_validation_epoch_start(T& trainer, M&) {
    if (trainer.fitting() && !entries_.empty() && !swapped_) swap();
  }
  template <class T, class M>
  void on_validation_epoch_end(T&, M&) {
    if (swapped_) swap();
  }
  /// A run failing during validation: the module gets its training weights back.
  template <class T, class M>
  void on_exception(T&, M&, std::exception_ptr) {
    if (swapped_) swap();
  }
  template <class T, class M>
  void on_train_end(T&, M&) {
    if (swapped_) swap();
    torch::NoGradGuard no_grad;
    for (auto& e : entries_) e.current.copy_(e.average);
  }
  /// The checkpoint's weights are the average (the weights training goes on from are in state_dict()).
  template <class T, class M>
  void on_save_checkpoint(T&, M&, checkpoint::Dict& checkpoint) {
    if (entries_.empty()) return;
    c10::Dict<std::string, at::Tensor> averaged;
    for (const auto& e : entries_) averaged.insert(e.name, (swapped_ ? e.current : e.average).detach().cpu());
    checkpoint.insert_or_assign(checkpoint::keys::state_dict, averaged);
  }

  // ---- state in checkpoints ----
  checkpoint::Dict state_dict() const {
    checkpoint::Dict d = checkpoint::make_dict();
    d.insert("n_averaged", n_averaged_);
    d.insert("latest_update_step", latest_update_step_);
    d.insert("latest_update_epoch", latest_update_epoch_);
    c10::Dict<std::string, at::Tensor> current;
    for (const auto& e : entries_) current.insert(e.name, (swapped_ ? e.average : e.current).detach().cpu());
    d.insert("current_model_state", current);
    return d;
  }
  void load_state_dict(const checkpoint::Dict& d) {
    for (const char* k : {"n_averaged", "latest_update_step", "latest_update_epoch", "current_model_state"}) {
      if (!d.contains(k)) {
        throw CheckpointError(std::string("volt: EMAWeightAveraging's state in the checkpoint has no \"") + k +
                              "\"; it was not written by this callback.");
      }
    }
    n_averaged_ = d.at("n_averaged").toInt();
    latest_update_step_ = d.at("latest_update_step").toInt();
    latest_update_epoch_ = d.at("latest_update_epoch").toInt();
    resumed_current_ = d.at("current_model_state").toGenericDict();
  }

 private:
  struct Entry {
    std::string name;
    /// The module's own tensor, and this callback's average of it.
    torch::Tensor current, average;
    /// Whether updates average it (floating-point parameters; floating-point buffers with use_buffers).
    bool averaged;
  };

  bool should_update_at_step(int64_t step_idx) const {
    const bool started = !options_.update_starting_at_step || step_idx >= *options_.update_starting_at_step;
    return started && options_.update_every_n_steps > 0 && step_idx % options_.update_every_n_steps == 0;
  }
  void bind(torch::nn::Module& module) {
    entries_.clear();
    swapped_ = false;
    for (const auto& p : module.named_parameters(/*recurse=*/true)) {
      entries_.push_back({p.key(), p.value(), p.value().detach().clone(), p.value().is_floating_point()});
    }
    for (const auto& b : module.named_buffers(/*recurse=*/true)) {
      if (!b.value().defined()) continue;
      entries_.push_back({b.key(), b.value(), b.value().detach().clone(), options_.use_buffers && b.value().is_floating_point()});
    }
  }
  void update(int64_t step) {
    torch::NoGradGuard no_grad;
    for (auto& e : entries_) {
      if (n_averaged_ > 0 && e.averaged) {
        e.average.lerp_(e.current.detach(), 1.0 - options_.decay);
      } else {
        e.average.copy_(e.current.detach());
      }
    }
    ++n_averaged_;
    latest_update_step_ = step;
  }
  /// Exchanges the module's weights and the average (by copies: the module's tensors keep their storage, which the
  /// optimizer, DDP's buckets and a captured CUDA graph hold).
  void swap() {
    torch::NoGradGuard no_grad;
    for (auto& e : entries_) {
      const torch::Tensor tmp = e.current.detach().clone();
      e.current.copy_(e.average);
      e.average.copy_(tmp);
    }
    swapped_ = !swapped_;
  }

  Options options_;
  std::vector<Entry> entries_;
  bool swapped_ = false;
  int64_t n_averaged_ = 0;
  int64_t latest_update_step_ = 0;
  int64_t latest_update_epoch_ = -1;
  /// The weights a resumed fit goes on from, until on_fit_start puts them into the module.
  std::optional<checkpoint::Dict> resumed_current_;
};

}  // namespace volt
