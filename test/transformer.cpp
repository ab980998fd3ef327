// What training today's models takes (Catch tag [transformer], CTest transformer): activation checkpointing against
// the plain block (gradients, dropout masks, autocast, memory), the GPT example's model.

#include "common.hpp"

#include "../examples/gpt_hf.hpp"
#include "../examples/gpt_model.hpp"

#include <volt/activation_checkpoint.hpp>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace {

gpt::Config small_config(double dropout = 0.0) {
  return {.vocab = 17, .context = 16, .layers = 3, .heads = 2, .width = 32, .dropout = dropout};
}

/// Every parameter's gradient of `m`, in order.
std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() && !torch::equal(a[i], b[i])) return false;
  }
  return true;
}

/// The loss of `m` (a GPT) on tokens `idx`, next-token targets.
torch::Tensor lm_loss(gpt::GPT& m, const torch::Tensor& idx) {
  auto logits = m->forward(idx.slice(1, 0, -1));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), idx.slice(1, 1).reshape({-1}));
}

/// Forward and backward of a GPT with blocks checkpointed as `which`, from the same weights and random state.
std::pair<torch::Tensor, std::vector<torch::Tensor>> gpt_grads(gpt::Config c, volt::ActivationCheckpointing which,
                                                               const torch::Tensor& idx) {
  torch::manual_seed(5);
  c.checkpointing = which;
  gpt::GPT m(c);
  torch::manual_seed(11);  // the dropout masks
  auto loss = lm_loss(m, idx);
  loss.backward();
  return {loss.detach(), grads_of(*m)};
}

}  // namespace

TEST_CASE("activation_checkpoint: a GPT's gradients equal the plain model's bit for bit, dropout on", "[transformer]") {
  torch::manual_seed(3);
  const auto idx = torch::randint(17, {4, 16});
  for (double dropout : {0.0, 0.2}) {
    const auto [loss0, g0] = gpt_grads(small_config(dropout), {}, idx);
    for (std::size_t every : {1, 2}) {
      INFO("dropout " << dropout << ", every " << every);
      const auto [loss, g] = gpt_grads(small_config(dropout), {.every = every}, idx);
      CHECK(torch::equal(loss, loss0));
      CHECK(all_equal(g, g0));
      // The second runs draw nothing that later code would see: the generator is where the plain run left it.
      const auto after = torch::rand({4});
      gpt_grads(small_config(dropout), {}, idx);
      CHECK(torch::equal(torch::rand({4}), after));
    }
  }
}

TEST_CASE("activation_checkpoint: several inputs and outputs, inputs without gradients, other arguments",
          "[transformer]") {
  torch::manual_seed(4);
  torch::nn::Linear a(6, 6), b(6, 6);
  const auto x0 = torch::randn({3, 6});
  const auto mask = (torch::rand({3, 6}) > 0.3).to(torch::kFloat);  // requires no gradient
  auto fn = [&](const torch::Tensor& x, const torch::Tensor& m, double scale, int64_t shift) {
    auto h = torch::tanh(a(x)) * m * scale;
    return std::tuple<torch::Tensor, torch::Tensor>(b(h) + static_cast<double>(shift), h.sum(1));
  };
  auto run = [&](bool checkpointed, bool input_grad) {
    a->zero_grad();
    b->zero_grad();
    auto x = x0.clone().requires_grad_(input_grad);
    auto [p, q] = checkpointed ? volt::activation_checkpoint(fn, x, mask, 0.5, int64_t{2}) : fn(x, mask, 0.5, 2);
    ((p * p).sum() + q.pow(3).sum()).backward();
    auto g = grads_of(*a);
    for (auto& t : grads_of(*b)) g.push_back(t);
    g.push_back(input_grad ? x.grad().clone() : torch::Tensor());
    return g;
  };
  for (bool input_grad : {true, false}) {
    INFO("input requires grad: " << input_grad);
    const auto plain = run(false, input_grad);
    const auto ckpt = run(true, input_grad);
    CHECK(all_equal(ckpt, plain));
    CHECK(plain.front().defined());  // the parameters got gradients even where the input needs none
  }
  // Only one output used: the other's gradient is simply absent.
  for (auto& p : a->parameters()) p.mutable_grad() = torch::Tensor();
  for (auto& p : b->parameters()) p.mutable_grad() = torch::Tensor();
  auto [p, q] = volt::activation_checkpoint(fn, x0, mask, 0.5, int64_t{2});
  q.sum().backward();
  CHECK(a->weight.grad().defined());
  CHECK_FALSE(b->weight.grad().defined());
}

