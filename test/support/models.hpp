#pragma once
// Small models, data and recorders shared by the test files; Catch-free, so process drivers and compile-only
// tests can use them too (test/common.hpp adds Catch for the Catch test files).

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace vt {

/// y = x·w + b + noise, 4 features; deterministic for a seed.
inline std::pair<torch::Tensor, torch::Tensor> regression_data(int64_t n, uint64_t seed = 7) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto x = torch::randn({n, 4}, gen);
  auto w = torch::tensor({{1.5}, {-2.0}, {0.5}, {3.0}});
  auto y = x.matmul(w) + 0.1 * torch::randn({n, 1}, gen) + 0.25;
  return {x, y};
}

/// Mean squared error from basic ops (LibTorch 1.13 has no bfloat16 mse_loss kernel on CPU).
inline torch::Tensor mse(const torch::Tensor& pred, const torch::Tensor& target) {
  return (pred - target).pow(2).mean();
}

/// A linear regressor trained with plain SGD (no momentum), so updates are easy to reproduce by hand.
struct RegressorImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  double lr;
  explicit RegressorImpl(double lr_ = 0.05, uint64_t seed = 1) : lr(lr_) {
    torch::manual_seed(seed);
    lin = register_module("lin", torch::nn::Linear(4, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return lin(x); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto loss = mse(forward(b.data), b.target);
    ctx.log("train_loss", loss);
    return loss;
  }
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("val_loss", mse(forward(b.data), b.target));
  }
  void test_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("test_loss", mse(forward(b.data), b.target));
  }
  torch::Tensor predict_step(const torch::data::Example<>& b, volt::Context&) { return forward(b.data); }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(lr)); }
};
TORCH_MODULE(Regressor);

/// Sample i is (x = [i, i], y = i): a batch says which samples it holds. A torch::data dataset.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  int64_t n;
  explicit IndexDataset(int64_t n_) : n(n_) {}
  torch::data::Example<> get(size_t i) override {
    return {torch::full({2}, static_cast<float>(i)), torch::tensor(static_cast<int64_t>(i))};
  }
  c10::optional<size_t> size() const override { return static_cast<size_t>(n); }
};

/// Copies every parameter and buffer of `from` into `to` (same architecture).
inline void copy_weights(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard g;
  auto a = from.named_parameters(), b = to.named_parameters();
  for (auto& p : a) b[p.key()].copy_(p.value());
  auto ab = from.named_buffers(), bb = to.named_buffers();
  for (auto& p : ab) bb[p.key()].copy_(p.value());
}

inline torch::Tensor flat_params(torch::nn::Module& m) {
  std::vector<torch::Tensor> v;
  for (auto& p : m.parameters()) v.push_back(p.detach().to(torch::kFloat64).flatten());
  return torch::cat(v);
}

/// Records every hook it sees, to check order and counts.
struct Recorder {
  std::vector<std::string>* log;
  int64_t train_batches = 0, val_batches = 0, sanity_batches = 0, val_runs = 0, train_epochs = 0;
  void add(const std::string& s) {
    if (log) log->push_back("cb:" + s);
  }
  void on_fit_start(auto&, auto&) { add("on_fit_start"); }
  void on_fit_end(auto&, auto&) { add("on_fit_end"); }
  void on_sanity_check_start(auto&, auto&) { add("on_sanity_check_start"); }
  void on_sanity_check_end(auto&, auto&) { add("on_sanity_check_end"); }
  void on_train_start(auto&, auto&) { add("on_train_start"); }
  void on_train_end(auto&, auto&) { add("on_train_end"); }
  void on_train_epoch_start(auto&, auto&) { add("on_train_epoch_start"); }
  void on_train_epoch_end(auto&, auto&) {
    add("on_train_epoch_end");
    ++train_epochs;
  }
  void on_train_batch_start(auto&, auto&, const auto&, int64_t) { add("on_train_batch_start"); }
  void on_train_batch_end(auto&, auto&, const torch::Tensor&, const auto&, int64_t) {
    add("on_train_batch_end");
    ++train_batches;
  }
  void on_validation_start(auto&, auto&) { add("on_validation_start"); }
  void on_validation_end(auto& t, auto&) {
    add("on_validation_end");
    if (!t.sanity_checking()) ++val_runs;
  }
  void on_validation_epoch_start(auto&, auto&) { add("on_validation_epoch_start"); }
  void on_validation_epoch_end(auto&, auto&) { add("on_validation_epoch_end"); }
  void on_validation_batch_start(auto&, auto&, const auto&, int64_t) { add("on_validation_batch_start"); }
  void on_validation_batch_end(auto& t, auto&, const auto&, const auto&, int64_t) {
    add("on_validation_batch_end");
    (t.sanity_checking() ? sanity_batches : val_batches)++;
  }
  void on_before_zero_grad(auto&, auto&, torch::optim::Optimizer&) { add("on_before_zero_grad"); }
  void on_before_backward(auto&, auto&, const torch::Tensor&) { add("on_before_backward"); }
  void on_after_backward(auto&, auto&) { add("on_after_backward"); }
  void on_before_optimizer_step(auto&, auto&, torch::optim::Optimizer&) { add("on_before_optimizer_step"); }
};

// ---- loaders and files ---------------------------------------------------------------------------------------

/// A TensorLoader over (x, y) with the given batch size, shuffle and seed.
inline volt::data::TensorLoader make_loader(const torch::Tensor& x, const torch::Tensor& y, int64_t bs,
                                            bool shuffle = false, uint64_t seed = 0) {
  return volt::data::TensorLoader(x, y, {.batch_size = bs, .shuffle = shuffle, .seed = seed});
}

