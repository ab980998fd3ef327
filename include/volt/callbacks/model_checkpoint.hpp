#pragma once

#include "volt/callbacks/concept.hpp"
#include "volt/checkpoint.hpp"
#include "volt/stage.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace volt {

/// Saves checkpoints while fitting, as Lightning's ModelCheckpoint:
///  - when: every `every_n_train_steps` optimizer steps, or every `every_n_epochs` epochs (the default,
///    1, when neither is given) — at the end of the training epoch when the fit has no validation or
///    validates once at the end of each epoch, else after each validation run;
///  - which: without `monitor`, the latest (`save_top_k` = 1, the previous one is deleted), all (-1) or none
///    (0); with `monitor`, the `save_top_k` best by `mode` (a checkpoint that drops out of the top k is
///    deleted; -1 keeps all); `save_last` also writes `last.ckpt` at each of these saves, at every epoch's end (or
///    validation's end) whatever `every_n_epochs` says, and at the fit's end when it trained past its newest save;
///  - where: `dirpath` (default `<default_root_dir>/checkpoints`), named by `filename`, a template such as
///    `"{epoch}-{step}-{val_loss:.3f}"` (→ `epoch=2-step=300-val_loss=0.123.ckpt`; `auto_insert_metric_name`
///    adds the `name=`; an integer spec such as `{epoch:03d}` or a floating one such as `{val_loss:.2e}` is a
///    printf conversion; a metric without one is printed with 4 decimals). An existing file of another
///    run is not overwritten: the name gets `-v1`, `-v2`, ... (`last.ckpt` and a stop signal's
///    `interrupted.ckpt` too: `last-v1.ckpt`), unless `enable_version_counter` is false. A fit that starts afresh
///    in a folder holding checkpoints says so once, naming the folder and the files.
/// Only rank zero writes and deletes files; every rank takes part in a save (the Trainer gathers each
/// rank's random generator state). Its own state (best score and path, the top k, the last step saved)
/// goes into each checkpoint, so a resumed fit keeps ranking against the earlier checkpoints.
///
/// What it never deletes, as Lightning: a file outside its own folder, and the checkpoint the fit resumed
/// from. A fit that resumes from a checkpoint written into another folder (another `default_root_dir` or
/// `dirpath`) takes over only its best path, not its top k, so the earlier run's files stay whole.
/// `async_save`: each save returns once the state is copied to host memory (pinned where it was on a GPU) and the
/// file (and `last.ckpt`) is serialized, checksummed, written and renamed on a thread, the same bytes as a
/// synchronous save; one save in flight (the next waits for it, as do a stop signal, max_time and the fit's end); a
/// file that leaves the top k is deleted only once the new file is in place, so a kill at any moment leaves the
/// previous files whole.
/// `save_safetensors`: beside each checkpoint its weights as safetensors, `.ckpt` replaced
/// (`epoch=1-step=20.safetensors`, `last.safetensors`), for Python's `safetensors`, Hugging Face or volt::load_weights:
/// the checkpoint's own `state_dict` after every on_save_checkpoint hook (EMAWeightAveraging's average where that
/// callback runs), written after the checkpoint (on the writer's thread when async) and deleted with it when it
/// leaves the top k.
/// A monitored name that is missing is a warning until the fit's first validation has run (a step-based
/// save can come before it), and an error after.
/// `trainer.fit(module, train, val, "last")` resumes from the furthest `last*.ckpt` or `interrupted*.ckpt` that reads
/// whole (find_last_checkpoint; a fresh start when there is none yet), `"best"` from its best; `validate`, `test` and
/// `predict` take the same names. A deletion (a file leaving the top k) renames the file or folder away before deleting
/// it, so a killed job leaves it whole or gone; what such a job left half done (temporaries named `.tmp.<pid>`) is
/// deleted at the next save.
/// A Trainer writes checkpoints through the ModelCheckpoint in its callbacks only (a stop signal's aside): Lightning's
/// `enable_checkpointing=True` adds one unasked, volt does not, since the callbacks are the Trainer's type, chosen
/// where it is declared (docs/reference.md, "Where volt departs from Lightning").
class ModelCheckpoint {
 public:
  using Mode = volt::Mode;
  struct Options {
    /// Folder; empty: `<default_root_dir>/checkpoints`.
    std::string dirpath;
    /// Name template without the extension; empty: `{epoch}-{step}`.
    std::string filename;
    std::optional<std::string> monitor;
    Mode mode = Mode::min;
    int64_t save_top_k = 1;
    bool save_last = false;
    bool save_weights_only = false;
    /// 0: not by steps.
    int64_t every_n_train_steps = 0;
    /// Unset: 1 when every_n_train_steps is 0, else 0 (not by epochs).
    std::optional<int64_t> every_n_epochs;
    /// Unset: true when there is no validation, or it runs once at the end of every epoch.
    std::optional<bool> save_on_train_epoch_end;
    bool auto_insert_metric_name = true;
    /// Keep another run's file that has the name a checkpoint would get, naming the new one `-v1`, `-v2`, ...
    /// (false: replace it).
    bool enable_version_counter = true;
    bool verbose = false;
    /// Write on a thread while training goes on (above).
    bool async_save = false;
    /// Also write each checkpoint's weights as safetensors beside it (above).
    bool save_safetensors = false;
  };

