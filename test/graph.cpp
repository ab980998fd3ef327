// Graph mode (Graphed<...>): on the CPU through a graph type that runs the captured step again at each replay, on
// both lanes; with CUDA graphs on a GPU ([.gpu]). Against the eager Trainer with the same fused optimizer.

#include "common.hpp"

#include <volt/optim.hpp>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

// ---- graph mode (Graphed<...>), on the CPU through a graph type that runs the captured step again at each replay.
// CUDA graphs run only on a GPU ([.gpu] below); this graph type keeps everything else of graph mode honest on both
// lanes: warm-up, the variants of accumulation, the static batch, the log calls read back after each replay, the
// device-side learning rate, clipping without host reads, and the eager last batch.

namespace {
/// A graph type whose capture records the step and whose replay runs it again (its host code included). Counts both.
struct RerunGraph {
  static constexpr bool available = true;
  static inline int captures = 0, replays = 0;
  template <class F>
  void run_eager(const c10::Device&, F&& f) {
    f();
  }
  template <class F>
  void capture(const c10::Device&, F&& f, const RerunGraph*) {
    ++captures;
    body_ = std::forward<F>(f);
  }
  void replay() {
    ++replays;
    body_();
  }
  std::function<void()> body_;
};
/// The CPU with that graph type (an accelerator of one's own takes part in the rules as the GPU does).
struct RerunCPU : volt::CPU {
  using graph_type = RerunGraph;
};

/// A regressor that logs every step and returns AdamW (power-of-two rates: the float32 rate tensor graph mode reads
/// holds them exactly) with a StepLR stepped per optimizer step.
struct GraphNetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  GraphNetImpl() {
    torch::manual_seed(21);
    a = register_module("a", torch::nn::Linear(4, 16));
    b = register_module("b", torch::nn::Linear(16, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    const auto loss = vt::mse(b(torch::tanh(a(batch.data))), batch.target);
    ctx.log("loss", loss, {.prog_bar = true, .on_step = true, .on_epoch = true});
    ctx.log("peak", loss.detach() * 2, {.on_step = false, .on_epoch = true, .reduce = volt::Reduce::max});
    return loss;
  }
  volt::OptimizerConfigOf<volt::optim::AdamW> configure_optimizers() {
    auto opt = std::make_shared<volt::optim::AdamW>(parameters(), torch::optim::AdamWOptions(1.0 / 64).amsgrad(true));
    return {opt, std::make_shared<torch::optim::StepLR>(*opt, 3, 0.5), volt::Interval::step};
  }
};
TORCH_MODULE(GraphNet);

/// Every batch's loss as on_train_batch_end receives it (the tensors kept, read when the fit is over), and the logged
/// loss of every optimizer step as a logger receives it (log_every_n_steps = 1).
struct StepValues {
  std::vector<torch::Tensor> kept;
  std::vector<double> loss, logged;
  template <class T, class M, class B>
  void on_train_batch_end(T&, M&, const torch::Tensor& l, const B&, int64_t) {
    kept.push_back(l);
  }
  template <class T, class M>
  void on_fit_end(T&, M&) {
    for (const auto& l : kept) loss.push_back(l.template item<double>());
  }
  void log_metrics(const std::map<std::string, double>& metrics, int64_t) {
    if (metrics.count("loss_step")) logged.push_back(metrics.at("loss_step"));
  }
};

/// A fit of `epochs` epochs on 44 samples in batches of 8 (the last of each epoch has 4), accumulating 2 batches per
/// step and clipping the norm to 0.5, on accelerator `A`; resumed from `resume` and saved to `save` when given.
template <class A>
std::pair<std::vector<torch::Tensor>, StepValues> graph_fit(int epochs, std::map<std::string, double>* metrics = nullptr,
                                                            const std::string& resume = "",
                                                            const std::string& save = "") {
  GraphNet m;
  auto [x, y] = vt::regression_data(44);
  volt::data::TensorLoader loader(x, y, {.batch_size = 8});
  auto t = volt::make_trainer<volt::SingleDevice, volt::Fp32, A>(
      {.max_epochs = epochs, .accumulate_grad_batches = 2, .gradient_clip_val = 0.5, .log_every_n_steps = 1},
      StepValues{});
  resume.empty() ? t.fit(m, loader) : t.fit(m, loader, resume);
  if (!save.empty()) t.save_checkpoint(save);
  if (metrics != nullptr) *metrics = t.callback_metric_values();
  std::vector<torch::Tensor> weights;
  for (const auto& p : m->parameters()) weights.push_back(p.detach().clone());
  return {weights, t.template callback<StepValues>()};
}
}  // namespace

TEST_CASE("graph mode trains as the eager Trainer does: accumulation, clipping, a scheduler, the last batch", "[graph]") {
  if (!volt::detail::has_fused_optimizer_kernels) {  // LibTorch 1.13: no step that reads nothing on the host
    GraphNet m;
    m->a->weight.sum().backward();
    auto opt = m->configure_optimizers().optimizer;
    CHECK_THROWS_WITH(opt->step_on_device(), Contains("needs LibTorch's fused kernels (LibTorch >= 2.4"));
    return;
  }
  RerunGraph::captures = RerunGraph::replays = 0;
  std::map<std::string, double> eager_metrics, graph_metrics;
  const auto [eager, eager_steps] = graph_fit<volt::CPU>(3, &eager_metrics);
  const auto [graphed, graph_steps] = graph_fit<volt::Graphed<RerunCPU>>(3, &graph_metrics);
  // 18 batches: 3 warm-up batches and the 3 epochs' short last batches run eagerly, the other 12 are replays of
  // 2 captured variants (a window's first batch, and its last).
  CHECK(RerunGraph::captures == 2);
  CHECK(RerunGraph::replays == 12);
  REQUIRE(eager.size() == graphed.size());
  for (std::size_t i = 0; i < eager.size(); ++i) CHECK(torch::equal(graphed[i], eager[i]));
  CHECK(!torch::equal(graphed[0], GraphNet()->a->weight));
  REQUIRE(graph_steps.loss.size() == 18);
  CHECK(graph_steps.loss == eager_steps.loss);  // every batch's loss, replays included
  REQUIRE(graph_steps.logged.size() == 9);
  CHECK(graph_steps.logged == eager_steps.logged);  // and what ctx.log recorded, read back after each replay
  CHECK(graph_metrics == eager_metrics);        // the epoch mean and max, the last step's value
  CHECK(graph_metrics.count("peak") == 1);
}

TEST_CASE("graph mode refuses detect_anomaly, which reads gradients on the host", "[graph][config]") {
  CHECK_THROWS_WITH((volt::Trainer<volt::SingleDevice, volt::Fp32, volt::Graphed<RerunCPU>>({.detect_anomaly = true})),
                    StartsWith("volt: detect_anomaly=true with graph mode"));
}

TEST_CASE("graph mode: a checkpoint taken in graph mode resumes in graph mode as if never stopped", "[graph]") {
  if (!volt::detail::has_fused_optimizer_kernels) return;  // said in the test above
  const std::string ckpt = (scratch("graph-resume") / "one.ckpt").string();
  const auto whole = graph_fit<volt::Graphed<RerunCPU>>(3).first;
  graph_fit<volt::Graphed<RerunCPU>>(1, nullptr, "", ckpt);
  const auto resumed = graph_fit<volt::Graphed<RerunCPU>>(3, nullptr, ckpt).first;
  for (std::size_t i = 0; i < whole.size(); ++i) CHECK(torch::equal(resumed[i], whole[i]));
}

TEST_CASE("graph mode: a batch of another shape before the epoch's last is an error that says so", "[graph]") {
  if (!volt::detail::has_fused_optimizer_kernels) return;
  auto [x, y] = vt::regression_data(36);
  std::vector<torch::data::Example<>> batches;
  for (auto [from, to] : {std::pair{0, 8}, {8, 16}, {16, 24}, {24, 32}, {32, 34}, {34, 36}}) {
    batches.push_back({x.slice(0, from, to), y.slice(0, from, to)});
  }
  GraphNet m;
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::Graphed<RerunCPU>> t({.max_epochs = 1});
  CHECK_THROWS_WITH(t.fit(m, batches), Contains("training batch 4 of epoch 0 has tensors of shapes [[2, 4], [2, 1]] "
                                                "but the step was captured for [[8, 4], [8, 1]]"));
}

namespace {
/// GraphNet on batches laid out otherwise: a map of tensors (a rebuilt unordered map iterates in another order), and
/// a pair whose second member, not a tensor, weighs the loss.
struct MapNet : GraphNetImpl {
  torch::Tensor training_step(const std::unordered_map<std::string, torch::Tensor>& b, volt::Context& ctx) {
    return GraphNetImpl::training_step({b.at("x"), b.at("y")}, ctx);
  }
};
struct WeightedNet : GraphNetImpl {
  torch::Tensor training_step(const std::pair<torch::data::Example<>, double>& b, volt::Context& ctx) {
    return GraphNetImpl::training_step(b.first, ctx) * b.second;
  }
};

/// Two epochs of `Net` over `batches` on accelerator `A`; the trained weights.
template <class A, class Net, class B>
std::vector<torch::Tensor> fit_batches(std::vector<B> batches) {
  Net m;
  volt::Trainer<volt::SingleDevice, volt::Fp32, A> t({.max_epochs = 2});
  t.fit(m, batches);
  std::vector<torch::Tensor> weights;
  for (const auto& p : m.parameters()) weights.push_back(p.detach().clone());
  return weights;
}

/// 6 batches of 8 rows, each with the weight `weights` gives it.
std::vector<std::pair<torch::data::Example<>, double>> weighted_batches(const std::vector<double>& weights) {
  auto [x, y] = vt::regression_data(48);
  std::vector<std::pair<torch::data::Example<>, double>> out;
  for (int64_t i = 0; i < 6; ++i) out.push_back({{x.slice(0, 8 * i, 8 * i + 8), y.slice(0, 8 * i, 8 * i + 8)}, weights[i]});
  return out;
}
}  // namespace

TEST_CASE("graph mode copies a map batch's tensors in by key, whatever order the static batch's map iterates in",
          "[graph]") {
  if (!volt::detail::has_fused_optimizer_kernels) return;
  auto [x, y] = vt::regression_data(48);
  std::vector<std::unordered_map<std::string, torch::Tensor>> batches;
  for (int64_t i = 0; i < 6; ++i) batches.push_back({{"x", x.slice(0, 8 * i, 8 * i + 8)}, {"y", y.slice(0, 8 * i, 8 * i + 8)}});
  RerunGraph::captures = RerunGraph::replays = 0;
  const auto eager = fit_batches<volt::CPU, MapNet>(batches);
  const auto graphed = fit_batches<volt::Graphed<RerunCPU>, MapNet>(batches);
  CHECK(RerunGraph::replays == 9);  // 12 batches, 3 of them the warm-up
  for (std::size_t i = 0; i < eager.size(); ++i) CHECK(torch::equal(graphed[i], eager[i]));
}

TEST_CASE("graph mode: a batch whose values other than tensors differ runs eagerly as the epoch's last, else fails",
          "[graph]") {
  if (!volt::detail::has_fused_optimizer_kernels) return;
  RerunGraph::captures = RerunGraph::replays = 0;
  const auto batches = weighted_batches({1, 1, 1, 1, 1, 0.5});
  const auto eager = fit_batches<volt::CPU, WeightedNet>(batches);
  const auto graphed = fit_batches<volt::Graphed<RerunCPU>, WeightedNet>(batches);
  CHECK(RerunGraph::replays == 7);  // epoch 0's batches 3 and 4 (0 to 2 warm up), epoch 1's 0 to 4; each last runs eagerly
  for (std::size_t i = 0; i < eager.size(); ++i) CHECK(torch::equal(graphed[i], eager[i]));
  CHECK_THROWS_WITH((fit_batches<volt::Graphed<RerunCPU>, WeightedNet>(weighted_batches({1, 1, 1, 1, 0.5, 1}))),
                    Contains("training batch 4 of epoch 0 is laid out as ({t, t}, 0.5) but the step was captured for "
                             "({t, t}, 1)"));
}

#if VOLT_WITH_CUDA
// ---- graph mode on a GPU, with CUDA graphs (CTest gpu; skipped without a device) ----

namespace {
double largest_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, ((a[i].cpu() - b[i].cpu()).abs() / (b[i].cpu().abs() + 1e-12)).max().item<double>());
  }
  return d;
}