TEST_CASE("forward_blocks takes a block's TORCH_MODULE holder type as it takes its Impl", "[transformer]") {
  torch::manual_seed(3);
  const gpt::Config c = small_config();
  torch::nn::ModuleList blocks;
  for (int i = 0; i < 3; ++i) blocks->push_back(gpt::Block(c));
  const auto x = torch::randn({2, c.context, c.width});
  torch::Tensor expected = x;
  for (const auto& b : *blocks) expected = b->as<gpt::BlockImpl>()->forward(expected);
  CHECK(torch::equal(volt::forward_blocks<gpt::Block>(blocks, x, volt::ActivationCheckpointing{.every = 2}), expected));
  CHECK(torch::equal(volt::forward_blocks<gpt::Block>(blocks, x, volt::Units{}), expected));
  CHECK(torch::equal(volt::forward_blocks<gpt::BlockImpl>(blocks, x, volt::ActivationCheckpointing{}), expected));
}

TEST_CASE("activation_checkpoint: a plain call without gradients; refusals", "[transformer]") {
  torch::manual_seed(6);
  torch::nn::Linear lin(4, 4);
  const auto x = torch::randn({2, 4}, torch::requires_grad());
  {
    torch::NoGradGuard no_grad;
    auto y = volt::activation_checkpoint(lin, x);
    CHECK_FALSE(y.requires_grad());
    CHECK(torch::equal(y, lin(x)));
  }
  {
    c10::InferenceMode inference;
    CHECK_FALSE(volt::activation_checkpoint(lin, x.detach()).requires_grad());
  }
  // A node of the graph only where something requires gradients.
  auto y = volt::activation_checkpoint(lin, x);
  REQUIRE(y.grad_fn() != nullptr);
  CHECK(y.grad_fn()->name() == "volt::ActivationCheckpointBackward");
  // A second backward: with the graph retained it runs the block again (the gradients add up, as without
  // checkpointing); after a backward that released it, refused.
  auto loss = y.pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  const auto once = x.grad().clone();
  loss.backward();
  CHECK(torch::equal(x.grad(), 2 * once));
  auto sum = volt::activation_checkpoint(lin, x).sum();
  sum.backward();
  CHECK_THROWS_WITH(sum.backward(), Contains("second backward through a checkpointed call"));
  auto y2 = volt::activation_checkpoint(lin, x);
  CHECK_THROWS_WITH(torch::autograd::grad({y2.sum()}, {x}, {}, true, /*create_graph=*/true),
                    Contains("create_graph"));
  // A captured tensor computed outside that requires gradients.
  auto outside = x * 2;
  CHECK_THROWS_WITH(volt::activation_checkpoint([&](const torch::Tensor& in) { return lin(in) + outside; }, x),
                    Contains("computed before the call") && Contains("pass it as an input"));
  // An input changed in place: the second run would start from other values.
  auto y0 = x.detach().clone().requires_grad_(false);
  CHECK_THROWS_WITH(volt::activation_checkpoint([&](const torch::Tensor& in) { return lin(in.mul_(2)); }, y0),
                    Contains("changed its tensor input 0 in place"));
  // Returned as they are: an input and a parameter (leaves of the second run) get their gradients.
  {
    auto [same, weight] = volt::activation_checkpoint(
        [&](const torch::Tensor& in) { return std::tuple<torch::Tensor, torch::Tensor>(in, lin->weight); }, x);
    lin->weight.mutable_grad() = torch::Tensor();
    auto gx_direct = torch::autograd::grad({(3 * same).sum() + weight.sum()}, {x, lin->weight});
    CHECK(torch::equal(gx_direct[0], torch::full_like(x, 3)));
    CHECK(torch::equal(gx_direct[1], torch::ones_like(lin->weight)));
    CHECK_FALSE(lin->weight.grad().defined());  // grad() accumulates nothing, inside the second run neither
    // The parameter as the only output: the second run's one root.
    auto just = volt::activation_checkpoint([&](const torch::Tensor&) { return lin->weight; }, x);
    auto g_only = torch::autograd::grad({(2 * just).sum()}, {lin->weight})[0];
    CHECK(torch::equal(g_only, torch::full_like(lin->weight, 2)));
    CHECK_FALSE(lin->weight.grad().defined());
  }
  // A lambda made in a function that returns before backward: activation_checkpoint keeps its own copy.
  auto through_local = [&] {
    auto local = [&lin](const torch::Tensor& in) { return torch::tanh(lin(in)); };
    return volt::activation_checkpoint(local, x);
  };
  auto gx_local = torch::autograd::grad({through_local().sum()}, {x})[0];
  CHECK(torch::equal(gx_local, torch::autograd::grad({torch::tanh(lin(x)).sum()}, {x})[0]));
  // Passed as an input instead, it works and matches.
  auto with_input = volt::activation_checkpoint(
      [&](const torch::Tensor& in, const torch::Tensor& o) { return lin(in) + o; }, x, outside);
  auto gx = torch::autograd::grad({with_input.sum()}, {x})[0];
  auto gx_plain = torch::autograd::grad({(lin(x) + x * 2).sum()}, {x})[0];
  CHECK(torch::equal(gx, gx_plain));
}