  static constexpr bool monitors_metrics = true;
  /// Its on_train_batch_end does not read the loss (graph mode need not copy it).
  static constexpr bool keeps_loss = false;
  static constexpr const char* kLastName = "last";
  static constexpr const char* kInterruptedName = "interrupted";
  static constexpr const char* kExtension = ".ckpt";
  /// The key of the best checkpoint's path in its state.
  static constexpr const char* kBestModelPath = "best_model_path";

  ModelCheckpoint() : ModelCheckpoint(Options{}) {}
  explicit ModelCheckpoint(Options options) : options_(std::move(options)) {
    auto fail = [](const std::string& what) { throw std::invalid_argument("volt: ModelCheckpoint " + what); };
    if (options_.save_top_k < -1) {
      fail("save_top_k=" + std::to_string(options_.save_top_k) +
           " is not allowed: give -1 (keep all), 0 (none) or a number of checkpoints to keep.");
    }
    if (!options_.monitor && options_.save_top_k > 1) {
      fail("save_top_k=" + std::to_string(options_.save_top_k) +
           " needs a monitor to rank checkpoints by; without one give -1, 0 or 1.");
    }
    if (options_.monitor && options_.monitor->empty()) fail("monitor is an empty name; give a logged metric or leave it unset.");
    if (options_.every_n_train_steps < 0) {
      fail("every_n_train_steps=" + std::to_string(options_.every_n_train_steps) + " is not allowed: give a number >= 0.");
    }
    if (options_.every_n_epochs && *options_.every_n_epochs < 0) {
      fail("every_n_epochs=" + std::to_string(*options_.every_n_epochs) + " is not allowed: give a number >= 0.");
    }
    if (options_.every_n_train_steps > 0 && options_.every_n_epochs.value_or(0) > 0) {
      fail("every_n_train_steps=" + std::to_string(options_.every_n_train_steps) + " and every_n_epochs=" +
           std::to_string(*options_.every_n_epochs) + " were both given; choose one.");
    }
    every_n_epochs_ = options_.every_n_epochs.value_or(options_.every_n_train_steps > 0 ? 0 : 1);
    if (options_.filename.empty()) options_.filename = "{epoch}-{step}";
  }

  /// The key of its state in a checkpoint (Lightning's form).
  std::string state_key() const {
    std::ostringstream s;
    s << "ModelCheckpoint{'monitor': " << (options_.monitor ? "'" + *options_.monitor + "'" : std::string("None"))
      << ", 'mode': '" << (options_.mode == Mode::min ? "min" : "max")
      << "', 'every_n_train_steps': " << options_.every_n_train_steps << ", 'every_n_epochs': " << every_n_epochs_
      << "}";
    return s.str();
  }