/// Fp16Mixed for 2 epochs of 6 batches, where batch 4 of the first epoch (a replay in graph mode) holds a value that
/// overflows float16, so its step is skipped and the scale backs off; a growth interval of 3 makes it grow too.
template <class A>
std::pair<std::vector<torch::Tensor>, vt::ScaleRecorder> fp16_fit() {
  GraphNet m;
  auto [x, y] = vt::regression_data(48);
  x[33][0] = 1e6;  // batch 4 (rows 32..39) of the first epoch
  volt::data::TensorLoader loader(x, y, {.batch_size = 8});
  auto t = volt::make_trainer<volt::SingleDevice, volt::Fp16Mixed, A>({.max_epochs = 2}, vt::ScaleRecorder{});
  t.precision() = volt::Fp16Mixed(volt::GradScalerOptions{.init_scale = 1024, .growth_interval = 3});
  t.fit(m, loader);
  std::vector<torch::Tensor> weights;
  for (const auto& p : m->parameters()) weights.push_back(p.detach().cpu().clone());
  return {weights, t.template callback<vt::ScaleRecorder>()};
}

struct SyncingNetImpl : GraphNetImpl {
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto loss = GraphNetImpl::training_step(batch, ctx);
    if (loss.item<double>() < 0) loss = -loss;  // a host wait: cannot be captured
    return loss;
  }
};
TORCH_MODULE(SyncingNet);
}  // namespace