/// A fresh, empty folder under the system's temporary folder.
inline std::filesystem::path scratch(const std::string& name) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("volt_ckpt_test_" + std::to_string(::getpid())) / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

/// The sample indices (targets) of up to `batches` batches (-1: to the end) of a pass of `loader`.
template <class L>
std::vector<int64_t> take(L& loader, int64_t batches = -1) {
  std::vector<int64_t> out;
  for (auto it = loader.begin(); it != loader.end() && batches != 0; ++it, --batches) {
    auto b = *it;
    const torch::Tensor t = b.target.flatten();
    for (int64_t i = 0; i < t.size(0); ++i) out.push_back(t[i].template item<int64_t>());
  }
  return out;
}

inline std::vector<int64_t> cat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline volt::data::TensorLoader index_loader(int64_t n, volt::data::LoaderOptions o) {
  return volt::data::TensorLoader(torch::arange(n, torch::kFloat32).unsqueeze(1), torch::arange(n), o);
}

inline auto index_dataset_loader(int64_t n, volt::data::LoaderOptions o) {
  return volt::data::DatasetLoader(vt::IndexDataset(n).map(torch::data::transforms::Stack<>()), o);
}

/// The rows of a CSVLogger file, each as its non-empty (column, value) pairs, sorted.
inline std::vector<std::map<std::string, std::string>> csv_rows(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error("no metrics file " + file);
  auto split = [](const std::string& line) {
    std::vector<std::string> out;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) out.push_back(cell);
    if (!line.empty() && line.back() == ',') out.emplace_back();
    return out;
  };
  std::string line;
  std::getline(in, line);
  const auto header = split(line);
  std::vector<std::map<std::string, std::string>> rows;
  while (std::getline(in, line)) {
    const auto cells = split(line);
    std::map<std::string, std::string> row;
    for (std::size_t i = 0; i < cells.size() && i < header.size(); ++i) {
      if (!cells[i].empty()) row[header[i]] = cells[i];
    }
    rows.push_back(std::move(row));
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

inline bool same_weights(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (const auto& p : pa) {
    if (!torch::equal(p.value(), pb[p.key()])) return false;
  }
  auto ba = a.named_buffers(), bb = b.named_buffers();
  for (const auto& p : ba) {
    if (!torch::equal(p.value(), bb[p.key()])) return false;
  }
  return true;
}

/// A callback: the loss scale (Fp16Mixed) after each training batch and whether the batch's step was skipped.
struct ScaleRecorder {
  std::vector<double> scales;
  std::vector<bool> skipped;
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    scales.push_back(trainer.precision().scaler().get_scale());
    skipped.push_back(trainer.precision().scaler().last_step_skipped());
  }
};

/// Sequences of tokens of different lengths: `n` rows of `length + 1` tokens from a vocabulary of `vocab`, and each
/// row's length (3 to `length`); a row's tokens past its length are padding.
inline std::pair<torch::Tensor, torch::Tensor> ragged_tokens(int64_t n, int64_t length, int64_t vocab, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto tokens = torch::randint(vocab, {n, length + 1}, gen);
  auto lengths = torch::randint(3, length + 1, {n}, gen);
  return {tokens, lengths};
}

/// The cross-entropy of next-token prediction at every position of `tokens` ([n, length + 1]) before its row's
/// length, summed, and the count of those positions.
inline std::pair<torch::Tensor, torch::Tensor> masked_token_loss(const torch::Tensor& logits,
                                                                 const torch::Tensor& tokens,
                                                                 const torch::Tensor& lengths) {
  const int64_t t = tokens.size(1) - 1;
  auto mask = (torch::arange(t, lengths.options()).unsqueeze(0) < lengths.unsqueeze(1)).to(logits.scalar_type());
  auto each = torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), tokens.slice(1, 1).reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  return {(each * mask.reshape({-1})).sum(), mask.sum()};
}

/// A tiny language model (an embedding and a linear head) whose training_step's loss is the mean over the batch's
/// real tokens, said with `weigh_loss` when `weighted` (else Lightning's per-batch mean alone); SGD.
struct MaskedLMImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
  bool weighted = true;
  double lr = 0.5;
  explicit MaskedLMImpl(int64_t vocab = 11) {
    torch::manual_seed(4);
    emb = register_module("emb", torch::nn::Embedding(vocab, 8));
    head = register_module("head", torch::nn::Linear(8, vocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return head(torch::tanh(emb(tokens.slice(1, 0, -1)))); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto [sum, count] = masked_token_loss(forward(b.data), b.data, b.target);
    auto loss = sum / count;
    if (weighted) ctx.weigh_loss(count);
    ctx.log("token_loss", loss, {.on_step = false, .on_epoch = true, .batch_size = count.item<int64_t>()});
    return loss;
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(lr)); }
};
TORCH_MODULE(MaskedLM);

/// A file's bytes.
inline std::vector<char> read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// The weight `module.lin` has after each optimizer step, by step, copied to the CPU; placed before ModelCheckpoint,
/// so it runs before that step's save.
struct WeightLog {
  std::map<int64_t, torch::Tensor>* by_step;
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M& module, const torch::Tensor&, const B&, int64_t) {
    (*by_step)[trainer.global_step()] = module.lin->weight.detach().to(torch::kCPU, /*non_blocking=*/false,
                                                                        /*copy=*/true);
  }
};

}  // namespace vt