TEST_CASE("activation_checkpoint under autocast to bfloat16 (Bf16Mixed's forward) on the CPU", "[transformer]") {
  torch::manual_seed(3);
  const auto idx = torch::randint(17, {4, 16});
  auto run = [&](volt::ActivationCheckpointing which) {
    torch::manual_seed(5);
    auto c = small_config(0.1);
    c.checkpointing = which;
    gpt::GPT m(c);
    torch::manual_seed(11);
    torch::Tensor loss;
    {
      volt::detail::AutocastGuard autocast(c10::DeviceType::CPU, at::kBFloat16);
      loss = lm_loss(m, idx);
    }
    loss.backward();
    return std::pair(loss.detach(), grads_of(*m));
  };
  const auto [loss0, g0] = run({});
  const auto [loss1, g1] = run({.every = 1});
  CHECK(torch::equal(loss0, loss1));
  // The second run casts the weights again inside its own autocast region: the same bfloat16 values, so the
  // gradients agree to the rounding of bfloat16 arithmetic (bit for bit where the kernels are deterministic).
  for (std::size_t i = 0; i < g0.size(); ++i) {
    INFO("parameter " << i);
    CHECK(torch::allclose(g1[i], g0[i], 1e-2, 1e-4));
  }
}

namespace {

#if TORCH_VERSION_MAJOR >= 2
#define VT_ALLOCATE_CONST
#else
#define VT_ALLOCATE_CONST const
#endif

/// LibTorch's CPU allocator with a count of the bytes it holds and their peak: what a forward keeps alive. Its
/// pointers are plain (data and context the same), as LibTorch's `raw_allocate` callers need.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) VT_ALLOCATE_CONST override {
    void* data = base_->raw_allocate(n);
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[data] = static_cast<int64_t>(n);
    live_ += static_cast<int64_t>(n);
    peak_ = std::max(peak_, live_);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
#if TORCH_VERSION_MAJOR >= 2
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif
  int64_t live() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = live_;
  }
  static CountingAllocator& instance() {
    static CountingAllocator c(c10::GetDefaultCPUAllocator());
    return c;
  }

 private:
  static void release(void* data) {
    CountingAllocator& self = instance();
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.sizes_.find(data);
      if (it != self.sizes_.end()) {
        self.live_ -= it->second;
        self.sizes_.erase(it);
      }
    }
    self.base_->raw_deleter()(data);
  }
  c10::Allocator* base_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, int64_t> sizes_;
  mutable int64_t live_ = 0, peak_ = 0;
};

/// The counting allocator in place of LibTorch's CPU allocator while it lives (the counter itself outlives every
/// tensor it made: it is static).
class CountCpuBytes {
 public:
  CountCpuBytes() : before_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(&counter(), 255); }
  static CountingAllocator& counter() { return CountingAllocator::instance(); }
  ~CountCpuBytes() { c10::SetCPUAllocator(before_, 255); }
  CountCpuBytes(const CountCpuBytes&) = delete;
  CountCpuBytes& operator=(const CountCpuBytes&) = delete;

 private:
  c10::Allocator* before_;
};

}  // namespace

