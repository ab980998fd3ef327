// Precisions: the loss scaler against ATen's AMP kernels and hand-computed values, every CPU precision in
// whole fits (dtypes, convergence), and the scaler's state in checkpoints. (GPU precisions: test/gpu.cpp.)

#include "common.hpp"

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

// ---- GradScaler -------------------------------------------------------------------------------------------

namespace {
struct OneParam {
  torch::Tensor w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD opt{std::vector<torch::Tensor>{w}, torch::optim::SGDOptions(0.1)};
};
}  // namespace

TEST_CASE("GradScaler scales the loss and unscales gradients exactly", "[unit][scaler]") {
  OneParam p;
  volt::GradScaler scaler;
  auto loss = (p.w * torch::tensor({1.0f, 2.0f, 3.0f})).sum();
  auto scaled = scaler.scale(loss);
  CHECK(scaled.item<float>() == Approx(6.0f * 65536.0f));
  scaled.backward();
  CHECK(torch::equal(p.w.grad(), torch::tensor({1.0f, 2.0f, 3.0f}) * 65536.0f));
  scaler.unscale_(p.opt);
  CHECK(torch::equal(p.w.grad(), torch::tensor({1.0f, 2.0f, 3.0f})));
  CHECK(scaler.step(p.opt));
  CHECK(torch::allclose(p.w.detach(), torch::tensor({0.9f, 0.8f, 0.7f})));
  scaler.update();
  CHECK(scaler.get_scale() == 65536.0);
  CHECK(scaler.growth_tracker() == 1);
  CHECK_THROWS_WITH(([&] { scaler.unscale_(p.opt); scaler.unscale_(p.opt); }()), Contains("twice"));
}

TEST_CASE("GradScaler skips a step with inf/NaN gradients, backs off, grows, and keeps training", "[unit][scaler]") {
  OneParam p;
  volt::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2});
  auto step_with = [&](const torch::Tensor& g) {
    p.opt.zero_grad();
    scaler.scale((p.w * g).sum()).backward();
    const bool stepped = scaler.step(p.opt);
    scaler.update();
    return stepped;
  };
  const auto before = p.w.detach().clone();
  SECTION("inf") { CHECK_FALSE(step_with(torch::tensor({1.0f, std::numeric_limits<float>::infinity(), 1.0f}))); }
  SECTION("NaN") { CHECK_FALSE(step_with(torch::tensor({1.0f, std::nanf(""), 1.0f}))); }
  CHECK(torch::equal(p.w.detach(), before));  // skipped: weights untouched
  CHECK(scaler.get_scale() == 512.0);          // backed off by 0.5
  CHECK(scaler.growth_tracker() == 0);
  CHECK(scaler.last_step_skipped());
  // Training goes on: the next two clean steps apply SGD exactly (scale is a power of two) ...
  CHECK(step_with(torch::tensor({1.0f, 1.0f, 1.0f})));
  CHECK(scaler.get_scale() == 512.0);
  CHECK(step_with(torch::tensor({1.0f, 1.0f, 1.0f})));
  CHECK(torch::allclose(p.w.detach(), before - 0.2f));
  // ... and growth_interval=2 clean steps double the scale.
  CHECK(scaler.get_scale() == 1024.0);
  CHECK(scaler.growth_tracker() == 0);
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
// LibTorch 2.3 added CPU kernels for the AMP ops, so on the CPU the scaler can be checked against ATen's own.
TEST_CASE("GradScaler on the CPU follows ATen's AMP kernels step by step", "[unit][scaler]") {
  const volt::GradScalerOptions o{.init_scale = 1024.0, .growth_factor = 2.0, .backoff_factor = 0.25, .growth_interval = 3};
  OneParam p;
  volt::GradScaler scaler(o);
  torch::Tensor ref_w = p.w.detach().clone();
  torch::Tensor ref_scale = torch::full({1}, static_cast<float>(o.init_scale));
  torch::Tensor ref_tracker = torch::zeros({1}, torch::kInt32);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const float inf = std::numeric_limits<float>::infinity();
  for (int step = 0; step < 14; ++step) {
    torch::Tensor g = torch::randn({3}, gen);
    if (step == 2 || step == 9) g[1] = inf;
    if (step == 10) g[0] = std::nanf("");
    // volt: the loss's gradient is g times the scale.
    p.opt.zero_grad();
    scaler.scale((p.w * g).sum()).backward();
    const bool stepped = scaler.step(p.opt);
    scaler.update();
    // ATen: the same scaled gradient, unscaled and checked by its kernel; SGD written out.
    torch::Tensor ref_g = g * ref_scale;
    torch::Tensor found = torch::zeros({1});
    std::vector<torch::Tensor> grads{ref_g};
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found, ref_scale.to(torch::kFloat64).reciprocal().to(torch::kFloat32));
    const bool ref_stepped = found.item<float>() == 0.0f;
    if (ref_stepped) ref_w -= 0.1 * ref_g;
    at::_amp_update_scale_(ref_scale, ref_tracker, found, o.growth_factor, o.backoff_factor, o.growth_interval);
    INFO("step " << step);
    CHECK(stepped == ref_stepped);
    CHECK(scaler.get_scale() == ref_scale.item<float>());
    CHECK(scaler.growth_tracker() == ref_tracker.item<int32_t>());
    CHECK(torch::allclose(p.w.detach(), ref_w, 1e-6, 1e-7));
  }
}
#endif

