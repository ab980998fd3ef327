// GPU tests (Catch tag [gpu], CTest label gpu): run on a machine with CUDA; skipped (exit 77) elsewhere.

#include "common.hpp"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

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

namespace {
/// Fp16Mixed on the regressor with an inf put into one gradient after backward at step `poison_step`.
struct PoisonedImpl : vt::RegressorImpl {
  int64_t poison_step = 2;
  void on_after_backward(volt::Context& ctx) {
    if (ctx.global_step() == poison_step) {
      torch::NoGradGuard g;
      lin->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
    }
  }
};


/// The independent reference: the same model, data and poison in a hand-written CUDA loop that scales the loss
/// and calls ATen's own AMP kernels, as PyTorch's torch.amp.GradScaler does (init 65536, growth 2 every 2000
/// clean steps, backoff 0.5).
struct AtenAmpLoop {
  std::vector<double> scales;
  std::vector<bool> skipped;
  void run(vt::RegressorImpl& m, const volt::data::TensorLoader& loader, int epochs, int64_t poison_step) {
    m.to(torch::kCUDA);
    torch::optim::SGD opt(m.parameters(), torch::optim::SGDOptions(m.lr));
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA);
    torch::Tensor scale = torch::full({1}, 65536.0f, f32);
    torch::Tensor tracker = torch::zeros({1}, f32.dtype(torch::kInt32));
    int64_t step = 0;
    for (int e = 0; e < epochs; ++e) {
      for (auto b : loader) {
        opt.zero_grad();
        torch::Tensor loss;
        {
          volt::detail::AutocastGuard autocast(c10::DeviceType::CUDA, at::kHalf);
          loss = vt::mse(m.forward(b.data.cuda()), b.target.cuda());
        }
        (loss * scale).backward();
        if (step == poison_step) {
          torch::NoGradGuard g;
          m.lin->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
        }
        std::vector<torch::Tensor> grads;
        for (auto& p : m.parameters()) grads.push_back(p.grad());
        torch::Tensor found_inf = torch::zeros({1}, f32);
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scale.to(torch::kFloat64).reciprocal().to(torch::kFloat32));
        const bool skip = found_inf.item<float>() != 0.0f;
        if (!skip) opt.step();
        at::_amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000);
        scales.push_back(scale.item<float>());
        skipped.push_back(skip);
        ++step;
      }
    }
  }
};
}  // namespace

TEST_CASE("GPU Fp16Mixed: loss scale and skipped steps equal a loop on ATen's AMP kernels, step by step", "[.gpu]") {
  auto loader = gpu_loader(128, 16);
  PoisonedImpl a;
  vt::RegressorImpl b;
  vt::copy_weights(a, b);
  auto t = volt::make_trainer<volt::SingleDevice, volt::Fp16Mixed, volt::GPU>({.max_epochs = 3}, vt::ScaleRecorder{});
  t.fit(a, loader);
  AtenAmpLoop ref;
  ref.run(b, loader, 3, a.poison_step);
  const auto& got = t.callback<vt::ScaleRecorder>();
  REQUIRE(ref.scales.size() == 24);
  CHECK(t.global_step() == 24);
  CHECK(got.scales == ref.scales);
  CHECK(got.skipped == ref.skipped);
  CHECK(ref.skipped[static_cast<std::size_t>(a.poison_step)]);  // the poisoned step was skipped by both
  CHECK(torch::allclose(vt::flat_params(a).cpu(), vt::flat_params(b).cpu(), 1e-6, 1e-7));
  auto [x, y] = vt::regression_data(128);
  torch::NoGradGuard g;
  CHECK(vt::mse(a.forward(x.cuda()).cpu(), y).item<double>() < 1.0);
}