TEST_CASE("activation_checkpoint frees a deep stack's activations: bytes held after forward and at peak",
          "[transformer]") {
  gpt::Config c{.vocab = 17, .context = 64, .layers = 12, .heads = 2, .width = 64};
  torch::manual_seed(3);
  const auto idx = torch::randint(17, {8, 65});
  CountCpuBytes counting;
  auto& bytes = CountCpuBytes::counter();
  auto measure = [&](volt::ActivationCheckpointing which) {
    c.checkpointing = which;
    torch::manual_seed(5);
    gpt::GPT m(c);
    const int64_t base = bytes.live();
    bytes.reset_peak();
    auto loss = lm_loss(m, idx);
    const int64_t after_forward = bytes.live() - base;
    loss.backward();
    return std::pair(after_forward, bytes.peak() - base);
  };
  const auto [plain_kept, plain_peak] = measure({});
  const auto [ckpt_kept, ckpt_peak] = measure({.every = 1});
  const auto [half_kept, half_peak] = measure({.every = 2});
  INFO("bytes held after forward: plain " << plain_kept << ", every block " << ckpt_kept << ", every 2nd "
                                          << half_kept << "; peak: " << plain_peak << ", " << ckpt_peak << ", "
                                          << half_peak);
  REQUIRE(plain_kept > 0);
  // Checkpointing every block keeps each block's input only; every second block, about half of the activations.
  CHECK(ckpt_kept < plain_kept / 5);
  CHECK(half_kept < plain_kept * 3 / 5);
  CHECK(half_kept > ckpt_kept);
  CHECK(ckpt_peak < plain_peak / 2);
}

// Its own process (CTest gpu.activation_checkpoint): a failed CUDA graph capture earlier in the process (graph.cpp's
// host-wait case) leaves LibTorch's CUDA generator in capture mode, and dropout on CUDA then throws.
TEST_CASE("GPU activation_checkpoint: CUDA dropout masks drawn again, float32 and bfloat16 autocast",
          "[.gpu_activation]") {
  torch::manual_seed(3);
  const auto idx = torch::randint(17, {4, 16}).cuda();
  auto run = [&](volt::ActivationCheckpointing which, bool bf16) {
    torch::manual_seed(5);
    auto c = small_config(0.2);
    c.checkpointing = which;
    gpt::GPT m(c);
    m->to(torch::kCUDA);
    torch::manual_seed(11);  // the CUDA generator's dropout masks
    torch::Tensor loss;
    {
      std::optional<volt::detail::AutocastGuard> autocast;
      if (bf16) autocast.emplace(c10::DeviceType::CUDA, at::kBFloat16);
      loss = lm_loss(m, idx);
    }
    loss.backward();
    auto g = grads_of(*m);
    for (auto& t : g) t = t.cpu();
    return std::pair(loss.detach().cpu(), g);
  };
  for (bool bf16 : {false, true}) {
    const auto [loss0, g0] = run({}, bf16);
    const auto [loss1, g1] = run({.every = 1}, bf16);
    CHECK(torch::equal(loss0, loss1));
    for (std::size_t i = 0; i < g0.size(); ++i) {
      INFO((bf16 ? "bfloat16" : "float32") << " autocast, parameter " << i << ": max diff "
                                           << (g1[i] - g0[i]).abs().max().item<double>());
      CHECK(torch::allclose(g1[i], g0[i], bf16 ? 1e-2 : 1e-5, bf16 ? 1e-4 : 1e-7));
    }
  }
}

// ---- learning-rate schedules and parameter groups -----------------------------------------------------------------

namespace {

/// The rate of each group of `o` now.
std::vector<double> rates(const torch::optim::Optimizer& o) {
  std::vector<double> r;
  for (const auto& g : o.param_groups()) r.push_back(g.options().get_lr());
  return r;
}

}  // namespace

