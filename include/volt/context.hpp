#pragma once
/// \file
/// `volt::Context`: what a module's steps and hooks are handed. It says where the run is (stage, epoch,
/// step, batch, rank, device) and takes the values the module logs, as Lightning's `self.log`:
/// \code
///   torch::Tensor training_step(const Batch& batch, volt::Context& ctx) {
///     auto loss = torch::nn::functional::cross_entropy(forward(batch.data), batch.target);
///     ctx.log("train_loss", loss, {.prog_bar = true});
///     return loss;
///   }
/// \endcode
/// A Context is not tied to the Trainer's type, so modules stay plain classes.

#include "volt/metric_store.hpp"
#include "volt/roles.hpp"
#include "volt/errors.hpp"
#include "volt/options.hpp"
#include "volt/stage.hpp"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/types.h>

#include <cctype>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace volt {

namespace detail {

/// The strategy's collectives, as a module sees them through its Context (not tied to the strategy's type).
struct Collectives {
  virtual ~Collectives() = default;
  virtual torch::Tensor all_reduce(const torch::Tensor& t, Reduce op) = 0;
  /// What `sync_dist` reduces a logged value over: the ranks whose batches differ (the data axes of a mesh whose other
  /// axes share batches), every rank elsewhere.
  virtual torch::Tensor sync_all_reduce(const torch::Tensor& t, Reduce op) = 0;
  virtual torch::Tensor all_gather(const torch::Tensor& t) = 0;
  virtual void broadcast_(const torch::Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  /// Every rank's bytes, in rank order, on every rank (which names each rank logged with sync_dist).
  virtual std::vector<std::string> host_all_gather(const std::string& bytes) = 0;
  virtual int world_size() const = 0;
  virtual int global_rank() const = 0;
};

}  // namespace detail

namespace role {
/// A strategy whose ranks may share batches (a mesh with tensor or pipe axes), declared in its `volt_roles`
/// (volt/roles.hpp): `data_all_reduce(const torch::Tensor&, Reduce) -> torch::Tensor`, a reduced copy over the ranks
/// whose batches differ, which `sync_dist` reduces logged values over (default: `all_reduce`); and
/// `data_line() const -> std::vector<int>`, the world ranks whose batches are every batch once, whose results predict
/// gathers (data/predict_gather.hpp; default: every rank).
struct shares_batches {
  template <class S>
  static constexpr bool met = requires(S& s, const S& cs, const torch::Tensor& t) {
    { s.data_all_reduce(t, Reduce::sum) } -> std::same_as<torch::Tensor>;
    { cs.data_line() } -> std::same_as<std::vector<int>>;
  };
};
}  // namespace role

namespace detail {

/// Collectives of a strategy `S` (every strategy has them: strategies/concept.hpp).
template <class S>
class StrategyCollectives final : public Collectives {
 public:
  explicit StrategyCollectives(S* strategy) : s_(strategy) {}
  torch::Tensor all_reduce(const torch::Tensor& t, Reduce op) override { return s_->all_reduce(t, op); }
  torch::Tensor sync_all_reduce(const torch::Tensor& t, Reduce op) override {
    if constexpr (declares_role<S, role::shares_batches>) {
      return s_->data_all_reduce(t, op);
    } else {
      return s_->all_reduce(t, op);
    }
  }
  torch::Tensor all_gather(const torch::Tensor& t) override { return s_->all_gather(t); }
  void broadcast_(const torch::Tensor& t, int root) override { s_->broadcast_(t, root); }
  void barrier() override { s_->barrier(); }
  std::vector<std::string> host_all_gather(const std::string& bytes) override { return s_->host_all_gather(bytes); }
  int world_size() const override { return s_->world_size(); }
  int global_rank() const override { return s_->global_rank(); }

