// Unit tests of the policies and helpers on their own, on CPU tensors.

#include "common.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>

using Catch::Matchers::Contains;

// ---- the C++ runtime ----------------------------------------------------------------------------------

// pip's LibTorch exports a copy of std::filesystem whose remove_all jumps to address 0; volt::volt links
// libstdc++ first so that programs bind to the runtime's own copy (CMakeLists.txt, VOLT_LIBSTDCXX_FIRST).
TEST_CASE("std::filesystem calls reach the C++ runtime, not a copy inside LibTorch", "[unit]") {
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&);
  const RemoveAll remove_all = &std::filesystem::remove_all;
  Dl_info info{};
  REQUIRE(::dladdr(reinterpret_cast<void*>(remove_all), &info) != 0);
  REQUIRE(info.dli_fname != nullptr);
  INFO("std::filesystem::remove_all resolves into " << info.dli_fname);
  CHECK_THAT(info.dli_fname, Contains("libstdc++"));
  // And the call that crashed: a tree of folders and a file.
  const auto dir = std::filesystem::temp_directory_path() / ("volt_fs_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "f") << "x";
  CHECK(std::filesystem::remove_all(dir) == 4);
  CHECK_FALSE(std::filesystem::exists(dir));
}

// ---- concept truth tables ------------------------------------------------------------------------------

namespace {
struct MyFp16Cpu : volt::CPU {  // a user's accelerator claiming float16 autocast
  static constexpr bool has_fp16_autocast = true;
};
}  // namespace

TEST_CASE("each shipped policy models its kind and no other", "[unit]") {
  STATIC_REQUIRE(volt::Accelerator<volt::CPU>);
  STATIC_REQUIRE(volt::Accelerator<volt::GPU>);
  STATIC_REQUIRE(volt::Precision<volt::Fp32>);
  STATIC_REQUIRE(volt::Precision<volt::Fp64True>);
  STATIC_REQUIRE(volt::Precision<volt::Bf16Mixed>);
  STATIC_REQUIRE(volt::Precision<volt::Fp16Mixed>);
  STATIC_REQUIRE(volt::Precision<volt::Bf16True>);
  STATIC_REQUIRE(volt::Strategy<volt::SingleDevice>);
  STATIC_REQUIRE_FALSE(volt::Strategy<volt::Fp32>);
  STATIC_REQUIRE_FALSE(volt::Precision<volt::CPU>);
  STATIC_REQUIRE_FALSE(volt::Accelerator<volt::SingleDevice>);
  STATIC_REQUIRE_FALSE(volt::Accelerator<int>);
  STATIC_REQUIRE(std::is_same_v<volt::Bf16, volt::Bf16Mixed>);
  STATIC_REQUIRE(std::is_same_v<volt::Fp16, volt::Fp16Mixed>);
  // the compatibility rules read capability flags
  STATIC_REQUIRE_FALSE(volt::Fp16AutocastAvailable<volt::Fp16Mixed, volt::CPU>);
  STATIC_REQUIRE(volt::Fp16AutocastAvailable<volt::Fp16Mixed, volt::GPU>);
  STATIC_REQUIRE(volt::Bf16AutocastAvailable<volt::Bf16Mixed, volt::CPU>);
  STATIC_REQUIRE(volt::Fp16AutocastAvailable<volt::Fp32, volt::CPU>);
  // a user's own accelerator takes part on equal terms
  STATIC_REQUIRE(volt::Fp16AutocastAvailable<volt::Fp16Mixed, MyFp16Cpu>);
  // modules
  STATIC_REQUIRE(volt::Module<vt::Regressor>);
  STATIC_REQUIRE(volt::Module<vt::RegressorImpl>);
  STATIC_REQUIRE(volt::TrainableOn<vt::Regressor, torch::data::Example<>>);
  STATIC_REQUIRE_FALSE(volt::TrainableOn<vt::Regressor, torch::Tensor>);
  STATIC_REQUIRE_FALSE(volt::Module<torch::nn::LinearImpl>);
}

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
    ob.zero_grad();
    vt::mse(b.forward(x), y).backward();
    ob.step();
  }
  CHECK(torch::allclose(vt::flat_params(a), vt::flat_params(b), 1e-6, 1e-7));
  CHECK(precision.state_dict().at("scale") == 65536.0);
  CHECK(precision.state_dict().at("_growth_tracker") == 5.0);
}