TEST_CASE("schedules: LinearLR, CosineAnnealingLR and SequentialLR give PyTorch's rates for each group",
          "[transformer]") {
  auto w = torch::zeros({2}, torch::requires_grad()), b = torch::zeros({1}, torch::requires_grad());
  auto make = [&] {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{w}, std::make_unique<torch::optim::SGDOptions>(1.0));
    groups.emplace_back(std::vector<at::Tensor>{b}, std::make_unique<torch::optim::SGDOptions>(0.5));
    return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(1.0));
  };
  // Each list: the rate of the group of initial rate 1 after construction, then after each step (PyTorch's values,
  // from its closed forms: start + (end - start) min(t, T)/T; eta + (1 - eta)(1 + cos(pi t / T))/2).
  auto follow = [](torch::optim::Optimizer& o, torch::optim::LRScheduler& s, int steps) {
    std::vector<double> seen{rates(o)[0]};
    for (int i = 0; i < steps; ++i) {
      s.step();
      seen.push_back(rates(o)[0]);
      CHECK(rates(o)[1] == Approx(0.5 * rates(o)[0]).epsilon(1e-15));  // the second group keeps its ratio
    }
    return seen;
  };
  auto near = [](const std::vector<double>& got, const std::vector<double>& want) {
    INFO("got " << Catch::Detail::stringify(got));
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-12));
  };
  {
    auto o = make();
    volt::optim::LinearLR s(*o, {.start_factor = 0.25, .end_factor = 1.0, .total_iters = 4});
    near(follow(*o, s, 6), {0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0, 1.0});
  }
  {
    auto o = make();
    volt::optim::CosineAnnealingLR s(*o, {.t_max = 4, .eta_min = 0.0});
    const double c = (1.0 + std::sqrt(0.5)) / 2.0;  // (1 + cos(pi/4)) / 2
    near(follow(*o, s, 6), {1.0, c, 0.5, 1.0 - c, 0.0, 1.0 - c, 0.5});
  }
  {
    auto o = make();
    auto warm = std::make_shared<volt::optim::LinearLR>(*o, volt::optim::LinearLROptions{.start_factor = 0.5,
                                                                                        .total_iters = 2});
    auto cosine =
        std::make_shared<volt::optim::CosineAnnealingLR>(*o, volt::optim::CosineAnnealingLROptions{.t_max = 3});
    volt::optim::SequentialLR s(*o, volt::optim::Schedules{warm, cosine}, {2});
    near(follow(*o, s, 5), {0.5, 0.75, 1.0, 0.75, 0.25, 0.0});
  }
  auto o = make();
  CHECK_THROWS_WITH(volt::optim::LinearLR(*o, {.start_factor = 0.0}), Contains("start_factor 0") &&
                                                                          Contains("0 < start_factor <= 1"));
  CHECK_THROWS_WITH(volt::optim::CosineAnnealingLR(*o, {}), Contains("t_max 0"));
  auto a = std::make_shared<volt::optim::LinearLR>(*o, volt::optim::LinearLROptions{});
  CHECK_THROWS_WITH(volt::optim::SequentialLR(*o, volt::optim::Schedules{a, a}, {}),
                    Contains("2 schedules and 0 milestones"));
  auto other = make();
  auto b2 = std::make_shared<volt::optim::LinearLR>(*other, volt::optim::LinearLROptions{});
  CHECK_THROWS_WITH(volt::optim::SequentialLR(*o, volt::optim::Schedules{a, b2}, {3}),
                    Contains("schedule 1") && Contains("another optimizer"));
}