 private:
  S* s_;
};

/// What a Context reaches under manual optimization: the fit's manual step (loops/manual_step.hpp), not tied to the
/// Trainer's type. `i` is an optimizer's index in what configure_optimizers returned.
class ManualOptimization {
 public:
  virtual ~ManualOptimization() = default;
  virtual std::size_t size() const = 0;
  virtual torch::optim::Optimizer& optimizer(std::size_t i) = 0;
  virtual torch::optim::LRScheduler* scheduler(std::size_t i) = 0;
  virtual void backward(const torch::Tensor& loss) = 0;
  virtual bool step(std::size_t i) = 0;
  virtual void zero_grad(std::size_t i) = 0;
  virtual void clip(std::size_t i, double value, ClipAlgorithm algorithm) = 0;
  virtual void toggle(std::size_t i) = 0;
  virtual void untoggle(std::size_t i) = 0;
  /// Sets whether manual_backward synchronises gradients across ranks; returns the previous setting.
  virtual bool set_sync(bool sync) = 0;
};

/// Where the loops stand; the Trainer owns it and every Context points at it.
struct LoopState {
  Stage stage = Stage::train;
  int64_t current_epoch = 0;
  int64_t global_step = 0;
  int64_t batch_idx = 0;
  bool in_batch = false;  // inside a step or batch hook (decides the on_step default)
  int global_rank = 0;
  int world_size = 1;
  torch::Device device = torch::kCPU;
  const void* batch = nullptr;                        // the current batch, for batch-size inference
  int64_t (*batch_size_of)(const void*) = nullptr;  // typed by the loop that set `batch`; -1: cannot tell
  const std::type_info* batch_type = nullptr;        // for messages
  int64_t dataloader_idx = 0;  // the loader of the running evaluation batch (several loaders: data::loaders)
  int64_t dataloaders = 1;     // the loaders of the running evaluation run (1 outside one's batches)
  Collectives* collectives = nullptr;                // the strategy's, set when a run starts
  ManualOptimization* manual = nullptr;              // the fit's manual step, under manual optimization
  torch::Tensor loss_units;  // what training_step's loss is a mean over (Context::weigh_loss); undefined: not said
};

/// An exception's message for a StepError: LibTorch's errors without the C++ backtrace LibTorch 1.x appends to
/// every message (twenty frames for "Target 10 is out of bounds"), unless `TORCH_SHOW_CPP_STACKTRACES=1` asks for
/// it, as LibTorch 2.x does; the nested original keeps it either way.
/// Anomaly mode's "Function 'LogSoftmaxBackward0' returned nan values ..." also names the forward op
/// (log_softmax), which is what a module's code calls.
inline std::string step_error_message(const std::exception& e) {
  std::string message = e.what();
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&e)) {
    const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
    if (show == nullptr || std::string_view(show) != "1") message = torch_error->what_without_backtrace();
  }
  const std::size_t at = message.find("Function '"), end = message.find("Backward", at);
  if (at != std::string::npos && end != std::string::npos && message.find("returned nan values") != std::string::npos) {
    std::string op;  // CamelCase to snake_case: MseLoss -> mse_loss, MaxPool2DWithIndices -> max_pool2d_with_indices
    auto ch = [&](std::size_t i) { return i < end ? static_cast<unsigned char>(message[i]) : 0; };
    for (std::size_t i = at + 10; i < end; ++i) {
      const bool word = std::isupper(ch(i)) != 0 && i > at + 10 &&
                        (std::islower(ch(i - 1)) != 0 || (std::isupper(ch(i - 1)) != 0 && std::islower(ch(i + 1)) != 0));
      if (word) op += '_';
      op += static_cast<char>(std::tolower(static_cast<unsigned char>(message[i])));
    }
    message += " (the gradient of the forward op " + op + ")";
  }
  return message;
}

/// Runs a module's step `f`; an exception from it comes out as a StepError that says where, with the original
/// nested (`step`: "training_step", ...).
template <class F>
decltype(auto) run_module_step(const LoopState& state, const char* step, F&& f) {
  try {
    return f();
  } catch (const StepError&) {
    throw;  // already says where
  } catch (const std::exception& e) {
    std::string where = std::string("volt: ") + step + " failed in ";
    if (state.stage == Stage::train) {
      where += "epoch " + std::to_string(state.current_epoch) + ", batch " + std::to_string(state.batch_idx) +
               " (global step " + std::to_string(state.global_step) + ")";
    } else {
      where += std::string(to_string(state.stage)) + " batch " + std::to_string(state.batch_idx);
      if (state.stage == Stage::validate || state.stage == Stage::sanity_check) {
        where += " (training epoch " + std::to_string(state.current_epoch) + ")";
      }
    }
    if (state.world_size > 1) where += " on rank " + std::to_string(state.global_rank);
    std::throw_with_nested(StepError(where + ": " + step_error_message(e)));
  }
}

}  // namespace detail

