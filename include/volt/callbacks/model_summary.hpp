#pragma once
/// \file
/// `volt::summarize(module)` and the `ModelSummary` callback: each submodule's name, type, parameter count and
/// mode, then trainable, non-trainable and total parameters and their size, as Lightning prints its summary at the
/// start of a fit.

#include "volt/callbacks/concept.hpp"

#include <torch/nn/module.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <ostream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace volt {

/// What a model holds, by submodule and in total. Parameters shared between submodules count once in the totals.
struct ModelSummaryTable {
  struct Row {
    /// Dotted name (`encoder.fc1`).
    std::string name;
    /// The module's type, without namespaces and LibTorch's `Impl` suffix (`Linear`).
    std::string type;
    /// Its parameters, its submodules' included.
    int64_t params = 0;
    /// Whether it is in training mode.
    bool training = true;
  };
  std::vector<Row> rows;
  int64_t trainable_params = 0;
  /// Parameters that do not require gradients (frozen).
  int64_t non_trainable_params = 0;
  int64_t total_params() const { return trainable_params + non_trainable_params; }
  /// Bytes of every parameter at its dtype, in MB (1e6 bytes).
  double total_size_mb = 0.0;
  /// Modules in training and in evaluation mode (the model itself and every submodule).
  int64_t modules_in_train_mode = 0, modules_in_eval_mode = 0;

  /// The table as Lightning prints it.
  std::string to_string() const;
  /// The table in markdown (TensorBoardLogger's text summary).
  std::string to_markdown() const;
};

/// A count as Lightning writes it: `160`, `1.2 K`, `206 K`, `1.5 M` (its `get_human_readable_count`).
inline std::string human_readable_count(int64_t n) {
  static const char* const labels[] = {"", "K", "M", "B", "T"};  // Lightning pads "123" with a label " "
  const int digits = n > 0 ? static_cast<int>(std::floor(std::log10(static_cast<double>(n)))) + 1 : 1;
  const int groups = std::min<int>((digits + 2) / 3, 5);
  const double scaled = static_cast<double>(n) * std::pow(10.0, -3.0 * (groups - 1));
  std::string s;
  if (groups - 1 < 1 || scaled >= 100.0) {  // an integer with thousands separators ("5,000 T")
    const std::string digits_text = std::to_string(static_cast<long long>(scaled));
    for (std::size_t i = 0; i < digits_text.size(); ++i) {
      if (i > 0 && (digits_text.size() - i) % 3 == 0) s += ',';
      s += digits_text[i];
    }
  } else {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", scaled);
    s = buf;
  }
  return groups > 1 ? s + " " + labels[groups - 1] : s;
}

namespace detail {
/// `torch::nn::LinearImpl` -> `Linear`; a user's `Net` stays `Net`.
inline std::string short_module_type(std::string name) {
  if (const auto colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.ends_with("Impl")) name.resize(name.size() - 4);
  return name;
}
inline int64_t distinct_numel(const std::vector<torch::Tensor>& params) {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const auto& p : params) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  }
  return n;
}
inline void summary_rows(const torch::nn::Module& m, const std::string& prefix, int depth, int max_depth,
                         std::vector<ModelSummaryTable::Row>& rows) {
  for (const auto& item : m.named_children()) {
    const std::string name = prefix.empty() ? item.key() : prefix + "." + item.key();
    const auto& child = *item.value();
    rows.push_back({name, short_module_type(child.name()), distinct_numel(child.parameters()), child.is_training()});
    if (max_depth < 0 || depth + 1 < max_depth) summary_rows(child, name, depth + 1, max_depth, rows);
  }
}
}  // namespace detail

/// Summarizes `module` down to `max_depth` levels of submodules (1: the top-level ones; -1: all).
inline ModelSummaryTable summarize(const torch::nn::Module& module, int max_depth = 1) {
  if (max_depth < -1) {
    throw std::invalid_argument("volt: summarize max_depth=" + std::to_string(max_depth) +
                                " is not allowed: give -1 (every level), 0 (totals only) or a depth >= 1.");
  }
  ModelSummaryTable t;
  if (max_depth != 0) detail::summary_rows(module, "", 0, max_depth, t.rows);
  std::set<const void*> seen;
  for (const auto& p : module.parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    (p.requires_grad() ? t.trainable_params : t.non_trainable_params) += p.numel();
    t.total_size_mb += static_cast<double>(p.numel()) * static_cast<double>(p.element_size()) / 1e6;
  }
  // (include_self would need the module in a shared_ptr: a module on the stack counts itself here)
  ++(module.is_training() ? t.modules_in_train_mode : t.modules_in_eval_mode);
  for (const auto& m : module.modules(/*include_self=*/false)) {
    ++(m->is_training() ? t.modules_in_train_mode : t.modules_in_eval_mode);
  }
  return t;
}