namespace {

/// A small network for the recipe of transformers: AdamW with weight decay on matrices only, a linear warm-up then
/// a cosine decay, stepped after every optimizer step.
struct RecipeNetImpl : torch::nn::Module {
  torch::nn::Linear lin1{nullptr}, lin2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  RecipeNetImpl() {
    torch::manual_seed(17);
    lin1 = register_module("lin1", torch::nn::Linear(4, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    lin2 = register_module("lin2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return lin2(torch::tanh(norm(lin1(x)))); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return vt::mse(forward(b.data), b.target);
  }
  volt::OptimizerConfig configure_optimizers() {
    const auto defaults = torch::optim::AdamWOptions(1e-2);
    auto opt = std::make_shared<volt::optim::AdamW>(volt::optim::weight_decay_groups(*this, 0.1, defaults), defaults);
    auto warm = std::make_shared<volt::optim::LinearLR>(
        *opt, volt::optim::LinearLROptions{.start_factor = 0.1, .total_iters = 8});
    auto cosine = std::make_shared<volt::optim::CosineAnnealingLR>(
        *opt, volt::optim::CosineAnnealingLROptions{.t_max = 40, .eta_min = 1e-4});
    return {.optimizer = opt,
            .scheduler = std::make_shared<volt::optim::SequentialLR>(*opt, volt::optim::Schedules{warm, cosine},
                                                                     std::vector<int64_t>{8}),
            .interval = volt::Interval::step};
  }
};
TORCH_MODULE(RecipeNet);

/// Each step's rates, recorded before the step (LearningRateMonitor's moment).
struct RateLog {
  std::vector<std::vector<double>>* rows;
  template <class T, class M, class B>
  void on_train_batch_start(T& trainer, M&, const B&, int64_t) {
    rows->push_back(rates(*trainer.optimizer()));
  }
};

volt::data::TensorLoader recipe_loader() {
  auto [x, y] = vt::regression_data(80, 4);
  return volt::data::TensorLoader(x, y, {.batch_size = 4});  // 20 steps an epoch, in order
}

}  // namespace

TEST_CASE("parameter groups: weight decay on matrices only; a fit resumed mid-warm-up ends bit-identical",
          "[transformer]") {
  RecipeNet probe;
  auto groups = volt::optim::weight_decay_groups(*probe, 0.1, torch::optim::AdamWOptions(1e-2));
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].params().size() == 2);  // lin1.weight, lin2.weight
  CHECK(groups[1].params().size() == 4);  // the biases, the norm's scale and shift
  CHECK(static_cast<const torch::optim::AdamWOptions&>(groups[0].options()).weight_decay() == 0.1);
  CHECK(static_cast<const torch::optim::AdamWOptions&>(groups[1].options()).weight_decay() == 0.0);

  const fs::path dir = scratch("recipe_resume");
  std::vector<std::vector<double>> rows;
  RecipeNet reference;
  auto t = volt::make_trainer(
      {.max_epochs = 5}, RateLog{&rows},
      volt::ModelCheckpoint({.dirpath = (dir / "a").string(), .filename = "{step}", .save_top_k = -1,
                             .every_n_train_steps = 1}));
  t.fit(reference, recipe_loader());
  REQUIRE(t.global_step() == 100);
  REQUIRE(rows.size() == 100);
  // Warm-up from 0.1 of the rate over 8 steps, the cosine from the rate down to 1e-4 over the next 40, then up again.
  CHECK(rows[0][0] == Approx(1e-3).margin(1e-15));
  CHECK(rows[4][0] == Approx(1e-2 * (0.1 + 0.9 * 4 / 8)).margin(1e-15));
  CHECK(rows[8][0] == Approx(1e-2).margin(1e-15));
  CHECK(rows[48][0] == Approx(1e-4).margin(1e-15));
  for (const auto& r : rows) CHECK(r[1] == r[0]);  // both groups start from the same rate
  for (const int step : {3, 8, 30}) {
    INFO("resumed from step " << step);
    RecipeNet resumed;
    {
      torch::NoGradGuard g;
      for (auto& p : resumed->parameters()) p.add_(1.0);  // other weights: all must come from the checkpoint
    }
    std::vector<std::vector<double>> later;
    auto r = volt::make_trainer({.max_epochs = 5}, RateLog{&later});
    CaptureCerr quiet;
    r.fit(resumed, recipe_loader(), (dir / "a" / ("step=" + std::to_string(step) + ".ckpt")).string());
    CHECK(r.global_step() == 100);
    CHECK(same_weights(*reference, *resumed));
    REQUIRE(later.size() == static_cast<std::size_t>(100 - step));
    CHECK(later.front() == rows[step]);
    CHECK(later.back() == rows.back());
  }
  fs::remove_all(dir);
}

namespace {
/// `tensors` written as torch.save would (torch::pickle_save), for Python's torch.load.
void save_for_python(const std::map<std::string, torch::Tensor>& tensors, const fs::path& file) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& [name, t] : tensors) d.insert(name, t.detach().contiguous());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(d));
  std::ofstream(file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
}  // namespace