/// One of the fit's optimizers as a module steps it under manual optimization (Lightning's `LightningOptimizer`):
/// `ctx.optimizers()` gives one per optimizer configure_optimizers returned, in its order. Valid during the fit.
class ManualOptimizer {
 public:
  ManualOptimizer(detail::ManualOptimization& engine, std::size_t index) : engine_(&engine), index_(index) {}

  /// Steps the optimizer through the precision: its gradients unscaled (unless clip_gradients already did),
  /// `on_before_optimizer_step` called, the step skipped when an inf/NaN was found (Fp16Mixed), `global_step`
  /// counted, and its scheduler stepped when it has `Interval::step` and its frequency's turn has come. Returns
  /// whether the optimizer stepped. Under a precision that scales the loss (Fp16Mixed), each optimizer steps at most
  /// once per training_step: the scale is updated once, after it.
  bool step() { return engine_->step(index_); }
  /// Sets its parameters' gradients to none (LibTorch 2.x's `zero_grad(set_to_none = true)`; 1.13 zeroes them).
  void zero_grad() { engine_->zero_grad(index_); }
  /// The optimizer itself (its param_groups, its state).
  torch::optim::Optimizer& optimizer() const { return engine_->optimizer(index_); }
  torch::optim::Optimizer* operator->() const { return &engine_->optimizer(index_); }
  /// Its scheduler (null when it has none).
  torch::optim::LRScheduler* lr_scheduler() const { return engine_->scheduler(index_); }
  /// Its index in what configure_optimizers returned.
  std::size_t index() const { return index_; }

 private:
  friend class Context;
  detail::ManualOptimization* engine_;
  std::size_t index_;
};

/// Handed to every step and hook of a module.
class Context {
 public:
  Context(detail::LoopState& state, detail::MetricStore& store) : state_(&state), store_(&store) {}

  Stage stage() const { return state_->stage; }
  int64_t current_epoch() const { return state_->current_epoch; }
  /// Optimizer steps taken so far (as Lightning's `global_step`).
  int64_t global_step() const { return state_->global_step; }
  int64_t batch_idx() const { return state_->batch_idx; }
  /// Which of several evaluation loaders (`data::loaders`) the running batch comes from (0 with one loader).
  int64_t dataloader_idx() const { return state_->dataloader_idx; }
  int global_rank() const { return state_->global_rank; }
  int world_size() const { return state_->world_size; }
  bool is_global_zero() const { return state_->global_rank == 0; }
  /// The device batches are moved to.
  torch::Device device() const { return state_->device; }

  /// Says that the loss this training_step returns is a mean over `units` (the tokens that count, after masking): the
  /// gradient of an accumulation window, and across the ranks, is then the mean over every unit of the global batch
  /// (each micro-batch's loss weighted by its units) instead of the mean of the micro-batches' and ranks' means.
  /// `units`: a count (a one-element tensor, on any device, or a number) of 0 or more. Say it in every batch of an
  /// accumulation window or in none; automatic optimization outside graph mode. To weight a logged epoch mean the
  /// same way, log with `{.batch_size = units}` (Lightning's spelling).
  void weigh_loss(const torch::Tensor& units) {
    if (state_->stage != Stage::train || !state_->in_batch || state_->manual != nullptr) {
      throw std::logic_error(std::string("volt: weigh_loss was called ") +
                             (state_->manual != nullptr ? "under manual optimization, where the module weighs the "
                                                          "losses it gives manual_backward itself"
                                                        : "outside training_step") +
                             "; it weighs the loss training_step returns under automatic optimization.");
    }
    if (!units.defined() || units.numel() != 1) {
      throw std::invalid_argument("volt: weigh_loss takes one count (a one-element tensor or a number); it was given "
                                  "a tensor of " + std::to_string(units.defined() ? units.numel() : 0) + " elements.");
    }
    state_->loss_units = units.detach().reshape({}).to(torch::kFloat64);
  }
  void weigh_loss(double units) {
    if (!(units >= 0.0)) {
      throw std::invalid_argument("volt: weigh_loss(" + std::to_string(units) + "): a count of 0 or more units.");
    }
    weigh_loss(torch::tensor(units, torch::kFloat64));
  }

