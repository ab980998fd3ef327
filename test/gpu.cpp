// GPU tests (Catch tag [gpu], CTest label gpu): run on a machine with CUDA; skipped (exit 77) elsewhere.

#include "common.hpp"

#include <unistd.h>

#include <filesystem>

namespace {
volt::data::TensorLoader gpu_loader(int64_t n, int64_t bs) {
  auto [x, y] = vt::regression_data(n);
  return volt::data::TensorLoader(x, y, {.batch_size = bs});
}
}  // namespace

TEST_CASE("GPU Fp32 fit equals the same hand-written loop on the GPU", "[.gpu]") {
  auto loader = gpu_loader(96, 16);
  vt::Regressor a, b;
  vt::copy_weights(*a, *b);
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::GPU> t({.max_epochs = 2});
  t.fit(a, loader);
  CHECK(a->lin->weight.is_cuda());
  b->to(torch::kCUDA);
  torch::optim::SGD opt(b->parameters(), torch::optim::SGDOptions(b->lr));
  for (int e = 0; e < 2; ++e) {
    for (auto batch : loader) {
      opt.zero_grad();
      vt::mse(b->forward(batch.data.cuda()), batch.target.cuda()).backward();
      opt.step();
    }
  }
  CHECK(torch::allclose(vt::flat_params(*a).cpu(), vt::flat_params(*b).cpu(), 1e-5, 1e-6));
}

TEST_CASE("GPU Bf16Mixed and Fp16Mixed train to a lower loss", "[.gpu]") {
  auto [x, y] = vt::regression_data(256);
  auto run = [&](auto precision_tag) {
    using P = decltype(precision_tag);
    volt::data::TensorLoader loader(x, y, {.batch_size = 32, .shuffle = true, .seed = 2});
    vt::Regressor m(0.05);
    const double before = vt::mse(m->forward(x), y).item<double>();
    volt::Trainer<volt::SingleDevice, P, volt::GPU> t({.max_epochs = 5});
    t.fit(m, loader);
    torch::NoGradGuard g;
    const double after = vt::mse(m->forward(x.cuda()).cpu(), y).item<double>();
    INFO(P::name << " before " << before << " after " << after);
    CHECK(after < 0.25 * before);
  };
  run(volt::Bf16Mixed{});
  run(volt::Fp16Mixed{});
}

TEST_CASE("GPU Fp16Mixed skips a step whose gradients hold an inf, backs off and keeps training", "[.gpu]") {
  struct Poisoned : vt::RegressorImpl {
    int64_t poison_step = 2;
    torch::Tensor weight_before;
    void on_after_backward(volt::Context& ctx) {
      if (ctx.global_step() == poison_step) {
        torch::NoGradGuard g;
        lin->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
        weight_before = lin->weight.detach().clone();
      }
    }
    void on_train_batch_end(const torch::Tensor&, const torch::data::Example<>&, int64_t, volt::Context& ctx) {
      if (ctx.global_step() == poison_step + 1 && weight_before.defined()) {
        CHECK(torch::equal(lin->weight.detach(), weight_before));  // the poisoned step changed nothing
      }
    }
  } m;
  auto loader = gpu_loader(128, 16);
  volt::Trainer<volt::SingleDevice, volt::Fp16Mixed, volt::GPU> t({.max_epochs = 3});
  t.fit(m, loader);
  CHECK(t.precision().scaler().get_scale() == 32768.0);  // 65536 backed off once, no growth in 24 steps
  CHECK(t.global_step() == 24);
  auto [x, y] = vt::regression_data(128);
  torch::NoGradGuard g;
  CHECK(vt::mse(m.forward(x.cuda()).cpu(), y).item<double>() < 1.0);
}

TEST_CASE("GPU Fp16Mixed resumed mid-run from a checkpoint ends bit-identical, loss scale included", "[.gpu]") {
  struct Poisoned : vt::RegressorImpl {  // one inf at step 2: the scale backs off to 32768
    void on_after_backward(volt::Context& ctx) {
      if (ctx.global_step() == 2) {
        torch::NoGradGuard g;
        lin->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
      }
    }
  };
  const auto dir = std::filesystem::temp_directory_path() / ("volt_gpu_resume_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto make = [&](const std::string& sub) {
    return volt::make_trainer<volt::SingleDevice, volt::Fp16Mixed, volt::GPU>(
        {.max_epochs = 3, .deterministic = true},
        volt::ModelCheckpoint({.dirpath = (dir / sub).string(), .filename = "{step}", .save_top_k = -1,
                               .every_n_train_steps = 1}));
  };
  auto [x, y] = vt::regression_data(128);
  auto loader = [&] { return volt::data::TensorLoader(x, y, {.batch_size = 16, .shuffle = true, .seed = 4}); };
  Poisoned a;
  auto ta = make("a");
  ta.fit(a, loader());
  REQUIRE(ta.precision().scaler().get_scale() == 32768.0);
  for (const int step : {1, 5, 11}) {  // before the inf, after it, in the second epoch
    Poisoned b;
    auto tb = make("b" + std::to_string(step));
    tb.fit(b, loader(), volt::NoLoader{}, (dir / "a" / ("step=" + std::to_string(step) + ".ckpt")).string());
    CHECK(tb.precision().scaler().get_scale() == 32768.0);
    CHECK(torch::equal(a.lin->weight, b.lin->weight));
    CHECK(torch::equal(a.lin->bias, b.lin->bias));
  }
  std::filesystem::remove_all(dir);
}