// Run by CTest optim.recipe_vs_torch with VOLT_EXPORT_DIR set; test/recipe_check.py trains the same in PyTorch.
TEST_CASE("the recipe's fit written for PyTorch to repeat", "[.recipe_export]") {
  const char* dir_env = std::getenv("VOLT_EXPORT_DIR");
  REQUIRE(dir_env != nullptr);
  const fs::path dir(dir_env);
  fs::create_directories(dir);
  RecipeNet net;
  std::map<std::string, torch::Tensor> init;
  for (const auto& p : net->named_parameters()) init["param." + p.key()] = p.value().clone();
  auto [x, y] = vt::regression_data(80, 4);
  init["data.x"] = x;
  init["data.y"] = y;
  save_for_python(init, dir / "init.pt");
  std::vector<std::vector<double>> rows;
  auto t = volt::make_trainer({.max_epochs = 5}, RateLog{&rows});
  t.fit(net, recipe_loader());
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out["param." + p.key()] = p.value().clone();
  auto r = torch::empty({static_cast<int64_t>(rows.size()), 2}, torch::kFloat64);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    r[static_cast<int64_t>(i)][0] = rows[i][0];
    r[static_cast<int64_t>(i)][1] = rows[i][1];
  }
  out["rates"] = r;
  save_for_python(out, dir / "volt.pt");
}

// ---- loss weights ---------------------------------------------------------------------------------------------------

namespace {

/// The weights of a MaskedLM after one SGD step on the loss `reduce` gives for rows [0, rows) of the data, as one
/// process computes it by hand: the mean over every real token of those rows (`token_mean`), or the mean of the
/// per-batch means of batches of `batch` rows.
torch::Tensor one_step_by_hand(const torch::Tensor& tokens, const torch::Tensor& lengths, int64_t rows, bool token_mean,
                               int64_t batch) {
  vt::MaskedLM m;
  torch::Tensor loss;
  if (token_mean) {
    auto [sum, count] = vt::masked_token_loss(m->forward(tokens.slice(0, 0, rows)), tokens.slice(0, 0, rows),
                                              lengths.slice(0, 0, rows));
    loss = sum / count;
  } else {
    loss = torch::zeros({});
    for (int64_t i = 0; i < rows; i += batch) {
      auto [sum, count] = vt::masked_token_loss(m->forward(tokens.slice(0, i, i + batch)),
                                                tokens.slice(0, i, i + batch), lengths.slice(0, i, i + batch));
      loss = loss + sum / count / static_cast<double>(rows / batch);
    }
  }
  loss.backward();
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.sub_(m->lr * p.grad());
  return vt::flat_params(*m);
}

}  // namespace

TEST_CASE("weigh_loss: an accumulation window's gradient is the mean over all its tokens", "[transformer]") {
  const auto [tokens, lengths] = vt::ragged_tokens(12, 6, 11, 8);
  auto fit_one_step = [&](bool weighted, int64_t accumulate) {
    vt::MaskedLM m;
    m->weighted = weighted;
    auto t = volt::make_trainer({.max_steps = 1, .accumulate_grad_batches = accumulate});
    t.fit(m, volt::data::TensorLoader(tokens, lengths, {.batch_size = 2}));
    return vt::flat_params(*m);
  };
  const auto token_mean = one_step_by_hand(tokens, lengths, 6, true, 2);
  const auto mean_of_means = one_step_by_hand(tokens, lengths, 6, false, 2);
  REQUIRE_FALSE(torch::allclose(token_mean, mean_of_means, 1e-4, 1e-5));  // the lengths differ enough to tell
  const auto weighted = fit_one_step(true, 3);
  INFO("max |weighted - token mean| " << (weighted - token_mean).abs().max().item<double>());
  CHECK(torch::allclose(weighted, token_mean, 1e-6, 1e-7));
  CHECK(torch::allclose(fit_one_step(false, 3), mean_of_means, 1e-6, 1e-7));  // Lightning's rule without it
  // One batch, no accumulation: the same as the plain mean.
  CHECK(torch::allclose(fit_one_step(true, 1), one_step_by_hand(tokens, lengths, 2, true, 2), 1e-6, 1e-7));
}

namespace {
/// Says its loss's units in every other batch only.
struct MixedWeighingImpl : vt::MaskedLMImpl {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    weighted = ctx.batch_idx() % 2 == 0;
    return MaskedLMImpl::training_step(b, ctx);
  }
};
TORCH_MODULE(MixedWeighing);
/// Calls weigh_loss in validation_step.
struct WeighingOutsideImpl : vt::MaskedLMImpl {
  void validation_step(const torch::data::Example<>&, volt::Context& ctx) { ctx.weigh_loss(3); }
};
TORCH_MODULE(WeighingOutside);
}  // namespace

