// What training today's models takes (Catch tag [transformer], CTest transformer): activation checkpointing against
// the plain block (gradients, dropout masks, autocast, memory), the GPT example's model.

#include "common.hpp"

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
  // Passed as an input instead, it works and matches.
  auto with_input = volt::activation_checkpoint([&](const torch::Tensor& in, const torch::Tensor& o) { return lin(in) + o; },
                                                x, outside);
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
