// Manual optimization (a module with automatic_optimization = false steps its own optimizers through its Context):
// two networks with an optimizer and a scheduler each, alternating steps, clipping and toggling, against a
// hand-written LibTorch loop; the loss scale shared by several optimizers against a hand-written scaler; and every
// rejected use, with its message.

#include "common.hpp"

#include <limits>
#include <type_traits>

namespace {

using torch::nn::Linear;
using torch::nn::Sequential;
using torch::nn::Tanh;

/// Two networks: a generator `gen` (4 -> 8 -> 4) and a critic (4 -> 8 -> 1), as in a GAN.
struct TwoNets : torch::nn::Module {
  Sequential gen{nullptr}, critic{nullptr};
  TwoNets() {
    torch::manual_seed(7);
    gen = register_module("gen", Sequential(Linear(4, 8), Tanh(), Linear(8, 4)));
    critic = register_module("critic", Sequential(Linear(4, 8), Tanh(), Linear(8, 1)));
  }
  torch::Tensor critic_loss(const torch::data::Example<>& b) {
    const torch::Tensor fake = gen->forward(b.data).detach();
    return (critic->forward(b.data) - b.target).pow(2).mean() + critic->forward(fake).pow(2).mean();
  }
  torch::Tensor gen_loss(const torch::data::Example<>& b) {
    return (critic->forward(gen->forward(b.data)) - 1.0).pow(2).mean();
  }
};

constexpr double kCriticClip = 0.5;  // by norm
constexpr double kGenClip = 0.05;    // by value

/// The module: the critic steps on every batch (clipped by norm, with its parameters alone toggled on), the generator
/// on every second one (clipped by value); the generator's scheduler steps every 3 of its steps, the critic's per epoch.
struct Gan : TwoNets {
  static constexpr bool automatic_optimization = false;
  /// Checks made inside the step: toggling froze the other network, and left its gradients alone.
  int toggle_checks = 0, toggle_failures = 0;