  // ---- hooks ----------------------------------------------------------------------------------------

  /// At fit start: the folder, and on rank zero a check that checkpoints can be written there (a read-only or
  /// full disk stops the fit now, not at the first save).
  template <class T, class M>
  void setup(T& trainer, M& module, Stage stage) {
    if (stage != Stage::train) return;
    dirpath_ = folder(trainer).string();
    global_zero_ = trainer.is_global_zero();
    warned_missing_monitor_ = false;
    if (!global_zero_ || trainer.fast_dev_run()) return;
    if (trainer.ckpt_path().empty()) warn_if_folder_holds_checkpoints();
    std::uintmax_t weights = 0;
    for (const auto& t : module.parameters()) weights += t.nbytes();
    for (const auto& t : module.buffers()) weights += t.nbytes();
    checkpoint::check_writable(dirpath_, weights, "ModelCheckpoint");
  }

  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (skip(trainer) || options_.every_n_train_steps < 1) return;
    if (trainer.global_step() % options_.every_n_train_steps != 0) return;
    save(trainer);
  }

  /// `last.ckpt` at every epoch's end (or validation's end), whatever every_n_epochs says, as Lightning.
  template <class T, class M>
  void on_train_epoch_end(T& trainer, M&) {
    if (!skip(trainer) && saves_on_train_epoch_end(trainer)) save_at_epoch_end(trainer);
  }

  template <class T, class M>
  void on_validation_end(T& trainer, M&) {
    if (!skip(trainer) && !saves_on_train_epoch_end(trainer)) save_at_epoch_end(trainer);
  }

  /// `last.ckpt` at the fit's end when the fit trained past its newest save (max_steps inside an epoch, which it
  /// leaves open, every_n_epochs > 1): `fit(..., "last")` then finds the end of the fit.
  /// Lightning writes it only when this callback saved nothing in the fit, and also under fast_dev_run; volt
  /// departs on both, so that last.ckpt is always the fit's last state and fast_dev_run writes no file.
  template <class T, class M>
  void on_train_end(T& trainer, M&) {
    if (options_.save_last && !skip(trainer)) save(trainer, false);
  }

  // ---- what it knows --------------------------------------------------------------------------------

  const std::string& best_model_path() const { return best_model_path_; }
  /// The best monitored value (NaN before the first checkpoint with a monitor).
  double best_model_score() const { return best_score_; }
  const std::string& last_model_path() const { return last_model_path_; }
  /// The checkpoints kept and their monitored values.
  const std::map<std::string, double>& best_k_models() const { return best_k_; }
  std::string dirpath() const { return dirpath_.empty() ? options_.dirpath : dirpath_; }

  /// The checkpoint `fit(..., "last")` resumes from, as Lightning looks among `last*.ckpt` only: of the `last*.ckpt`
  /// and `interrupted*.ckpt` (a stop signal's) in its folder, the one that reads whole (`checkpoint::read`: every byte
  /// checked) with the highest recorded step (then the most batches trained, then the later written); the folder's
  /// other checkpoints only where none of those reads. A candidate that does not read (a file or folder a killed job
  /// left torn) is passed over with a warning naming it. "" when no checkpoint reads.
  template <class T>
  std::string find_last_checkpoint(const T& trainer) const {
    std::vector<std::filesystem::path> named, others;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(folder(trainer), ec)) {
      if (!checkpoint::is_checkpoint_entry(e) || e.path().extension() != kExtension) continue;
      const std::string stem = e.path().stem().string();
      const bool last = stem.rfind(kLastName, 0) == 0 || stem.rfind(kInterruptedName, 0) == 0;
      (last ? named : others).push_back(e.path());
    }
    std::string found = newest_readable(trainer, named);
    return found.empty() ? newest_readable(trainer, others) : found;
  }

  /// Where a stop signal's checkpoint goes (the Trainer writes it; `find_last_checkpoint` finds it): `interrupted.ckpt`,
  /// or `interrupted-v1.ckpt`, ... where another run's file has that name.
  template <class T>
  std::string signal_checkpoint_path(const T& trainer) const {
    return checkpoint::free_checkpoint_path(folder(trainer), kInterruptedName, options_.enable_version_counter,
                                            [&](const std::string& p) { return resumed_from(trainer, p); });
  }

  /// Its best checkpoint: the one it knows, or in a new process the best its newest checkpoint records
  /// (its own state inside that file); "" when there is none.
  template <class T>
  std::string find_best_checkpoint(const T& trainer) const {
    if (!best_model_path_.empty()) return best_model_path_;
    const std::string last = find_last_checkpoint(trainer);
    if (last.empty()) return "";
    const auto saved = checkpoint::saved_callback_state(last, state_key());
    if (!saved || !saved->contains(kBestModelPath)) return "";
    return saved->at(kBestModelPath).toStringRef();
  }

  checkpoint::Dict state_dict() const {
    checkpoint::Dict d = checkpoint::make_dict();
    d.insert("monitor", options_.monitor ? *options_.monitor : std::string());
    d.insert("best_model_score", best_score_);
    d.insert(kBestModelPath, best_model_path_);
    d.insert("kth_best_model_path", kth_path_);
    d.insert("kth_value", kth_value_);
    d.insert("last_model_path", last_model_path_);
    d.insert("dirpath", dirpath());
    d.insert("last_global_step_saved", last_global_step_saved_);
    checkpoint::Dict k = checkpoint::make_dict();
    for (const auto& [path, score] : best_k_) k.insert(path, score);
    d.insert("best_k_models", k);
    return d;
  }

  /// Takes up a saved state. From a checkpoint of another folder only the best path is taken (Lightning's
  /// rule): that run's top k and last path are its own, never ranked against or deleted from here.
  void load_state_dict(const checkpoint::Dict& d) {
    for (const char* key : {"best_model_score", "best_model_path", "kth_best_model_path", "kth_value",
                            "last_model_path", "last_global_step_saved", "best_k_models"}) {
      if (!d.contains(key)) {
        throw std::invalid_argument(std::string("volt: ModelCheckpoint state has no \"") + key +
                                    "\"; it was not saved by ModelCheckpoint.");
      }
    }
    last_global_step_saved_ = d.at("last_global_step_saved").toInt();
    const std::string saved_dir = d.contains("dirpath") ? d.at("dirpath").toStringRef() : dirpath();
    if (!checkpoint::same_path(saved_dir, dirpath())) {
      if (global_zero_) {
        std::cerr << "volt: ModelCheckpoint: the checkpoint folder changed from " << saved_dir << " to " << dirpath()
                  << "; only best_model_path is taken over (not the best k, their scores or the last path), and "
                     "nothing in the old folder is deleted.\n";
      }
      best_model_path_ = d.at(kBestModelPath).toStringRef();
      return;
    }
    best_score_ = d.at("best_model_score").toDouble();
    best_model_path_ = d.at(kBestModelPath).toStringRef();
    kth_path_ = d.at("kth_best_model_path").toStringRef();
    kth_value_ = d.at("kth_value").toDouble();
    last_model_path_ = d.at("last_model_path").toStringRef();
    best_k_.clear();
    for (const auto& e : d.at("best_k_models").toGenericDict()) best_k_.emplace(e.key().toStringRef(), e.value().toDouble());
  }

  /// The file name the template gives for these values (without the folder).
  std::string format_name(int64_t epoch, int64_t step, const std::map<std::string, double>& metrics) const {
    const std::string& t = options_.filename;
    std::string out;
    for (std::size_t i = 0; i < t.size();) {
      if (t[i] != '{') {
        out += t[i++];
        continue;
      }
      const std::size_t close = t.find('}', i);
      if (close == std::string::npos) {
        throw std::invalid_argument("volt: ModelCheckpoint filename \"" + t + "\" has an unclosed '{'.");
      }
      std::string field = t.substr(i + 1, close - i - 1), spec;
      if (const auto colon = field.find(':'); colon != std::string::npos) {
        spec = field.substr(colon + 1);
        field = field.substr(0, colon);
      }
      if (options_.auto_insert_metric_name) out += field + "=";
      if (field == "epoch" || field == "step") {
        out += format_value(static_cast<double>(field == "epoch" ? epoch : step), spec, true);
      } else {
        auto it = metrics.find(field);
        if (it == metrics.end()) {
          std::ostringstream s;
          s << "volt: ModelCheckpoint filename \"" << t << "\" names \"" << field << "\", which was not logged. Logged:";
          for (const auto& [k, v] : metrics) s << " " << k;
          s << " (and epoch, step).";
          throw std::runtime_error(s.str());
        }
        out += format_value(it->second, spec, false);
      }
      i = close + 1;
    }
    return out;
  }

 private:
  template <class T>
  std::filesystem::path folder(const T& trainer) const {
    return options_.dirpath.empty() ? std::filesystem::path(trainer.options().default_root_dir) / "checkpoints"
                                    : std::filesystem::path(options_.dirpath);
  }

  template <class T>
  bool skip(const T& trainer) const {
    return trainer.fast_dev_run() || !trainer.fitting() || trainer.sanity_checking() ||
           last_global_step_saved_ == trainer.global_step();
  }

  template <class T>
  bool saves_on_train_epoch_end(const T& trainer) const {
    if (options_.save_on_train_epoch_end) return *options_.save_on_train_epoch_end;
    const auto& o = trainer.options();
    if (o.check_val_every_n_epoch && *o.check_val_every_n_epoch != 1) return false;
    if (!trainer.has_validation()) return true;
    return o.val_check_interval.is_fraction() && o.val_check_interval.fraction() == 1.0;
  }

  static std::string format_value(double v, const std::string& spec, bool integer) {
    char buf[64];
    if (spec.empty()) {
      if (integer) return std::to_string(static_cast<int64_t>(v));
      std::snprintf(buf, sizeof buf, "%.4f", v);
    } else if (spec.back() == 'd' || spec.back() == 'i') {
      std::snprintf(buf, sizeof buf, ("%" + spec.substr(0, spec.size() - 1) + "lld").c_str(), static_cast<long long>(v));
    } else {
      std::snprintf(buf, sizeof buf, ("%" + spec).c_str(), v);
    }
    return buf;
  }

  /// Of `paths`, the checkpoint that reads whole with the highest (global step, batches trained, time written); a
  /// warning (rank zero) for each that does not read; "" when none does.
  template <class T>
  static std::string newest_readable(const T& trainer, std::vector<std::filesystem::path> paths) {
    std::sort(paths.begin(), paths.end());  // the same order on every rank, whatever the folder's listing
    std::string best;
    std::tuple<int64_t, int64_t, std::filesystem::file_time_type> best_key{};
    for (const auto& p : paths) {
      try {
        const checkpoint::Dict d = checkpoint::read(p.string());
        const int64_t step = d.contains(checkpoint::keys::global_step) ? d.at(checkpoint::keys::global_step).toInt() : 0;
        int64_t batches = 0;
        if (d.contains(checkpoint::keys::loops)) {
          const auto loops = d.at(checkpoint::keys::loops).toGenericDict();
          if (loops.contains("total_batch_idx")) batches = loops.at("total_batch_idx").toInt();
        }
        std::error_code ec;
        const auto key = std::make_tuple(step, batches, std::filesystem::last_write_time(p, ec));
        if (best.empty() || key > best_key) {
          best = p.string();
          best_key = key;
        }
      } catch (const std::exception& e) {
        if (trainer.is_global_zero()) {
          std::cerr << "volt: ModelCheckpoint: \"last\" passes over " << p.string() << ", which does not read: "
                    << e.what() << "\n";
        }
      }
    }
    return best;
  }

  /// Whether the running fit resumed from `path`.
  template <class T>
  static bool resumed_from(const T& trainer, const std::string& path) {
    return !trainer.ckpt_path().empty() && checkpoint::same_path(path, trainer.ckpt_path());
  }

  /// Whether `previous` may be deleted: a file inside its own folder, and not the one the fit resumed from.
  template <class T>
  bool may_remove(const T& trainer, const std::string& previous) const {
    if (previous.empty() || resumed_from(trainer, previous)) return false;
    std::error_code ec;
    const auto file = std::filesystem::weakly_canonical(std::filesystem::absolute(previous), ec);
    return checkpoint::same_path(file.parent_path().string(), dirpath_);
  }

  /// A fresh fit's warning (rank zero, once) when its folder already holds checkpoints: the files, and what
  /// becomes of them.
  void warn_if_folder_holds_checkpoints() const {
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dirpath_, ec)) {
      if (checkpoint::is_checkpoint_entry(e) && e.path().extension() == kExtension) {
        names.push_back(e.path().filename().string());
      }
    }
    if (names.empty()) return;
    std::sort(names.begin(), names.end());
    std::ostringstream s;
    s << "volt: ModelCheckpoint: the checkpoint folder " << dirpath_ << " already holds " << names.size()
      << " checkpoint" << (names.size() == 1 ? "" : "s") << " of another run (";
    for (std::size_t i = 0; i < names.size() && i < 5; ++i) s << (i > 0 ? ", " : "") << names[i];
    if (names.size() > 5) s << " and " << names.size() - 5 << " more";
    s << ") and this fit starts afresh: ";
    if (options_.enable_version_counter) {
      s << "it replaces none of them, naming its own files -v1, -v2, ... where a name is taken (last.ckpt -> "
           "last-v1.ckpt).";
    } else {
      s << "enable_version_counter=false, so it replaces any of them whose name it writes.";
    }
    s << " To go on from them, fit(..., \"last\"); to keep runs apart, give each its own dirpath or default_root_dir.\n";
    std::cerr << s.str();
  }

  bool better(double a, double b) const { return options_.mode == Mode::min ? a < b : a > b; }
  double worst() const {
    return options_.mode == Mode::min ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  }

  /// A path for `name` in the folder: an existing file this callback did not write (nor the fit resumed from) gets
  /// -v1, -v2, ...
  /// Rank zero's answer on every rank (each rank's view of the folder may differ where it is not shared).
  template <class T>
  std::string free_path(T& trainer, const std::string& name) const {
    const std::string path =
        checkpoint::free_checkpoint_path(dirpath_, name, options_.enable_version_counter, [&](const std::string& p) {
          return best_k_.count(p) > 0 || p == best_model_path_ || p == last_model_path_ || resumed_from(trainer, p);
        });
    return trainer.strategy().host_all_gather(path)[0];
  }

  /// At an epoch's (or its validation's) end: the top k every every_n_epochs epochs, `last.ckpt` every time.
  template <class T>
  void save_at_epoch_end(T& trainer) {
    const bool top_k = every_n_epochs_ >= 1 && (trainer.current_epoch() + 1) % every_n_epochs_ == 0;
    if (top_k || options_.save_last) save(trainer, top_k);
  }

  /// A save: the top k (or the latest) when `top_k`, and `last.ckpt` when save_last.
  template <class T>
  void save(T& trainer, bool top_k = true) {
    last_global_step_saved_ = trainer.global_step();
    const auto metrics = trainer.callback_metric_values();
    std::vector<std::string> remove;
    std::string written;
    if (top_k && options_.save_top_k != 0) {
      const std::string path = free_path(trainer, format_name(trainer.current_epoch(), trainer.global_step(), metrics));
      if (!options_.monitor) {
        if (options_.save_top_k == 1 && !best_model_path_.empty() && best_model_path_ != path) remove.push_back(best_model_path_);
        best_model_path_ = path;
        written = path;
      } else {
        auto it = metrics.find(*options_.monitor);
        if (it == metrics.end()) {
          std::ostringstream s;
          s << "volt: ModelCheckpoint monitors \"" << *options_.monitor << "\", which was not logged. Logged:";
          for (const auto& [k, v] : metrics) s << " " << k;
          s << ". Log it with ctx.log(\"" << *options_.monitor << "\", ...) or change monitor.";
          // Before the fit's first validation a validation metric cannot be there yet: warn once, rank nothing.
          if (!trainer.has_validation() || trainer.validation_has_run()) throw std::runtime_error(s.str());
          if (global_zero_ && !warned_missing_monitor_) {
            std::cerr << s.str() << " (A warning until the fit's first validation has run; until then step "
                      << trainer.global_step() << "'s and later saves keep no best k.)\n";
          }
          warned_missing_monitor_ = true;
        } else {
          const double current = std::isfinite(it->second) ? it->second : worst();
          const bool full = options_.save_top_k > 0 && static_cast<int64_t>(best_k_.size()) >= options_.save_top_k;
          // Saving is collective: the ranks write only when all agree (values logged without sync_dist may differ).
          if (trainer.strategy().reduce_boolean_decision(!full || better(current, kth_value_), /*all=*/true)) {
            if (full) {
              remove.push_back(kth_path_);
              best_k_.erase(kth_path_);
            }
            best_k_[path] = current;
            written = path;
            update_best();
          }
        }
      }
    }
    std::string last;
    if (options_.save_last) last = free_path(trainer, kLastName);
    if (!last.empty()) last_model_path_ = last;  // before the first write: every file of this save names it
    std::vector<std::string> doomed;  // deleted once the new files are in place (rank zero)
    for (const auto& p : remove) {
      if (p == written || p == last || !trainer.is_global_zero() || !may_remove(trainer, p)) continue;
      doomed.push_back(p);
      doomed.push_back(checkpoint::weights_beside(p));  // whichever run wrote it: it goes with its checkpoint
    }
    std::string said;
    if (options_.verbose && !written.empty()) {
      said = "ModelCheckpoint: saved " + written + " (epoch " + std::to_string(trainer.current_epoch()) + ", step " +
             std::to_string(trainer.global_step()) + ")\n";
    }
    auto done = [doomed, said] {
      for (const auto& p : doomed) checkpoint::remove_atomically(p);  // a file, or a sharded checkpoint's folder
      std::cout << said;
    };
    // What saves and deletions cut short (a killed job) left behind goes before this save writes (rank zero).
    if (trainer.is_global_zero()) checkpoint::remove_stale_temporaries(dirpath_);
    std::vector<std::string> paths;  // one state, serialised once, to each (nothing to delete or say when none)
    for (const auto& p : {written, last}) {
      if (!p.empty()) paths.push_back(p);
    }
    if (paths.empty()) return;
    trainer.save_checkpoint(paths, {.weights_only = options_.save_weights_only, .async_save = options_.async_save,
                                    .safetensors = options_.save_safetensors, .done = done});
  }

  void update_best() {
    kth_path_.clear();
    best_model_path_.clear();
    kth_value_ = best_k_.empty() ? worst() : -worst();
    best_score_ = std::numeric_limits<double>::quiet_NaN();
    for (const auto& [path, score] : best_k_) {
      if (best_model_path_.empty() || better(score, best_score_)) {
        best_model_path_ = path;
        best_score_ = score;
      }
      if (kth_path_.empty() || better(kth_value_, score)) {
        kth_path_ = path;
        kth_value_ = score;
      }
    }
  }

  Options options_;
  int64_t every_n_epochs_ = 1;
  std::string dirpath_;
  std::map<std::string, double> best_k_;
  std::string best_model_path_, kth_path_, last_model_path_;
  double best_score_ = std::numeric_limits<double>::quiet_NaN();
  double kth_value_ = 0.0;
  int64_t last_global_step_saved_ = 0;  // as Lightning: nothing to save before the first step
  bool global_zero_ = true;               // this process prints (set at setup)
  bool warned_missing_monitor_ = false;   // the missing-monitor warning was given in this fit
};

}  // namespace volt