TEST_CASE("weigh_loss: the logged epoch mean weighted by tokens; misuse refused", "[transformer]") {
  const auto [tokens, lengths] = vt::ragged_tokens(12, 6, 11, 8);
  vt::MaskedLM m;
  m->lr = 0.0;  // the weights stay: the epoch's mean is the whole data's token mean at them
  auto t = volt::make_trainer({.max_epochs = 1, .accumulate_grad_batches = 2});
  t.fit(m, volt::data::TensorLoader(tokens, lengths, {.batch_size = 4}));
  auto [sum, count] = vt::masked_token_loss(m->forward(tokens), tokens, lengths);
  CHECK(t.callback_metric_values().at("token_loss") == Approx((sum / count).item<double>()).epsilon(1e-6));

  MixedWeighing mixed;
  auto t2 = volt::make_trainer({.max_epochs = 1, .accumulate_grad_batches = 2});
  CHECK_THROWS_WITH(t2.fit(mixed, volt::data::TensorLoader(tokens, lengths, {.batch_size = 4})),
                    Contains("weigh_loss was called in some training_steps of an accumulation window and not in "
                             "others (batch 1)"));
  WeighingOutside outside;
  auto t3 = volt::make_trainer({.max_epochs = 1});
  CHECK_THROWS_WITH(t3.validate(outside, volt::data::TensorLoader(tokens, lengths, {.batch_size = 4})),
                    Contains("outside training_step"));
}

TEST_CASE("GPT-2 from and to Hugging Face's layout: logits equal transformers'", "[.gpt2]") {
  const char* env = std::getenv("VOLT_GPT2_DIR");
  REQUIRE(env != nullptr);
  const fs::path dir = env;  // test/gpt2_check.py wrote hf/, hf_sharded/ and hf_io.safetensors, and reads what is
                             // written here
  torch::NoGradGuard no_grad;
  const auto io = volt::safetensors::read((dir / "hf_io.safetensors").string());
  std::map<std::string, torch::Tensor> m(io.tensors.begin(), io.tensors.end());
  for (const char* folder : {"hf", "hf_sharded"}) {
    auto net = gpt::from_pretrained((dir / folder).string());
    net->eval();
    const double diff = (net->forward(m.at("tokens")) - m.at("logits")).abs().max().item<double>();
    INFO(folder << ": volt's logits differ from transformers' by " << diff);
    CHECK(diff < 1e-4);
  }
  // A GPT of volt's own, exact GELU, its biases and norms moved off their initial values: written for transformers.
  torch::manual_seed(9);
  gpt::GPT own(gpt::Config{.vocab = 57, .context = 16, .layers = 2, .heads = 2, .width = 24});
  for (auto& p : own->named_parameters()) {
    if (p.key().ends_with("bias") || p.key().find(".ln") != std::string::npos) p.value().add_(torch::randn_like(p.value()) * 0.1);
  }
  own->eval();
  const auto tokens = torch::randint(0, 57, {3, 16});
  const auto logits = own->forward(tokens);
  gpt::save_pretrained(own, (dir / "volt").string());
  gpt::save_pretrained(own, (dir / "volt_sharded").string(), 4000);
  volt::safetensors::write((dir / "volt_io.safetensors").string(),
                           {.tensors = {{"tokens", tokens}, {"logits", logits}}, .metadata = {}});
  auto again = gpt::from_pretrained((dir / "volt_sharded").string());  // and back: the same model
  again->eval();
  CHECK(torch::equal(again->forward(tokens), logits));
  // A config this model cannot compute alike is refused with one line.
  fs::create_directories(dir / "llama");
  std::ofstream(dir / "llama" / "config.json") << R"({"model_type": "llama", "hidden_size": 32})";
  CHECK_THROWS_WITH(gpt::from_pretrained((dir / "llama").string()),
                    "gpt: " + (dir / "llama").string() + "/config.json: model_type is \"llama\"; this model is GPT-2's "
                    "(\"gpt2\")");
}