  /// Collectives across the ranks of the run (identities in a world of one). Every rank must call them in
  /// the same order. `all_reduce` returns a reduced copy (mean divides by the world size); `all_gather`
  /// stacks every rank's tensor along a new first dimension; `broadcast_` copies rank `root`'s tensor in place.
  /// They are not differentiable: wrap them in an autograd Function to use them inside a graph.
  torch::Tensor all_reduce(const torch::Tensor& t, Reduce op = Reduce::sum) {
    return state_->collectives ? state_->collectives->all_reduce(t, op) : t.detach().clone();
  }
  torch::Tensor all_gather(const torch::Tensor& t) {
    return state_->collectives ? state_->collectives->all_gather(t) : t.detach().unsqueeze(0).clone();
  }
  void broadcast_(const torch::Tensor& t, int root = 0) {
    if (state_->collectives) state_->collectives->broadcast_(t, root);
  }
  void barrier() {
    if (state_->collectives) state_->collectives->barrier();
  }

  // ---- manual optimization (a module with `static constexpr bool automatic_optimization = false;`) ----

  /// The fit's optimizers, in the order configure_optimizers returned them (Lightning's `self.optimizers()`).
  std::vector<ManualOptimizer> optimizers() {
    detail::ManualOptimization& m = manual("optimizers()");
    std::vector<ManualOptimizer> out;
    for (std::size_t i = 0; i < m.size(); ++i) out.emplace_back(m, i);
    return out;
  }
  /// Optimizer `i` (0 by default).
  ManualOptimizer optimizer(std::size_t i = 0) {
    detail::ManualOptimization& m = manual("optimizer(i)");
    if (i >= m.size()) {
      throw std::out_of_range("volt: optimizer(" + std::to_string(i) + ") was asked for; the fit has " +
                              std::to_string(m.size()) + " optimizer" + (m.size() == 1 ? "" : "s") + ", indices 0 to " +
                              std::to_string(m.size() - 1) + ".");
    }
    return {m, i};
  }
  /// Each optimizer's scheduler, in optimizer order (null where one has none).
  std::vector<torch::optim::LRScheduler*> lr_schedulers() {
    detail::ManualOptimization& m = manual("lr_schedulers()");
    std::vector<torch::optim::LRScheduler*> out;
    for (std::size_t i = 0; i < m.size(); ++i) out.push_back(m.scheduler(i));
    return out;
  }
  /// Backward of `loss` through the precision (Fp16Mixed scales it) and the strategy (DDP averages the gradients
  /// over the ranks, bucketed and overlapped as in automatic mode, unless a `no_sync()` guard lives), with the
  /// `on_before_backward` and `on_after_backward` hooks (Lightning's `manual_backward`).
  void manual_backward(const torch::Tensor& loss) { manual("manual_backward").backward(loss); }
  /// Clips the gradients of `opt`'s parameters by their total norm or by value, after unscaling them (Fp16Mixed);
  /// call it between manual_backward and `opt.step()`.
  void clip_gradients(const ManualOptimizer& opt, double value, ClipAlgorithm algorithm = ClipAlgorithm::norm) {
    if (!(value > 0.0)) {
      throw std::invalid_argument("volt: clip_gradients(value=" + std::to_string(value) + ") is not allowed: give a "
                                  "value > 0.");
    }
    manual("clip_gradients").clip(opt.index_, value, algorithm);
  }
  /// Only `opt`'s parameters require gradients until `untoggle_optimizer(opt)` (Lightning's `toggle_optimizer`): the
  /// parameters of the other optimizers are frozen, so a backward for this optimizer leaves theirs alone.
  void toggle_optimizer(const ManualOptimizer& opt) { manual("toggle_optimizer").toggle(opt.index_); }
  /// Gives every parameter back the requires_grad it had before `toggle_optimizer(opt)`.
  void untoggle_optimizer(const ManualOptimizer& opt) { manual("untoggle_optimizer").untoggle(opt.index_); }