// ---- options ------------------------------------------------------------------------------------------------

TEST_CASE("Limit resolves counts and fractions as Lightning", "[unit]") {
  CHECK(volt::Limit(5).resolve(10, "x") == 5);
  CHECK(volt::Limit(50).resolve(10, "x") == 10);
  CHECK(volt::Limit(0.25).resolve(10, "x") == 2);
  CHECK(volt::Limit(1.0).resolve(10, "x") == 10);
  CHECK(volt::Limit(1.0).resolve(-1, "x") == -1);
  CHECK(volt::Limit(7).resolve(-1, "x") == 7);
  CHECK(volt::Limit(0).resolve(10, "x") == 0);
  CHECK(volt::Limit(0.0).resolve(10, "x") == 0);
  CHECK_THROWS_WITH(volt::Limit(0.05).resolve(10, "limit_val_batches"),
                    Contains("limit_val_batches=0.05") && Contains("less than one batch"));
}

// ---- batches and loaders --------------------------------------------------------------------------------

TEST_CASE("batch helpers reach every tensor of nested batches", "[unit]") {
  using B = std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::pair<int, torch::Tensor>>;
  B b{torch::ones({3, 2}), {torch::zeros({3}), torch::ones({3}, torch::kLong)}, {7, torch::ones({3, 1})}};
  auto c = volt::batch_to_floating_dtype(b, torch::kFloat64);
  CHECK(std::get<0>(c).scalar_type() == torch::kFloat64);
  CHECK(std::get<1>(c)[0].scalar_type() == torch::kFloat64);
  CHECK(std::get<1>(c)[1].scalar_type() == torch::kLong);  // integer tensors stay
  CHECK(std::get<2>(c).first == 7);
  CHECK(volt::infer_batch_size(b) == 3);
  torch::data::Example<> e{torch::ones({5, 2}), torch::ones({5})};
  CHECK(volt::infer_batch_size(e) == 5);
  CHECK(volt::batch_to_device(e, torch::kCPU).data.sizes() == e.data.sizes());
}

namespace {
struct Opaque {  // no BatchTraits
  torch::Tensor x;
};
}  // namespace

TEST_CASE("MappableBatch: which batch types volt can look inside", "[unit]") {
  STATIC_REQUIRE(volt::MappableBatch<torch::Tensor>);
  STATIC_REQUIRE(volt::MappableBatch<torch::data::Example<>>);
  STATIC_REQUIRE(volt::MappableBatch<std::tuple<torch::Tensor, std::vector<torch::Tensor>, std::pair<int, torch::Tensor>>>);
  STATIC_REQUIRE(volt::MappableBatch<std::map<std::string, std::optional<torch::Tensor>>>);
  STATIC_REQUIRE_FALSE(volt::MappableBatch<Opaque>);
  STATIC_REQUIRE_FALSE(volt::MappableBatch<std::vector<Opaque>>);  // a known container of an unknown type
  STATIC_REQUIRE_FALSE(volt::MappableBatch<std::pair<torch::Tensor, Opaque>>);
  STATIC_REQUIRE_FALSE(volt::MappableBatch<torch::data::Example<Opaque, torch::Tensor>>);
}