inline std::string ModelSummaryTable::to_string() const {
  std::vector<std::vector<std::string>> cells{{"", "Name", "Type", "Params", "Mode"}};
  for (std::size_t i = 0; i < rows.size(); ++i) {
    cells.push_back({std::to_string(i), rows[i].name, rows[i].type, human_readable_count(rows[i].params),
                     rows[i].training ? "train" : "eval"});
  }
  std::vector<std::size_t> width(5, 0);
  for (const auto& r : cells) {
    for (std::size_t c = 0; c < 5; ++c) width[c] = std::max(width[c], r[c].size());
  }
  std::ostringstream out;
  std::size_t line = 0;
  for (std::size_t ri = 0; ri < cells.size(); ++ri) {
    std::ostringstream row;
    for (std::size_t c = 0; c < 5; ++c) {
      row << (c == 0 ? "" : " | ") << cells[ri][c] << std::string(width[c] - cells[ri][c].size(), ' ');
    }
    const std::string s = row.str();
    line = std::max(line, s.size());
    out << s << "\n";
    if (ri == 0) out << std::string(s.size(), '-') << "\n";
  }
  out << std::string(line, '-') << "\n";
  auto footer = [&](const std::string& value, const char* what) {
    out << value << std::string(value.size() < 10 ? 10 - value.size() : 1, ' ') << what << "\n";
  };
  char size[32];
  std::snprintf(size, sizeof size, "%.3f", total_size_mb);
  footer(human_readable_count(trainable_params), "Trainable params");
  footer(human_readable_count(non_trainable_params), "Non-trainable params");
  footer(human_readable_count(total_params()), "Total params");
  footer(size, "Total estimated model params size (MB)");
  footer(std::to_string(modules_in_train_mode), "Modules in train mode");
  footer(std::to_string(modules_in_eval_mode), "Modules in eval mode");
  return out.str();
}

inline std::string ModelSummaryTable::to_markdown() const {
  std::ostringstream out;
  out << "| | Name | Type | Params | Mode |\n|---|---|---|---|---|\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    out << "| " << i << " | " << rows[i].name << " | " << rows[i].type << " | " << rows[i].params << " | "
        << (rows[i].training ? "train" : "eval") << " |\n";
  }
  char size[32];
  std::snprintf(size, sizeof size, "%.3f", total_size_mb);
  out << "\nTrainable params: " << trainable_params << "  \nNon-trainable params: " << non_trainable_params
      << "  \nTotal params: " << total_params() << "  \nTotal estimated model params size (MB): " << size << "\n";
  return out.str();
}

/// Prints the module's summary (`summarize(module, max_depth)`) when a fit starts, on rank zero, as Lightning's
/// ModelSummary callback. `summary()` keeps the last one.
class ModelSummary {
 public:
  struct Options {
    /// Levels of submodules listed (1: the top-level ones; -1: all; 0: totals only).
    int max_depth = 1;
  };
  ModelSummary() = default;
  explicit ModelSummary(Options options, std::ostream* out = &std::cout) : options_(options), out_(out) {
    if (options_.max_depth < -1) {
      throw std::invalid_argument("volt: ModelSummary max_depth=" + std::to_string(options_.max_depth) +
                                  " is not allowed: give -1 (every level), 0 (totals only) or a depth >= 1.");
    }
  }

  template <class T, class M>
  void on_fit_start(T& trainer, M& module) {
    summary_ = summarize(module, options_.max_depth);
    if (trainer.is_global_zero() && out_ != nullptr) *out_ << summary_.to_string() << std::flush;
  }

  /// The summary printed at the last fit's start.
  const ModelSummaryTable& summary() const { return summary_; }

 private:
  Options options_;
  std::ostream* out_ = &std::cout;
  ModelSummaryTable summary_;
};

}  // namespace volt