  /// While it lives, manual_backward does not synchronise gradients across ranks: for an accumulation written by
  /// hand, the last backward (after the guard) averages the sum (Lightning's `no_backward_sync`).
  class NoSync {
   public:
    explicit NoSync(detail::ManualOptimization& m) : m_(&m), previous_(m.set_sync(false)) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    ~NoSync() { m_->set_sync(previous_); }

   private:
    detail::ManualOptimization* m_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(manual("no_sync")); }

  /// Records a scalar under `name` (see LogOptions for where it goes and how it is reduced).
  void log(std::string_view name, const torch::Tensor& value, const LogOptions& options = {}) {
    if (state_->stage == Stage::predict) {
      throw std::logic_error("volt: log(\"" + std::string(name) + "\") was called while predicting; predict logs nothing.");
    }
    const bool step_default = state_->in_batch && state_->stage == Stage::train;
    const bool on_step = options.on_step.value_or(step_default);
    const bool on_epoch = options.on_epoch.value_or(!step_default);
    if (!on_step && !on_epoch) {
      throw std::invalid_argument("volt: log(\"" + std::string(name) +
                                  "\") with on_step=false and on_epoch=false would record nothing; set one of them.");
    }
    if (on_step && !state_->in_batch) {
      throw std::invalid_argument("volt: log(\"" + std::string(name) +
                                  "\", on_step=true) outside a step or batch hook; epoch-level hooks log with on_epoch.");
    }
    int64_t batch_size = 1;
    if (on_epoch && options.reduce == Reduce::mean) {
      if (options.batch_size) {
        batch_size = *options.batch_size;
      } else if (state_->batch != nullptr) {
        batch_size = state_->batch_size_of(state_->batch);
        if (batch_size < 0) {
          throw std::invalid_argument(
              "volt: log(\"" + std::string(name) + "\") averages over the epoch weighted by batch size, but volt "
              "cannot look inside the batch type " + c10::demangle(state_->batch_type->name()) +
              " to find its size. Pass the size, log(name, value, {.batch_size = n}), or specialise "
              "volt::BatchTraits for that type (see volt/batch.hpp).");
        }
      }
    }
    if (state_->dataloaders > 1 && options.add_dataloader_idx) {  // Lightning's name for a value of one of several
      store_->add(std::string(name) + "/dataloader_idx_" + std::to_string(state_->dataloader_idx), value, options,
                  on_step, on_epoch, batch_size);
    } else {
      store_->add(name, value, options, on_step, on_epoch, batch_size);
    }
  }
  void log(std::string_view name, double value, const LogOptions& options = {}) {
    log(name, torch::scalar_tensor(value, torch::kFloat64), options);
  }
  /// Several values with the same options, as Lightning's `self.log_dict`: `ctx.log_dict({{"loss", loss}, {"acc",
  /// acc}})`, in the map's (name) order.
  void log_dict(const std::map<std::string, torch::Tensor>& values, const LogOptions& options = {}) {
    for (const auto& [name, value] : values) log(name, value, options);
  }
  void log_dict(const std::map<std::string, double>& values, const LogOptions& options = {}) {
    for (const auto& [name, value] : values) log(name, value, options);
  }

 private:
  /// The fit's manual step, or an error that says how to get one.
  detail::ManualOptimization& manual(const char* what) {
    if (state_->manual == nullptr) {
      throw std::logic_error(std::string("volt: ctx.") + what + " is for manual optimization, and no fit with it is "
                             "running here: call it from training_step (or another hook of fit) of a module that "
                             "declares `static constexpr bool automatic_optimization = false;`, or return the loss from "
                             "training_step and let volt step the optimizers.");
    }
    return *state_->manual;
  }

  detail::LoopState* state_;
  detail::MetricStore* store_;
};

}  // namespace volt