TEST_CASE("TensorLoader: sizes, views, per-epoch seeded shuffles", "[unit][data]") {
  auto x = torch::arange(10, torch::kFloat32).unsqueeze(1);
  auto y = torch::arange(10);
  volt::data::TensorLoader plain(x, y, {.batch_size = 4});
  CHECK(plain.size() == 3);
  std::vector<int64_t> seen;
  for (auto b : plain) {
    for (int64_t i = 0; i < b.target.size(0); ++i) seen.push_back(b.target[i].item<int64_t>());
  }
  CHECK(seen == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  volt::data::TensorLoader dropping(x, y, {.batch_size = 4, .drop_last = true});
  CHECK(dropping.size() == 2);

  volt::data::TensorLoader shuffled(x, y, {.batch_size = 3, .shuffle = true, .seed = 5});
  auto epoch_order = [&](int64_t e) {
    shuffled.set_epoch(e);
    std::vector<int64_t> o;
    for (auto b : shuffled)
      for (int64_t i = 0; i < b.target.size(0); ++i) o.push_back(b.target[i].item<int64_t>());
    return o;
  };
  auto e0 = epoch_order(0), e0again = epoch_order(0), e1 = epoch_order(1);
  CHECK(e0 == e0again);
  CHECK(e0 != e1);
  std::sort(e1.begin(), e1.end());
  CHECK(e1 == seen);  // a permutation: every sample once
  // independent of the global generator
  torch::manual_seed(999);
  CHECK(epoch_order(0) == e0);
  CHECK_THROWS_WITH(volt::data::TensorLoader(x, torch::arange(9), {}), Contains("10 samples") && Contains("9 targets"));
  CHECK_THROWS_WITH(volt::data::TensorLoader(x, y, {.batch_size = 0}), Contains("batch_size=0"));
}

TEST_CASE("Context::log refuses values that cannot be logged", "[unit]") {
  volt::detail::LoopState state;
  volt::detail::MetricStore store;
  volt::Context ctx(state, store);
  state.in_batch = true;
  CHECK_THROWS_WITH(ctx.log("v", torch::ones({3})), Contains("3 elements"));
  CHECK_THROWS_WITH(ctx.log("v", 1.0, {.on_step = false, .on_epoch = false}), Contains("record nothing"));
  ctx.log("v", 1.0, {.on_step = true, .on_epoch = false});
  CHECK_THROWS_WITH(ctx.log("v", 1.0, {.on_step = false, .on_epoch = true}), Contains("different"));
  state.in_batch = false;
  CHECK_THROWS_WITH(ctx.log("w", 1.0, {.on_step = true}), Contains("outside a step"));
}

// ---- distributed pieces that run in one process -------------------------------------------------------

namespace {
/// Sets environment variables for one scope, restoring what was there.
struct EnvGuard {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  void set(const std::string& k, const std::string& v) {
    const char* old = std::getenv(k.c_str());
    saved.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
    ::setenv(k.c_str(), v.c_str(), 1);
  }
  ~EnvGuard() {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      if (it->second) ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else ::unsetenv(it->first.c_str());
    }
  }
};
}  // namespace

TEST_CASE("cluster environments: Open MPI, SLURM, torchrun variables and contradictions", "[unit][dist]") {
  REQUIRE(std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr);  // the test itself runs plainly
  SECTION("none") { CHECK(volt::cluster::detect().source == volt::cluster::Source::none); }
  SECTION("Open MPI: node rank from the local size") {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_SIZE", "8");
    g.set("OMPI_COMM_WORLD_RANK", "5");
    g.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
    g.set("OMPI_COMM_WORLD_LOCAL_SIZE", "4");
    const auto e = volt::cluster::detect();
    CHECK(e.source == volt::cluster::Source::open_mpi);
    CHECK((e.world_size == 8 && e.rank == 5 && e.local_rank == 1 && e.node_rank == 1));
    CHECK_NOTHROW(volt::cluster::check_against(e, 4, 2));
    CHECK_THROWS_WITH(volt::cluster::check_against(e, 2, 1),
                      Contains("started 8 processes") && Contains("devices=2 x num_nodes=1 = 2"));
  }
  SECTION("SLURM inside a step") {
    EnvGuard g;
    g.set("SLURM_STEP_NUM_TASKS", "4");
    g.set("SLURM_PROCID", "3");
    g.set("SLURM_LOCALID", "1");
    g.set("SLURM_NODEID", "1");
    const auto e = volt::cluster::detect();
    CHECK((e.source == volt::cluster::Source::slurm && e.rank == 3 && e.local_rank == 1 && e.node_rank == 1));
  }
  SECTION("torchrun") {
    EnvGuard g;
    g.set("WORLD_SIZE", "2");
    g.set("RANK", "1");
    g.set("LOCAL_RANK", "1");
    const auto e = volt::cluster::detect();
    CHECK((e.source == volt::cluster::Source::torchrun && e.world_size == 2 && e.rank == 1));
  }
  SECTION("a variable that is not a number") {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_SIZE", "two");
    CHECK_THROWS_WITH(volt::cluster::detect(), Contains("OMPI_COMM_WORLD_SIZE=\"two\""));
  }
}