  std::tuple<volt::OptimizerConfigOf<torch::optim::SGD>, volt::OptimizerConfigOf<torch::optim::Adam>>
  configure_optimizers() {
    auto g = std::make_shared<torch::optim::SGD>(gen->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto c = std::make_shared<torch::optim::Adam>(critic->parameters(), torch::optim::AdamOptions(1e-2));
    return {{.optimizer = g, .scheduler = std::make_shared<torch::optim::StepLR>(*g, 1, 0.5),
             .interval = volt::Interval::step, .frequency = 3},
            {.optimizer = c, .scheduler = std::make_shared<torch::optim::StepLR>(*c, 1, 0.7)}};
  }

  void training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto opts = ctx.optimizers();
    volt::ManualOptimizer& g = opts[0];
    volt::ManualOptimizer& c = opts[1];
    ctx.toggle_optimizer(c);
    const torch::Tensor c_loss = critic_loss(b);
    c.zero_grad();
    ctx.manual_backward(c_loss);
    ctx.clip_gradients(c, kCriticClip);
    c.step();
    ctx.untoggle_optimizer(c);
    ctx.log("c_loss", c_loss, {.prog_bar = true});
    if (ctx.batch_idx() % 2 == 1) {
      ctx.toggle_optimizer(g);
      std::vector<torch::Tensor> critic_grads;
      for (const auto& p : critic->parameters()) critic_grads.push_back(p.grad().clone());
      const torch::Tensor g_loss = gen_loss(b);
      g.zero_grad();
      ctx.manual_backward(g_loss);
      ++toggle_checks;
      const auto critic_params = critic->parameters();
      for (std::size_t i = 0; i < critic_grads.size(); ++i) {
        const auto& p = critic_params[i];
        if (p.requires_grad() || !torch::equal(p.grad(), critic_grads[i])) ++toggle_failures;
      }
      ctx.clip_gradients(g, kGenClip, volt::ClipAlgorithm::value);
      g.step();
      ctx.untoggle_optimizer(g);
      ctx.log("g_loss", g_loss);
    }
  }
};

void set_requires_grad(torch::nn::Module& m, bool on) {
  for (auto& p : m.parameters()) p.set_requires_grad(on);
}

/// The reference: the same alternation written with LibTorch alone, the forward (and loss) under autocast when
/// `autocast` is given, requires_grad switched by hand where the module toggles.
template <class Guard>
void hand_loop(TwoNets& m, const volt::data::TensorLoader& loader, int epochs) {
  torch::optim::SGD g(m.gen->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::Adam c(m.critic->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::StepLR g_sched(g, 1, 0.5), c_sched(c, 1, 0.7);
  int64_t g_steps = 0;
  for (int e = 0; e < epochs; ++e) {
    int64_t i = 0;
    for (auto b : loader) {
      set_requires_grad(*m.gen, false);
      torch::Tensor c_loss;
      {
        [[maybe_unused]] Guard guard;
        c_loss = m.critic_loss(b);
      }
      c.zero_grad();
      c_loss.backward();
      torch::nn::utils::clip_grad_norm_(m.critic->parameters(), kCriticClip);
      c.step();
      set_requires_grad(*m.gen, true);
      if (i % 2 == 1) {
        set_requires_grad(*m.critic, false);
        torch::Tensor g_loss;
        {
          [[maybe_unused]] Guard guard;
          g_loss = m.gen_loss(b);
        }
        g.zero_grad();
        g_loss.backward();
        torch::nn::utils::clip_grad_value_(m.gen->parameters(), kGenClip);
        g.step();
        if (++g_steps % 3 == 0) g_sched.step();
        set_requires_grad(*m.critic, true);
      }
      ++i;
    }
    c_sched.step();
  }
}

struct NoAutocast {};
struct Bf16Autocast {
  volt::detail::AutocastGuard guard{c10::DeviceType::CPU, at::kBFloat16};
};

volt::data::TensorLoader gan_data() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = torch::randn({64, 4}, gen);
  auto y = torch::sin(x.sum(1, true));
  return volt::data::TensorLoader(x, y, {.batch_size = 8});
}

}  // namespace

TEMPLATE_TEST_CASE("manual optimization with two optimizers equals a hand-written LibTorch loop", "[trainer][manual]",
                   volt::Fp32, volt::Bf16Mixed) {
  using Guard = std::conditional_t<std::is_same_v<TestType, volt::Fp32>, NoAutocast, Bf16Autocast>;
  const auto loader = gan_data();
  Gan module;
  TwoNets reference;
  vt::copy_weights(module, reference);
  volt::Trainer<volt::SingleDevice, TestType> trainer({.max_epochs = 3});
  trainer.fit(module, loader);
  hand_loop<Guard>(reference, loader, 3);
  // global_step counts optimizer steps, as Lightning's in manual mode: 8 critic and 4 generator steps per epoch.
  CHECK(trainer.global_step() == 3 * (8 + 4));
  CHECK(module.toggle_checks == 3 * 4);
  CHECK(module.toggle_failures == 0);
  const auto optimizers = trainer.optimizers();
  REQUIRE(optimizers.size() == 2);
  // 12 generator steps: its scheduler stepped 4 times (LibTorch's first step() only counts); the critic's 3 times.
  CHECK(optimizers[0]->param_groups()[0].options().get_lr() == Approx(0.05 * 0.5 * 0.5 * 0.5));
  CHECK(optimizers[1]->param_groups()[0].options().get_lr() == Approx(1e-2 * 0.7 * 0.7));
  CHECK(trainer.callback_metrics().count("c_loss") == 1);
  CHECK(trainer.callback_metrics().count("g_loss") == 1);
  CHECK(torch::equal(vt::flat_params(module), vt::flat_params(reference)));
}

namespace {

/// Fp16Mixed's loss scaling without autocast, so that the scale shared by several optimizers runs in a Trainer on the
/// CPU (Fp16Mixed itself autocasts to float16, which needs a GPU; test/gpu.cpp has that).
struct ScaledFp32 : volt::Fp16Mixed {
  static constexpr const char* name = "ScaledFp32";
  static constexpr bool needs_fp16_autocast = false;
  ScaledFp32() : volt::Fp16Mixed(volt::GradScalerOptions{.init_scale = 1024.0, .growth_interval = 3}) {}
  NoGuard forward_context(c10::DeviceType) { return {}; }
};

/// Two weights, an SGD each; both losses backward, then both step. The batch says when a loss is made infinite.
struct TwoWeights : torch::nn::Module {
  static constexpr bool automatic_optimization = false;
  torch::Tensor w0, w1;
  TwoWeights() {
    w0 = register_parameter("w0", torch::tensor({0.5f, -0.25f}));
    w1 = register_parameter("w1", torch::tensor({1.0f, 2.0f}));
  }
  std::tuple<torch::optim::SGD, torch::optim::SGD> configure_optimizers() {
    return {torch::optim::SGD(std::vector<torch::Tensor>{w0}, 0.125),
            torch::optim::SGD(std::vector<torch::Tensor>{w1}, 0.0625)};
  }
  /// batch.data: [1, 4] = x0 (2 values), x1 (2 values); batch.target: [1, 2] = a factor for each loss (inf: overflow).
  void training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto opts = ctx.optimizers();
    const auto x = b.data[0], f = b.target[0];
    opts[0].zero_grad();
    opts[1].zero_grad();
    ctx.manual_backward((w0 * x.slice(0, 0, 2)).sum() * f[0]);
    ctx.manual_backward((w1 * x.slice(0, 2, 4)).pow(2).sum() * f[1]);
    stepped.push_back({opts[0].step(), opts[1].step()});
  }
  std::vector<std::pair<bool, bool>> stepped;
};

}  // namespace