TEST_CASE("GradScaler's state round-trips and bad options are refused", "[unit][scaler]") {
  OneParam p;
  volt::GradScaler a({.init_scale = 256.0, .growth_interval = 5});
  a.scale((p.w * 2).sum()).backward();
  a.step(p.opt);
  a.update();
  volt::GradScaler b;
  b.load_state_dict(a.state_dict());
  CHECK(b.get_scale() == 256.0);
  CHECK(b.growth_tracker() == 1);
  CHECK(b.options().growth_interval == 5);
  CHECK_THROWS_WITH(b.load_state_dict({{"scale", 2.0}}), Contains("growth_factor"));
  CHECK_THROWS_WITH(volt::GradScaler({.init_scale = 0.0}), Contains("init_scale=0"));
  CHECK_THROWS_WITH(volt::GradScaler({.growth_factor = 1.0}), Contains("growth_factor=1"));
  CHECK_THROWS_WITH(volt::GradScaler({.backoff_factor = 1.5}), Contains("backoff_factor=1.5"));
  CHECK_THROWS_WITH(volt::GradScaler({.growth_interval = 0}), Contains("growth_interval=0"));
}

TEST_CASE("Fp16Mixed's loss scaling matches an unscaled reference loop on CPU tensors", "[unit][scaler]") {
  // The policy's backward/unscale/step path, driven by hand (its autocast needs a GPU; the scaling does not).
  auto [x, y] = vt::regression_data(64);
  vt::RegressorImpl a, b;
  vt::copy_weights(a, b);
  volt::Fp16Mixed precision;
  torch::optim::SGD oa(a.parameters(), torch::optim::SGDOptions(0.05)), ob(b.parameters(), torch::optim::SGDOptions(0.05));
  for (int step = 0; step < 5; ++step) {
    oa.zero_grad();
    precision.backward(vt::mse(a.forward(x), y));
    precision.unscale_gradients(oa);
    CHECK(precision.optimizer_step(oa));
    precision.update();
    ob.zero_grad();
    vt::mse(b.forward(x), y).backward();
    ob.step();
  }
  CHECK(torch::allclose(vt::flat_params(a), vt::flat_params(b), 1e-6, 1e-7));
  CHECK(precision.state_dict().at("scale") == 65536.0);
  CHECK(precision.state_dict().at("_growth_tracker") == 5.0);
}

// ---- precisions in whole fits ------------------------------------------------------------------------

namespace {
template <class P>
double final_loss_after_fit() {
  auto [x, y] = vt::regression_data(128);
  auto loader = make_loader(x, y, 32, /*shuffle=*/true, 3);
  Regressor m(0.05);
  const double before = vt::mse(m->forward(x), y).item<double>();
  volt::Trainer<volt::SingleDevice, P, volt::CPU> trainer({.max_epochs = 5, .seed = 1});
  trainer.fit(m, loader);
  // Measured in float64 outside the trainer, whatever dtype the module ended in.
  torch::NoGradGuard g;
  auto pred = m->forward(x.to(m->lin->weight.scalar_type())).to(torch::kFloat64);
  const double after = vt::mse(pred, y.to(torch::kFloat64)).item<double>();
  INFO(P::name << ": loss before " << before << ", after " << after);
  CHECK(after < 0.25 * before);
  return after;
}
}  // namespace