TEST_CASE("GPU Fp16Mixed resumed mid-run from a checkpoint ends bit-identical, loss scale included", "[.gpu]") {
  using Poisoned = PoisonedImpl;  // one inf at step 2
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
  const double final_scale = ta.precision().scaler().get_scale();  // the uninterrupted run's
  REQUIRE(final_scale < 65536.0);                                   // it backed off at least once
  for (const int step : {1, 5, 11}) {  // before the inf, after it, in the second epoch
    Poisoned b;
    auto tb = make("b" + std::to_string(step));
    tb.fit(b, loader(), volt::NoLoader{}, (dir / "a" / ("step=" + std::to_string(step) + ".ckpt")).string());
    CHECK(tb.precision().scaler().get_scale() == final_scale);
    CHECK(torch::equal(a.lin->weight, b.lin->weight));
    CHECK(torch::equal(a.lin->bias, b.lin->bias));
  }
  std::filesystem::remove_all(dir);
}

namespace {
/// Manual optimization with two heads, an SGD each, under Fp16Mixed: both losses backward, then both optimizers step;
/// at `poison_step` the second head's gradient gets an inf after its backward.
struct TwoHeads : torch::nn::Module {
  static constexpr bool automatic_optimization = false;
  torch::nn::Linear a{nullptr}, b{nullptr};
  int64_t batch = 0, poison_step = 3;
  TwoHeads() {
    torch::manual_seed(9);
    a = register_module("a", torch::nn::Linear(4, 1));
    b = register_module("b", torch::nn::Linear(4, 1));
  }
  std::tuple<torch::optim::SGD, torch::optim::SGD> configure_optimizers() {
    return {torch::optim::SGD(a->parameters(), 0.05), torch::optim::SGD(b->parameters(), 0.05)};
  }
  void training_step(const torch::data::Example<>& x, volt::Context& ctx) {
    auto opts = ctx.optimizers();
    opts[0].zero_grad();
    opts[1].zero_grad();
    ctx.manual_backward(vt::mse(a(x.data), x.target));
    ctx.manual_backward(vt::mse(b(x.data), x.target));
    if (batch++ == poison_step) {
      torch::NoGradGuard g;
      b->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
    }
    opts[0].step();
    opts[1].step();
  }
};
}  // namespace

TEST_CASE("GPU Fp16Mixed with two optimizers: one loss scale, as ATen's AMP kernels with PyTorch's GradScaler", "[.gpu]") {
  auto loader = gpu_loader(128, 16);
  TwoHeads m, ref;
  volt::Trainer<volt::SingleDevice, volt::Fp16Mixed, volt::GPU> t({.max_epochs = 2});
  t.fit(m, loader);
  // The reference: the loss scaled for each backward, each optimizer unscaled by ATen's kernel with a found_inf of its
  // own and skipped on it, one _amp_update_scale_ per batch on the sum of both found_infs.
  ref.to(torch::kCUDA);
  torch::optim::SGD oa(ref.a->parameters(), 0.05), ob(ref.b->parameters(), 0.05);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA);
  torch::Tensor scale = torch::full({1}, 65536.0f, f32), tracker = torch::zeros({1}, f32.dtype(torch::kInt32));
  int64_t step = 0;
  for (int e = 0; e < 2; ++e) {
    for (auto batch : loader) {
      const auto x = batch.data.cuda(), y = batch.target.cuda();
      oa.zero_grad();
      ob.zero_grad();
      torch::Tensor la, lb;
      {
        volt::detail::AutocastGuard autocast(c10::DeviceType::CUDA, at::kHalf);
        la = vt::mse(ref.a(x), y);
        lb = vt::mse(ref.b(x), y);
      }
      (la * scale).backward();
      (lb * scale).backward();
      if (step++ == ref.poison_step) {
        torch::NoGradGuard g;
        ref.b->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
      }
      torch::Tensor total = torch::zeros({1}, f32);
      for (auto* opt : {static_cast<torch::optim::Optimizer*>(&oa), static_cast<torch::optim::Optimizer*>(&ob)}) {
        std::vector<torch::Tensor> grads;
        for (auto& p : opt->param_groups()[0].params()) grads.push_back(p.grad());
        torch::Tensor found = torch::zeros({1}, f32);
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found, scale.to(torch::kFloat64).reciprocal().to(torch::kFloat32));
        if (found.item<float>() == 0.0f) opt->step();
        total = total + found;
      }
      at::_amp_update_scale_(scale, tracker, total, 2.0, 0.5, 2000);
    }
  }
  CHECK(t.precision().scaler().get_scale() == scale.item<float>());
  // Backed off at least once (the poisoned batch); float16's range gave more on an H200 (4096), in both alike.
  CHECK(t.precision().scaler().get_scale() <= 32768.0);
  CHECK(t.global_step() == 2 * 8 * 2);
  CHECK(torch::equal(vt::flat_params(m).cpu(), vt::flat_params(ref).cpu()));
}