TEST_CASE("one loss scale serves several optimizers: scaled per backward, unscaled per optimizer, updated per batch",
          "[trainer][manual]") {
  const float inf = std::numeric_limits<float>::infinity();
  // Six batches; batch 2 overflows the second loss, batch 4 the first. With growth_interval 3 the scale grows after
  // three clean batches in a row.
  const std::vector<std::pair<float, float>> factors{{1, 1}, {1, 1}, {1, inf}, {1, 1}, {inf, 1}, {1, 1}};
  std::vector<torch::data::Example<>> batches;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  for (const auto& [f0, f1] : factors) batches.push_back({torch::randn({1, 4}, gen), torch::tensor({{f0, f1}})});
  TwoWeights module;
  volt::Trainer<volt::SingleDevice, ScaledFp32> trainer({.max_epochs = 1});
  trainer.fit(module, batches);

  // The reference, PyTorch's GradScaler written out for two optimizers: a step is skipped where its own gradients are
  // not finite; the scale backs off (x0.5) when either was, else counts clean updates and doubles after 3.
  torch::Tensor w0 = torch::tensor({0.5f, -0.25f}), w1 = torch::tensor({1.0f, 2.0f});
  double scale = 1024.0;
  int tracker = 0;
  std::vector<std::pair<bool, bool>> want;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    const auto x = batches[i].data[0];
    const torch::Tensor g0 = x.slice(0, 0, 2) * factors[i].first;                      // d/dw0 of (w0 . x0) f0
    const torch::Tensor g1 = 2 * w1 * x.slice(0, 2, 4).pow(2) * factors[i].second;    // d/dw1 of |w1 * x1|^2 f1
    const bool ok0 = torch::isfinite(g0).all().item<bool>(), ok1 = torch::isfinite(g1).all().item<bool>();
    if (ok0) w0 = w0 - 0.125 * g0;
    if (ok1) w1 = w1 - 0.0625 * g1;
    want.push_back({ok0, ok1});
    if (!ok0 || !ok1) {
      scale *= 0.5;
      tracker = 0;
    } else if (++tracker == 3) {
      scale *= 2.0;
      tracker = 0;
    }
  }
  CHECK(module.stepped == want);
  CHECK(trainer.precision().scaler().get_scale() == scale);
  CHECK(trainer.precision().scaler().growth_tracker() == tracker);
  CHECK(torch::allclose(module.w0.detach(), w0, 1e-6, 1e-7));
  CHECK(torch::allclose(module.w1.detach(), w1, 1e-6, 1e-7));
  CHECK(trainer.global_step() == 12);  // steps are counted where the scaler skips them, as in automatic mode
}