TEST_CASE("GPU: graph mode trains as the eager GPU Trainer with the same fused optimizer", "[.gpu]") {
  RerunGraph::captures = 0;
  std::map<std::string, double> eager_metrics, graph_metrics;
  const auto [eager, eager_steps] = graph_fit<volt::GPU>(3, &eager_metrics);
  const auto [graphed, graph_steps] = graph_fit<volt::Graphed<volt::GPU>>(3, &graph_metrics);
  const double diff = largest_difference(graphed, eager);
  WARN("graph mode against eager on CUDA, AdamW, accumulation 2, clipping, StepLR, a short last batch: largest "
       "relative weight difference " << diff << (diff == 0 ? " (bitwise equal)" : ""));
  CHECK(diff <= 1e-6);
  REQUIRE(graph_steps.loss.size() == eager_steps.loss.size());
  for (std::size_t i = 0; i < graph_steps.loss.size(); ++i) {
    CHECK(graph_steps.loss[i] == Approx(eager_steps.loss[i]).epsilon(1e-6));
  }
  CHECK(graph_metrics.at("peak") == Approx(eager_metrics.at("peak")).epsilon(1e-6));
}

TEST_CASE("GPU: graph mode with Fp16Mixed skips the step with an inf and keeps the eager scale sequence", "[.gpu]") {
  const auto [eager, eager_scales] = fp16_fit<volt::GPU>();
  const auto [graphed, graph_scales] = fp16_fit<volt::Graphed<volt::GPU>>();
  CHECK(graph_scales.skipped == eager_scales.skipped);
  CHECK(graph_scales.scales == eager_scales.scales);
  REQUIRE(eager_scales.skipped.size() == 12);
  CHECK(eager_scales.skipped[4]);  // the injected inf, a replayed step in graph mode
  const double diff = largest_difference(graphed, eager);
  WARN("Fp16Mixed, graph mode against eager: largest relative weight difference " << diff);
  CHECK(diff <= 1e-5);
}

TEST_CASE("GPU: a checkpoint taken in graph mode resumes in graph mode bit for bit", "[.gpu]") {
  const std::string ckpt = (scratch("gpu-graph-resume") / "one.ckpt").string();
  const auto whole = graph_fit<volt::Graphed<volt::GPU>>(3).first;
  graph_fit<volt::Graphed<volt::GPU>>(1, nullptr, "", ckpt);
  const auto resumed = graph_fit<volt::Graphed<volt::GPU>>(3, nullptr, ckpt).first;
  for (std::size_t i = 0; i < whole.size(); ++i) CHECK(torch::equal(resumed[i].cpu(), whole[i].cpu()));
}

TEST_CASE("GPU: a host wait inside training_step fails the capture with a message that names it", "[.gpu]") {
  SyncingNet m;
  auto [x, y] = vt::regression_data(48);
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::Graphed<volt::GPU>> t({.max_epochs = 1});
  CHECK_THROWS_WITH(t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8})),
                    Contains("capturing the training step failed in epoch 0, batch 3") && Contains("no .item()"));
}
#endif  // VOLT_WITH_CUDA