namespace {
/// A linear map trained with Adam, so the optimizer's state (exp_avg, exp_avg_sq) lives on the GPU too.
struct AdamNetImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  AdamNetImpl() {
    torch::manual_seed(5);
    lin = register_module("lin", torch::nn::Linear(256, 256));
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return torch::mse_loss(lin(b.data), b.target);
  }
  torch::optim::Adam configure_optimizers() { return torch::optim::Adam(parameters(), torch::optim::AdamOptions(1e-3)); }
};
TORCH_MODULE(AdamNet);

}  // namespace

TEST_CASE("GPU asynchronous saves: CUDA state copied into pinned memory at the save point, the bytes of a sync save",
          "[.gpu]") {
  const auto dir = vt::scratch("gpu_async");
  torch::manual_seed(3);
  auto x = torch::randn({64, 256}), y = torch::randn({64, 256});
  std::map<int64_t, torch::Tensor> weights;
  AdamNet net;
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::GPU>(
      {.max_epochs = 2}, vt::WeightLog{&weights},
      volt::ModelCheckpoint({.dirpath = (dir / "steps").string(), .filename = "{step}", .save_top_k = -1,
                             .every_n_train_steps = 1, .async_save = true, .save_safetensors = true}));
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = 8}));
  REQUIRE(net->lin->weight.is_cuda());
  REQUIRE(weights.size() == 16);
  // Each step's file holds that step's weights (the optimizer kept changing them on the GPU while the write went on).
  for (const auto& [step, w] : weights) {
    INFO("step " << step);
    const auto d = volt::checkpoint::read((dir / "steps" / ("step=" + std::to_string(step) + ".ckpt")).string());
    const auto saved = d.at("state_dict").toGenericDict().at("lin.weight").toTensor();
    CHECK(saved.is_cpu());
    CHECK(torch::equal(saved, w));
    const auto beside =
        volt::safetensors::read((dir / "steps" / ("step=" + std::to_string(step) + ".safetensors")).string());
    const auto it = std::find_if(beside.tensors.begin(), beside.tensors.end(),
                                 [](const auto& e) { return e.first == "lin.weight"; });
    REQUIRE(it != beside.tensors.end());
    CHECK(torch::equal(it->second, w));  // the weights file beside it too
  }
  // The same state saved both ways after the fit: the same bytes (optimizer state from the GPU included), and the
  // same weights files beside them.
  trainer.save_checkpoint(std::vector<std::string>{(dir / "sync.ckpt").string()}, {.safetensors = true});
  trainer.save_checkpoint(std::vector<std::string>{(dir / "async.ckpt").string()},
                          {.async_save = true, .safetensors = true});
  trainer.wait_for_checkpoint();
  CHECK(vt::read_bytes(dir / "sync.ckpt") == vt::read_bytes(dir / "async.ckpt"));
  CHECK(vt::read_bytes(dir / "sync.safetensors") == vt::read_bytes(dir / "async.safetensors"));
  CHECK(vt::read_bytes(dir / "sync.ckpt").size() > 2 * 256 * 256 * 4);  // weights and Adam's two moments at least
}