TEST_CASE("TensorLoader::shard splits one permutation like DistributedSampler", "[unit][data][dist]") {
  auto x = torch::arange(10, torch::kFloat32).unsqueeze(1);
  volt::data::TensorLoader whole(x, x, {.batch_size = 2, .shuffle = true, .seed = 4});
  whole.set_epoch(3);
  const auto perm = whole.order();
  for (int world : {2, 3, 4}) {
    std::vector<int64_t> seen;
    int64_t batches = -1;
    for (int r = 0; r < world; ++r) {
      auto s = whole.shard(r, world);
      s.set_epoch(3);
      CHECK(s.num_samples() == (10 + world - 1) / world);
      if (batches >= 0) CHECK(s.size() == batches);  // equal batch counts on every rank
      batches = s.size();
      int64_t k = 0;
      for (auto b : s) {
        for (int64_t i = 0; i < b.data.size(0); ++i, ++k) {
          const int64_t idx = b.data[i][0].item<int64_t>();
          // position r + k*world of the padded global order (the order repeats from its start)
          CHECK(idx == perm[(r + k * world) % 10].item<int64_t>());
          seen.push_back(idx);
        }
      }
    }
    std::sort(seen.begin(), seen.end());
    CHECK(std::unique(seen.begin(), seen.end()) - seen.begin() == 10);
  }
  CHECK_THROWS_WITH(whole.shard(2, 2), Contains("rank=2, world_size=2"));
}

TEST_CASE("DDP at world size 1 (MPI singleton, real reducer) trains as SingleDevice", "[unit][dist]") {
  auto [x, y] = vt::regression_data(64);
  vt::Regressor a, b;
  vt::copy_weights(*a, *b);
  volt::Trainer<volt::SingleDevice> single({.max_epochs = 2, .accumulate_grad_batches = 2});
  volt::Trainer<volt::DDP<volt::Script>> ddp({.max_epochs = 2, .accumulate_grad_batches = 2});
  single.fit(a, volt::data::TensorLoader(x, y, {.batch_size = 8, .shuffle = true, .seed = 2}));
  ddp.fit(b, volt::data::TensorLoader(x, y, {.batch_size = 8, .shuffle = true, .seed = 2}));
  CHECK(ddp.strategy().world_size() == 1);
  CHECK(ddp.strategy().bucket_layout().size() == 1);  // two small parameters: one bucket
  CHECK(torch::allclose(vt::flat_params(*a), vt::flat_params(*b), 1e-6, 1e-7));
  CHECK(volt::detail::MpiRuntime::instance().initialized());
}

TEST_CASE("Spawn refuses to run inside a job started by mpirun", "[unit][dist]") {
  {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_SIZE", "2");
    g.set("OMPI_COMM_WORLD_RANK", "0");
    auto [x, y] = vt::regression_data(16);
    vt::Regressor m;
    volt::Trainer<volt::DDP<volt::Spawn>> t({.devices = 2});
    CHECK_THROWS_WITH(t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8})),
                      Contains("DDP<Spawn> inside a job started by Open MPI") && Contains("Use DDP<Script>"));
  }
  CHECK_FALSE(volt::Spawn::is_worker());
}