namespace {

/// A module with manual optimization whose training_step does what `misuse` says.
struct Misuse : torch::nn::Module {
  static constexpr bool automatic_optimization = false;
  std::string misuse;
  torch::nn::Linear a{nullptr}, b{nullptr};
  explicit Misuse(std::string what) : misuse(std::move(what)) {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 1));
  }
  std::vector<volt::OptimizerConfig> configure_optimizers() {
    return {{std::make_shared<torch::optim::SGD>(a->parameters(), 0.1)},
            {std::make_shared<torch::optim::SGD>(b->parameters(), 0.1)}};
  }
  void training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    const torch::Tensor loss = (b(a(batch.data)) - batch.target).pow(2).mean();
    auto opts = ctx.optimizers();
    if (misuse == "index") ctx.optimizer(2);
    if (misuse == "untoggle") ctx.untoggle_optimizer(opts[0]);
    if (misuse == "toggle twice") {
      ctx.toggle_optimizer(opts[0]);
      ctx.toggle_optimizer(opts[1]);
    }
    if (misuse == "clip") ctx.clip_gradients(opts[0], -1.0);
    ctx.manual_backward(loss);
    opts[0].step();
    if (misuse == "step twice") opts[0].step();
  }
};

/// An automatic module that calls what only manual optimization has.
struct AutomaticCallsManual : vt::RegressorImpl {
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto loss = vt::RegressorImpl::training_step(batch, ctx);
    ctx.manual_backward(loss);
    return loss;
  }
};

}  // namespace

TEST_CASE("manual optimization's misuses are refused with a message that names the fix", "[trainer][manual]") {
  auto [x, y] = vt::regression_data(32);
  auto loader = make_loader(x, y, 8);
  SECTION("accumulate_grad_batches and gradient_clip_val are automatic optimization's, refused when fit starts") {
    Misuse m("");
    volt::Trainer<> accumulate({.accumulate_grad_batches = 2});
    CHECK_THROWS_AS(accumulate.fit(m, loader), volt::ConfigError);
    CHECK_THROWS_WITH(accumulate.fit(m, loader), Contains("accumulate_grad_batches=2 is for automatic optimization") &&
                                                     Contains("accumulate in training_step"));
    volt::Trainer<> clip({.gradient_clip_val = 0.5});
    CHECK_THROWS_WITH(clip.fit(m, loader), Contains("gradient_clip_val=0.5") && Contains("ctx.clip_gradients(opt"));
    CHECK(accumulate.global_step() == 0);
  }
  SECTION("an automatic module's ctx.manual_backward says how to switch") {
    AutomaticCallsManual m;
    volt::Trainer<> t({.max_epochs = 1});
    CHECK_THROWS_WITH(t.fit(m, loader), Contains("ctx.manual_backward is for manual optimization") &&
                                            Contains("static constexpr bool automatic_optimization = false;"));
  }
  struct Case {
    const char* misuse;
    const char* message;
  };
  const Case cases[] = {
      {"index", "optimizer(2) was asked for; the fit has 2 optimizers, indices 0 to 1"},
      {"untoggle", "untoggle_optimizer(optimizer 0) but no optimizer is toggled"},
      {"toggle twice", "toggle_optimizer(optimizer 1) while optimizer 0 is toggled; call untoggle_optimizer"},
      {"clip", "clip_gradients(value=-1.000000) is not allowed: give a value > 0"},
  };
  for (const Case& c : cases) {
    INFO(c.misuse);
    Misuse m(c.misuse);
    volt::Trainer<> t({.max_epochs = 1});
    CHECK_THROWS_AS(t.fit(m, loader), volt::StepError);
    CHECK_THROWS_WITH(t.fit(m, loader), Contains(c.message) && Contains("training_step failed in epoch 0, batch 0"));
  }
  SECTION("under loss scaling an optimizer steps once per training_step; without, as often as the module likes") {
    Misuse scaled("step twice");
    volt::Trainer<volt::SingleDevice, ScaledFp32> t({.max_epochs = 1});
    CHECK_THROWS_WITH(t.fit(scaled, loader), Contains("optimizer 0 stepped twice in one training_step under "
                                                      "ScaledFp32") && Contains("Bf16Mixed, Fp32"));
    Misuse plain("step twice");
    volt::Trainer<> fp32({.max_epochs = 1});
    fp32.fit(plain, loader);
    CHECK(fp32.global_step() == 4 * 2);
  }
}