// The precision matrix: one case per precision that runs on the CPU accelerator (Fp16Mixed needs a GPU).
TEMPLATE_TEST_CASE("every precision that runs on CPU trains to a lower loss", "[trainer]", volt::Fp32, volt::Fp64True,
                   volt::Bf16Mixed, volt::Bf16True) {
  final_loss_after_fit<TestType>();
}

TEST_CASE("precisions put the module and the math in their dtypes", "[trainer]") {
  auto [x, y] = vt::regression_data(32);
  auto loader = make_loader(x, y, 16);
  struct Probe : vt::RegressorImpl {
    torch::Dtype seen_input = torch::kFloat32, seen_output = torch::kFloat32;
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
      seen_input = b.data.scalar_type();
      auto out = forward(b.data);
      seen_output = out.scalar_type();
      return vt::mse(out.to(torch::kFloat32), b.target.to(torch::kFloat32));
    }
  };
  SECTION("Fp64True: double module and inputs") {
    Probe m;
    volt::Trainer<volt::SingleDevice, volt::Fp64True> t({.max_epochs = 1});
    t.fit(m, loader);
    CHECK(m.lin->weight.scalar_type() == torch::kFloat64);
    CHECK(m.seen_input == torch::kFloat64);
  }
  SECTION("Bf16Mixed: float32 weights, bfloat16 matmuls under autocast") {
    Probe m;
    volt::Trainer<volt::SingleDevice, volt::Bf16> t({.max_epochs = 1});
    t.fit(m, loader);
    CHECK(m.lin->weight.scalar_type() == torch::kFloat32);
    CHECK(m.seen_input == torch::kFloat32);
    CHECK(m.seen_output == torch::kBFloat16);
    CHECK_FALSE(volt::detail::autocast_enabled(c10::DeviceType::CPU));  // the guard restored it
  }
  SECTION("Bf16True: bfloat16 module and inputs") {
    Probe m;
    volt::Trainer<volt::SingleDevice, volt::Bf16True> t({.max_epochs = 1});
    t.fit(m, loader);
    CHECK(m.lin->weight.scalar_type() == torch::kBFloat16);
    CHECK(m.seen_input == torch::kBFloat16);
    CHECK(c10::get_default_dtype() == caffe2::TypeMeta::Make<float>());  // restored after each step
  }
}

TEST_CASE("the loss scaler's state survives a checkpoint round trip", "[checkpoint][precision]") {
  auto grads_of = [](const torch::Tensor& p) { return p.grad().clone(); };
  volt::GradScaler a({.init_scale = 1024.0, .growth_factor = 2.0, .backoff_factor = 0.25, .growth_interval = 3});
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD opt({w}, 0.1);
  auto step = [&](volt::GradScaler& s, torch::Tensor& param, torch::optim::SGD& o, bool overflow) {
    o.zero_grad();
    auto loss = (param * (overflow ? std::numeric_limits<float>::infinity() : 1.5f)).sum();
    s.scale(loss).backward();
    s.step(o);
    s.update();
  };
  step(a, w, opt, false);
  step(a, w, opt, true);   // back off: 1024 * 0.25
  step(a, w, opt, false);  // growth tracker 1
  step(a, w, opt, false);  // growth tracker 2
  REQUIRE(a.get_scale() == 256.0);
  REQUIRE(a.growth_tracker() == 2);

  const fs::path dir = scratch("scaler");
  auto d = volt::checkpoint::make_dict();
  d.insert("precision", volt::checkpoint::from_map(a.state_dict()));
  volt::checkpoint::save((dir / "s.ckpt").string(), d);
  const auto back = volt::checkpoint::read((dir / "s.ckpt").string());
  volt::GradScaler b;  // other options: the state brings its own
  b.load_state_dict(volt::checkpoint::View(back, "s.ckpt").sub("precision").numbers());
  CHECK(b.get_scale() == 256.0);
  CHECK(b.growth_tracker() == 2);
  CHECK(b.options().backoff_factor == 0.25);
  CHECK(b.options().growth_interval == 3);
  // The next steps behave alike: one more clean step grows the scale in both.
  auto w2 = w.detach().clone().requires_grad_(true);
  torch::optim::SGD opt2({w2}, 0.1);
  step(a, w, opt, false);
  step(b, w2, opt2, false);
  CHECK(a.get_scale() == 512.0);
  CHECK(b.get_scale() == 512.0);
  CHECK(torch::equal(w, w2));
  CHECK(torch::equal(grads_of(w), grads_of(w2)));
  CHECK_THROWS_WITH(b.load_state_dict({{"scale", 2.0}}), Contains("growth_factor"));
}