namespace {
/// Two weights with an SGD each; optimizer `with_scheduler` has a StepLR.
struct ScheduledPair : torch::nn::Module {
  static constexpr bool automatic_optimization = false;
  std::size_t with_scheduler;
  torch::Tensor w0, w1;
  explicit ScheduledPair(std::size_t which) : with_scheduler(which) {
    w0 = register_parameter("w0", torch::ones({2}));
    w1 = register_parameter("w1", torch::ones({2}));
  }
  std::vector<volt::OptimizerConfig> configure_optimizers() {
    std::vector<volt::OptimizerConfig> out{{std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{w0}, 0.1)},
                                           {std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{w1}, 0.1)}};
    out[with_scheduler].scheduler = std::make_shared<torch::optim::StepLR>(*out[with_scheduler].optimizer, 1, 0.5);
    return out;
  }
  void training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto opts = ctx.optimizers();
    opts[0].zero_grad();
    opts[1].zero_grad();
    ctx.manual_backward((w0 * b.data[0].slice(0, 0, 2)).sum() + (w1 * b.data[0].slice(0, 2, 4)).sum());
    opts[0].step();
    opts[1].step();
  }
};
}  // namespace

TEST_CASE("a manual fit's checkpoint names each scheduler's optimizer and resumes only into the same layout",
          "[trainer][manual]") {
  std::vector<torch::data::Example<>> batches;
  for (int i = 0; i < 4; ++i) batches.push_back({torch::randn({1, 4}), torch::zeros({1, 1})});
  const std::string path = (scratch("manual_schedulers") / "a.ckpt").string();
  ScheduledPair first(0);
  volt::Trainer<> saver({.max_epochs = 1});
  saver.fit(first, batches);
  saver.save_checkpoint(path);
  ScheduledPair same(0);
  volt::Trainer<> resumed({.max_epochs = 2});
  resumed.fit(same, batches, path);
  CHECK(resumed.global_step() == 2 * 2 * 4);
  ScheduledPair other(1);
  volt::Trainer<> refused({.max_epochs = 2});
  CHECK_THROWS_WITH(refused.fit(other, batches, path),
                    Contains("holds a learning-rate scheduler of optimizer 0 where this fit's scheduler belongs to "
                             "optimizer 1"));
}

namespace {
/// Counts the rows loggers receive with a training step's value.
struct RowCounter {
  int rows = 0;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t) {
    rows += static_cast<int>(metrics.count("c_loss"));
  }
};
}  // namespace

TEST_CASE("under manual optimization loggers get a row every log_every_n_steps batches that stepped",
          "[trainer][manual]") {
  const auto loader = gan_data();
  Gan module;
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      {.max_epochs = 3, .log_every_n_steps = 3}, RowCounter{});
  trainer.fit(module, loader);
  // 24 batches, each stepping (the critic every batch, the generator every second): rows after batches 3, 6, ..., 24,
  // as Lightning counts; counting optimizer steps instead (1, 3, 4, 6, ...) would give 12.
  CHECK(trainer.global_step() == 36);
  CHECK(trainer.callback<RowCounter>().rows == 8);
}
