// Integration tests: whole fit/validate/test/predict runs on CPU, each checked against an independent
// reference (a hand-written LibTorch loop, hand-derived counts, or a known answer).

#include "common.hpp"
#include "support/concept_policies.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <numeric>
#include <chrono>

#include <unistd.h>

namespace {

/// The reference: a hand-written LibTorch loop, SGD over the loader's batches in order.
void hand_loop(vt::RegressorImpl& m, const volt::data::TensorLoader& loader, int epochs) {
  torch::optim::SGD opt(m.parameters(), torch::optim::SGDOptions(m.lr));
  for (int e = 0; e < epochs; ++e) {
    for (auto b : loader) {
      opt.zero_grad();
      vt::mse(m.forward(b.data), b.target).backward();
      opt.step();
    }
  }
}

}  // namespace

TEST_CASE("Fp32 SingleDevice fit equals a hand-written LibTorch loop", "[trainer]") {
  auto [x, y] = vt::regression_data(96);
  auto loader = make_loader(x, y, 16);
  Regressor a, b;
  vt::copy_weights(*a, *b);
  volt::Trainer<> trainer({.max_epochs = 3});
  trainer.fit(a, loader);
  hand_loop(*b, loader, 3);
  CHECK(trainer.global_step() == 18);
  CHECK(trainer.current_epoch() == 3);
  CHECK(torch::allclose(vt::flat_params(*a), vt::flat_params(*b), 1e-6, 1e-7));
}

TEST_CASE("accumulating k batches equals one batch k times larger", "[trainer]") {
  auto [x, y] = vt::regression_data(120);
  for (int64_t k : {2, 3, 4}) {
    Regressor acc, big;
    vt::copy_weights(*acc, *big);
    auto small = make_loader(x, y, 10);
    auto large = make_loader(x, y, 10 * k);
    volt::Trainer<> t({.max_epochs = 2, .accumulate_grad_batches = k});
    t.fit(acc, small);
    hand_loop(*big, large, 2);
    INFO("k=" << k);
    // 120 samples: 12 small batches, ceil(12 / k) optimizer steps per epoch
    CHECK(t.global_step() == 2 * ((12 + k - 1) / k));
    CHECK(torch::allclose(vt::flat_params(*acc), vt::flat_params(*big), 1e-5, 1e-6));
  }
}

TEST_CASE("accumulation also works through an unsized torch::data loader", "[trainer]") {
  // 10 batches of 8 with k=4: steps after batches 4, 8 and the last (10), as Lightning steps on the epoch's last batch.
  auto [x, y] = vt::regression_data(80);
  std::vector<torch::data::Example<>> batches;
  for (int64_t i = 0; i < 10; ++i) batches.push_back({x.narrow(0, i * 8, 8), y.narrow(0, i * 8, 8)});
  struct Unsized {  // only begin/end: the Trainer must read ahead to find the last batch
    std::vector<torch::data::Example<>>* v;
    auto begin() { return v->begin(); }
    auto end() { return v->end(); }
  } loader{&batches};
  Regressor m;
  volt::Trainer<> t({.max_epochs = 1, .accumulate_grad_batches = 4});
  t.fit(m, loader);
  CHECK(t.global_step() == 3);
  CHECK(t.num_training_batches() == -1);
}

TEST_CASE("gradient clipping bounds the applied gradient", "[trainer]") {
  auto [x, y] = vt::regression_data(64);
  y = y * 100.0;  // large residuals: large gradients
  auto loader = make_loader(x, y, 64);
  SECTION("by norm: the update equals lr times the gradient rescaled to the clip norm") {
    Regressor m(1.0), ref(1.0);
    vt::copy_weights(*m, *ref);
    volt::Trainer<> t({.max_steps = 1, .gradient_clip_val = 0.5});
    t.fit(m, loader);
    // reference by hand
    auto loss = vt::mse(ref->forward(x), y);
    loss.backward();
    double norm2 = 0;
    for (auto& p : ref->parameters()) norm2 += p.grad().pow(2).sum().item<double>();
    const double norm = std::sqrt(norm2);
    REQUIRE(norm > 0.5);
    torch::Tensor update = vt::flat_params(*ref) - vt::flat_params(*m);  // = lr * clipped grad
    CHECK(update.norm().item<double>() == Approx(0.5).epsilon(1e-4));
    std::vector<torch::Tensor> g;
    for (auto& p : ref->parameters()) g.push_back(p.grad().to(torch::kFloat64).flatten());
    CHECK(torch::allclose(update, torch::cat(g) * (0.5 / (norm + 1e-6)), 1e-4, 1e-6));
  }
  SECTION("by value: every component of the update is at most the clip value") {
    Regressor m(1.0), ref(1.0);
    vt::copy_weights(*m, *ref);
    volt::Trainer<> t({.max_steps = 1, .gradient_clip_val = 0.25, .gradient_clip_algorithm = volt::ClipAlgorithm::value});
    t.fit(m, loader);
    torch::Tensor update = vt::flat_params(*ref) - vt::flat_params(*m);
    CHECK(update.abs().max().item<double>() <= 0.25 + 1e-7);
    CHECK(update.abs().max().item<double>() == Approx(0.25));
  }
}

namespace {
struct Counts {
  int64_t train_batches, val_runs, val_batches, sanity_batches, steps, epochs;
};
Counts run_counts(volt::TrainerOptions o, int64_t n_train_batches, int64_t n_val_batches) {
  auto [x, y] = vt::regression_data(n_train_batches * 4);
  auto [vx, vy] = vt::regression_data(n_val_batches * 4, 9);
  auto train = make_loader(x, y, 4);
  auto val = make_loader(vx, vy, 4);
  Regressor m;
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU, vt::Recorder> t(o, vt::Recorder{nullptr});
  t.fit(m, train, val);
  auto& r = t.callback<vt::Recorder>();
  return {r.train_batches, r.val_runs, r.val_batches, r.sanity_batches, t.global_step(), r.train_epochs};
}
}  // namespace

TEST_CASE("limits, val_check_interval and max_steps give the expected numbers of steps and validations",
          "[trainer]") {
  SECTION("defaults: every batch, one validation per epoch, 2 sanity batches") {
    auto c = run_counts({.max_epochs = 2}, 10, 5);
    CHECK(c.train_batches == 20);
    CHECK(c.steps == 20);
    CHECK(c.val_runs == 2);
    CHECK(c.val_batches == 10);
    CHECK(c.sanity_batches == 2);
  }
  SECTION("limit fractions and counts") {
    auto c = run_counts({.max_epochs = 2, .limit_train_batches = 0.5, .limit_val_batches = 3, .num_sanity_val_steps = -1},
                        10, 5);
    CHECK(c.train_batches == 10);
    CHECK(c.val_runs == 2);
    CHECK(c.val_batches == 6);
    CHECK(c.sanity_batches == 3);  // -1: the whole (limited) validation loader
  }
  SECTION("val_check_interval as a fraction: int(8 * 0.25) = every 2 batches") {
    auto c = run_counts({.max_epochs = 1, .val_check_interval = 0.25, .num_sanity_val_steps = 0}, 8, 2);
    CHECK(c.val_runs == 4);
    CHECK(c.sanity_batches == 0);
  }
  SECTION("val_check_interval as a count: batches 3, 6 and 9 of 10") {
    auto c = run_counts({.max_epochs = 2, .val_check_interval = 3}, 10, 2);
    CHECK(c.val_runs == 6);
  }
  SECTION("val_check_interval counted across epochs when check_val_every_n_epoch is unset") {
    // 6 batches x 2 epochs = 12 batches; validation after total batches 4, 8, 12.
    auto c = run_counts({.max_epochs = 2, .val_check_interval = 4, .check_val_every_n_epoch = std::nullopt}, 6, 2);
    CHECK(c.val_runs == 3);
  }
  SECTION("check_val_every_n_epoch") {
    auto c = run_counts({.max_epochs = 5, .check_val_every_n_epoch = 2}, 3, 2);
    CHECK(c.val_runs == 2);  // after epochs 1 and 3 (0-based)
  }
  SECTION("max_steps ends the run mid-epoch, before that epoch's validation, and leaves the epoch open") {
    auto c = run_counts({.max_epochs = 5, .max_steps = 7}, 10, 2);
    CHECK(c.steps == 7);
    CHECK(c.train_batches == 7);
    CHECK(c.epochs == 0);  // no on_train_epoch_end: the epoch is not over (docs/reference.md)
    CHECK(c.val_runs == 0);
  }
  SECTION("max_steps at an epoch's last batch ends the epoch") {
    auto c = run_counts({.max_epochs = 5, .max_steps = 10}, 10, 2);
    CHECK(c.steps == 10);
    CHECK(c.epochs == 1);
    CHECK(c.val_runs == 1);
  }
  SECTION("max_steps counts optimizer steps, not batches, under accumulation") {
    auto c = run_counts({.max_epochs = 5, .max_steps = 5, .accumulate_grad_batches = 3}, 10, 2);
    // 4 steps per epoch (after batches 3, 6, 9, 10): the fifth step is the third batch of epoch 1.
    CHECK(c.steps == 5);
    CHECK(c.train_batches == 13);
  }
  SECTION("max_epochs unset with max_steps: steps decide") {
    auto c = run_counts({.max_steps = 25}, 10, 2);
    CHECK(c.steps == 25);
    CHECK(c.epochs == 2);  // two epochs ended; the third stays open after its fifth batch
  }
  SECTION("fast_dev_run=2: 2 training and 2 validation batches once, no sanity check") {
    auto c = run_counts({.max_epochs = 10, .fast_dev_run = 2}, 10, 5);
    CHECK(c.train_batches == 2);
    CHECK(c.steps == 2);
    CHECK(c.val_batches == 2);
    CHECK(c.val_runs == 1);
    CHECK(c.sanity_batches == 0);
  }
  SECTION("limit_train_batches=0 skips training") {
    auto c = run_counts({.max_epochs = 3, .limit_train_batches = 0}, 10, 2);
    CHECK(c.train_batches == 0);
    CHECK(c.steps == 0);
  }
  SECTION("an integer val_check_interval larger than the epoch is an error naming both numbers") {
    CHECK_THROWS_WITH(run_counts({.max_epochs = 1, .val_check_interval = 20}, 10, 2),
                      Contains("val_check_interval=20") && Contains("(10)"));
  }
}

TEST_CASE("two deterministic runs with one seed end with bit-identical weights", "[trainer]") {
  auto [x, y] = vt::regression_data(256);
  auto run = [&](uint64_t seed) {
    struct Net : torch::nn::Module {  // dropout: the run consumes the global generator
      torch::nn::Linear a{nullptr}, b{nullptr};
      torch::nn::Dropout drop{0.2};
      Net() {
        a = register_module("a", torch::nn::Linear(4, 32));
        b = register_module("b", torch::nn::Linear(32, 1));
        register_module("drop", drop);
      }
      torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context&) {
        return vt::mse(b(drop(torch::relu(a(batch.data)))), batch.target);
      }
      torch::optim::Adam configure_optimizers() { return torch::optim::Adam(parameters(), 1e-2); }
    };
    torch::manual_seed(seed);
    Net net;
    auto loader = make_loader(x, y, 32, /*shuffle=*/true, seed);
    volt::Trainer<> t({.max_epochs = 3, .deterministic = true, .seed = seed});
    t.fit(net, loader);
    return vt::flat_params(net);
  };
  const auto first = run(123), second = run(123), other = run(124);
  CHECK(torch::equal(first, second));
  CHECK_FALSE(torch::equal(first, other));
}

TEST_CASE("benchmark sets cuDNN's autotuner as Lightning's does, and is refused with deterministic", "[trainer]") {
  auto& context = at::globalContext();
  const bool before = context.benchmarkCuDNN();
  auto [x, y] = vt::regression_data(32);
  auto fit_with = [&](volt::TrainerOptions options) {
    vt::Regressor net;
    auto loader = make_loader(x, y, 16);
    options.max_epochs = 1;
    volt::Trainer<>(options).fit(net, loader);
    return context.benchmarkCuDNN();
  };
  context.setBenchmarkCuDNN(false);
  CHECK(fit_with({.benchmark = true}));
  CHECK(fit_with({}));  // unset: as the process has it (Lightning's None)
  CHECK_FALSE(fit_with({.benchmark = false}));
  context.setBenchmarkCuDNN(true);
  CHECK_FALSE(fit_with({.deterministic = true}));  // unset under deterministic: off
  CHECK_THROWS_WITH(volt::Trainer<>({.deterministic = true, .benchmark = true}),
                    Contains("benchmark=true with deterministic=true is not allowed"));
  context.setBenchmarkCuDNN(before);
  context.setDeterministicAlgorithms(false, false);
  context.setDeterministicCuDNN(false);
}

TEST_CASE("hooks and callbacks fire in Lightning's order", "[trainer]") {
  std::vector<std::string> log;
  struct Hooked : vt::RegressorImpl {
    std::vector<std::string>* log = nullptr;
    void add(const std::string& s) { log->push_back("m:" + s); }
    void setup(volt::Stage) { add("setup"); }
    void teardown(volt::Stage) { add("teardown"); }
    void on_fit_start() { add("on_fit_start"); }
    void on_fit_end() { add("on_fit_end"); }
    void on_train_start() { add("on_train_start"); }
    void on_train_end() { add("on_train_end"); }
    void on_train_epoch_start() { add("on_train_epoch_start"); }
    void on_train_epoch_end(volt::Context&) { add("on_train_epoch_end"); }
    void on_train_batch_start(const torch::data::Example<>&, int64_t) { add("on_train_batch_start"); }
    void on_train_batch_end(const torch::Tensor&, const torch::data::Example<>&, int64_t) { add("on_train_batch_end"); }
    void on_validation_start() { add("on_validation_start"); }
    void on_validation_end() { add("on_validation_end"); }
    void on_validation_epoch_start() { add("on_validation_epoch_start"); }
    void on_validation_epoch_end() { add("on_validation_epoch_end"); }
    void on_validation_batch_start(const torch::data::Example<>&, int64_t) { add("on_validation_batch_start"); }
    void on_validation_batch_end(const torch::Tensor&, const torch::data::Example<>&, int64_t) {
      add("on_validation_batch_end");
    }
    void on_before_zero_grad(torch::optim::Optimizer&) { add("on_before_zero_grad"); }
    void on_before_backward(const torch::Tensor&) { add("on_before_backward"); }
    void on_after_backward() { add("on_after_backward"); }
    void on_before_optimizer_step(torch::optim::Optimizer&) { add("on_before_optimizer_step"); }
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      add("training_step");
      return vt::RegressorImpl::training_step(b, ctx);
    }
    void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
      add("validation_step");
      vt::RegressorImpl::validation_step(b, ctx);
    }
    torch::optim::SGD configure_optimizers() {
      add("configure_optimizers");
      return vt::RegressorImpl::configure_optimizers();
    }
  } m;
  m.log = &log;
  auto [x, y] = vt::regression_data(8);
  auto train = make_loader(x, y, 4);
  auto val = make_loader(x, y, 8);
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU, vt::Recorder> t({.max_epochs = 1, .num_sanity_val_steps = 1},
                                                                           vt::Recorder{&log});
  t.fit(m, train, val);

  // Lightning 2.x's order (its tests/tests_pytorch/models/test_hooks.py), callbacks before the module.
  auto both = [](std::vector<std::string>& v, const std::string& h) {
    v.push_back("cb:" + h);
    v.push_back("m:" + h);
  };
  std::vector<std::string> want{"m:setup", "m:configure_optimizers"};
  both(want, "on_fit_start");
  want.push_back("cb:on_sanity_check_start");
  auto validation = [&](int batches) {
    both(want, "on_validation_start");
    both(want, "on_validation_epoch_start");
    for (int i = 0; i < batches; ++i) {
      both(want, "on_validation_batch_start");
      want.push_back("m:validation_step");
      both(want, "on_validation_batch_end");
    }
    both(want, "on_validation_epoch_end");
    both(want, "on_validation_end");
  };
  validation(1);
  want.push_back("cb:on_sanity_check_end");
  both(want, "on_train_start");
  both(want, "on_train_epoch_start");
  for (int i = 0; i < 2; ++i) {
    both(want, "on_train_batch_start");
    want.push_back("m:training_step");
    both(want, "on_before_zero_grad");
    both(want, "on_before_backward");
    both(want, "on_after_backward");
    both(want, "on_before_optimizer_step");
    both(want, "on_train_batch_end");
  }
  validation(1);
  both(want, "on_train_epoch_end");
  both(want, "on_train_end");
  both(want, "on_fit_end");
  want.push_back("m:teardown");
  CHECK(log == want);
}

TEST_CASE("epoch values are batch-size weighted means; step values are the last step's", "[trainer]") {
  // 10 samples in batches of 4, 4, 2; the logged value of a batch is the mean of its targets.
  auto x = torch::zeros({10, 4});
  auto y = torch::arange(10, torch::kFloat32).unsqueeze(1);
  auto loader = make_loader(x, y, 4);
  struct Logs : vt::RegressorImpl {
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      ctx.log("v", b.target.mean(), {.on_step = true, .on_epoch = true});
      ctx.log("mx", b.target.max(), {.on_step = false, .on_epoch = true, .reduce = volt::Reduce::max});
      return vt::mse(forward(b.data), b.target);
    }
  } m;
  volt::Trainer<> t({.max_epochs = 1});
  t.fit(m, loader);
  const auto metrics = t.callback_metric_values();
  CHECK(metrics.at("v_epoch") == Approx(4.5));           // (1.5*4 + 5.5*4 + 8.5*2) / 10
  CHECK(metrics.at("v_step") == Approx(8.5));            // the last batch's
  CHECK(metrics.at("mx") == Approx(9.0));
  CHECK(metrics.count("v") == 0);
}

namespace {
struct PlainBatch {  // a batch type volt has no BatchTraits for
  torch::Tensor x, y;
};
}  // namespace

TEST_CASE("a batch type without BatchTraits trains on CPU/Fp32; ctx.log then needs its size", "[trainer]") {
  auto [x, y] = vt::regression_data(48);
  auto loader = make_loader(x, y, 16);
  std::vector<PlainBatch> plain;
  for (auto b : loader) plain.push_back({b.data, b.target});
  struct Plain : vt::RegressorImpl {
    bool give_size = true;
    torch::Tensor training_step(const PlainBatch& b, volt::Context& ctx) {
      auto loss = vt::mse(forward(b.x), b.y);
      if (give_size) {
        ctx.log("loss", loss, {.on_epoch = true, .batch_size = b.x.size(0)});
      } else {
        ctx.log("loss", loss, {.on_epoch = true});
      }
      return loss;
    }
  } a;
  Regressor ref;
  vt::copy_weights(a, *ref);
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU> trainer({.max_epochs = 2});
  trainer.fit(a, plain);
  // The reference: the same SGD by hand, keeping the last epoch's losses (equal batches: their plain mean).
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(ref->lr));
  double last_epoch_sum = 0.0;
  for (int e = 0; e < 2; ++e) {
    last_epoch_sum = 0.0;
    for (auto b : loader) {
      opt.zero_grad();
      auto loss = vt::mse(ref->forward(b.data), b.target);
      loss.backward();
      opt.step();
      last_epoch_sum += loss.item<double>();
    }
  }
  CHECK(torch::allclose(vt::flat_params(a), vt::flat_params(*ref), 1e-6, 1e-7));
  CHECK(trainer.callback_metric_values().at("loss_epoch") == Approx(last_epoch_sum / 3.0).epsilon(1e-6));

  a.give_size = false;
  volt::Trainer<volt::SingleDevice, volt::Fp32, volt::CPU> again({.max_epochs = 1});
  CHECK_THROWS_WITH(again.fit(a, plain), Contains("log(\"loss\")") && Contains("PlainBatch") &&
                                             Contains(".batch_size = n") && Contains("BatchTraits"));
}

TEST_CASE("validate, test and predict run without autograd and return their results", "[trainer]") {
  auto [x, y] = vt::regression_data(40);
  auto loader = make_loader(x, y, 8);
  Regressor m;
  volt::Trainer<> t({.limit_test_batches = 3});
  const auto val = t.validate(m, loader);
  const double want = vt::mse(m->forward(x), y).item<double>();  // all batches equal size: mean of means
  CHECK(val.at("val_loss") == Approx(want).epsilon(1e-5));
  const auto test = t.test(m, loader);
  const double want3 = vt::mse(m->forward(x.narrow(0, 0, 24)), y.narrow(0, 0, 24)).item<double>();
  CHECK(test.at("test_loss") == Approx(want3).epsilon(1e-5));
  const auto preds = t.predict(m, loader);
  REQUIRE(preds.size() == 5);
  CHECK(torch::allclose(torch::cat(preds), m->forward(x).detach()));
  CHECK_FALSE(preds[0].requires_grad());
  CHECK(m->is_training());  // mode restored
}

TEST_CASE("a strategy and a callback written from their concept files alone train as a hand-written loop does",
          "[trainer]") {
  auto [x, y] = vt::regression_data(96);
  auto loader = make_loader(x, y, 16);  // 6 batches; windows of 2 micro-batches: 3 optimizer steps per epoch
  Regressor a, ref, initial;
  vt::copy_weights(*a, *ref);
  vt::copy_weights(*a, *initial);
  using T = volt::Trainer<vt::CountingStrategy, volt::Fp32, volt::CPU, vt::EpochLossLog>;
  T trainer({.max_epochs = 3, .accumulate_grad_batches = 2}, vt::EpochLossLog{});
  trainer.fit(a, loader);

  // The reference: the same SGD by hand with the same accumulation, keeping each epoch's last step loss.
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(ref->lr));
  std::vector<double> last_losses;
  for (int e = 0; e < 3; ++e) {
    int64_t i = 0;
    double last = 0.0;
    for (auto b : loader) {
      if (i % 2 == 0) opt.zero_grad();
      auto loss = vt::mse(ref->forward(b.data), b.target);
      (loss / 2.0).backward();
      if (i % 2 == 1) opt.step();
      last = loss.item<double>();
      ++i;
    }
    last_losses.push_back(last);
  }
  CHECK(torch::allclose(vt::flat_params(*a), vt::flat_params(*ref), 1e-6, 1e-7));
  CHECK(trainer.global_step() == 9);
  const auto& log = trainer.callback<vt::EpochLossLog>().losses;
  REQUIRE(log.size() == 3);
  for (std::size_t e = 0; e < 3; ++e) CHECK(log[e] == Approx(last_losses[e]).epsilon(1e-6));

  // Every member in strategies/concept.hpp's table was reached as it says: fit through launch(body, transfer),
  // one set-up, the training loader processed once, a backward hook pair per micro-batch, synced on each step.
  const auto& c = *trainer.strategy().counts;
  CHECK(c.fit_launches == 1);
  CHECK(c.launches == 0);
  CHECK(c.setups == 1);
  CHECK(c.modules == 1);
  CHECK(c.loaders == 1);
  CHECK(c.pre_backward == 18);
  CHECK(c.post_backward == 18);
  CHECK(c.synced_backward == 9);
  CHECK(c.teardowns == 1);
  trainer.validate(a, loader);
  CHECK(c.launches == 1);

  // Its state reaches checkpoints under its state_key, and a resume without a validation loader needs no
  // volt::NoLoader: fit(module, loader, path) goes on as the uninterrupted fit (one more epoch on each side).
  const auto dir = std::filesystem::temp_directory_path() / ("volt_concept_policies_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "after3.ckpt").string();
  trainer.save_checkpoint(path);
  const auto saved = volt::checkpoint::saved_callback_state(path, "EpochLossLog[train_loss]");
  REQUIRE(saved.has_value());
  CHECK(saved->at("epoch2").toDouble() == log[2]);
  Regressor resumed;
  T again({.max_epochs = 4, .accumulate_grad_batches = 2}, vt::EpochLossLog{});
  again.fit(resumed, loader, path);
  Regressor whole;
  vt::copy_weights(*initial, *whole);
  T uninterrupted({.max_epochs = 4, .accumulate_grad_batches = 2}, vt::EpochLossLog{});
  uninterrupted.fit(whole, loader);
  CHECK(again.global_step() == 12);
  CHECK(torch::equal(vt::flat_params(*resumed), vt::flat_params(*whole)));
  CHECK(again.callback<vt::EpochLossLog>().losses == uninterrupted.callback<vt::EpochLossLog>().losses);
  std::filesystem::remove_all(dir);
}

TEST_CASE("run-time settings are checked before anything runs", "[trainer][config]") {
  using T = volt::Trainer<>;
  CHECK_THROWS_WITH(T({.max_epochs = -2}), Contains("max_epochs=-2") && Contains("-1"));
  CHECK_THROWS_WITH(T({.max_steps = -5}), Contains("max_steps=-5"));
  CHECK_THROWS_WITH(T({.accumulate_grad_batches = 0}), Contains("accumulate_grad_batches=0") && Contains("1"));
  CHECK_THROWS_WITH(T({.limit_train_batches = 1.5}), Contains("limit_train_batches=1.5") && Contains("[0, 1.0]"));
  CHECK_THROWS_WITH(T({.limit_val_batches = -3}), Contains("limit_val_batches=-3"));
  CHECK_THROWS_WITH(T({.val_check_interval = 0.0}), Contains("val_check_interval=0"));
  CHECK_THROWS_WITH(T({.gradient_clip_val = -1.0}), Contains("gradient_clip_val=-1") && Contains(">= 0"));
  CHECK_THROWS_WITH(T({.num_sanity_val_steps = -2}), Contains("num_sanity_val_steps=-2"));
  CHECK_THROWS_WITH(T({.check_val_every_n_epoch = 0}), Contains("check_val_every_n_epoch=0"));
  CHECK_THROWS_WITH(T({.devices = 2}), Contains("devices=2") && Contains("DDP"));
  CHECK_THROWS_WITH(T({.devices = 0}), Contains("devices=0"));
  CHECK_THROWS_WITH(T({.max_time = std::chrono::seconds(0)}), StartsWith("volt: max_time=0ms is not allowed"));
  CHECK_THROWS_WITH(T({.timeout = std::chrono::seconds(0)}), StartsWith("volt: timeout=0 ms is not allowed"));
  CHECK_THROWS_AS(T({.max_epochs = -2}), volt::ConfigError);
  CHECK_NOTHROW(T({.max_epochs = -1, .max_steps = 10, .limit_train_batches = 0.25}));
  if (!torch::cuda::is_available()) {
    using G = volt::Trainer<volt::SingleDevice, volt::Fp32, volt::GPU>;
    CHECK_THROWS_WITH(G(volt::TrainerOptions{}), Contains("GPU requested (devices=1)") && Contains("device_count() is 0"));
  }
  SECTION("a fraction limit on a loader without size() says so") {
    std::vector<torch::data::Example<>> batches{{torch::zeros({2, 4}), torch::zeros({2, 1})}};
    struct Unsized {
      std::vector<torch::data::Example<>>* v;
      auto begin() { return v->begin(); }
      auto end() { return v->end(); }
    } loader{&batches};
    Regressor m;
    T t({.max_epochs = 1, .limit_train_batches = 0.5});
    CHECK_THROWS_WITH(t.fit(m, loader), Contains("limit_train_batches=0.5") && Contains("no size()"));
  }
  SECTION("a fraction that rounds to no batch says so") {
    auto [x, y] = vt::regression_data(8);
    auto loader = make_loader(x, y, 4);
    Regressor m;
    T t({.max_epochs = 1, .limit_train_batches = 0.1});
    CHECK_THROWS_WITH(t.fit(m, loader), Contains("less than one batch"));
  }
}

namespace {
struct SeenException {
  bool* seen;
  void on_exception(auto&, auto&, std::exception_ptr) { *seen = true; }
};
}  // namespace

TEST_CASE("a training step's exception reaches the caller and callbacks' on_exception", "[trainer]") {
  struct Boom : vt::RegressorImpl {
    torch::Tensor training_step(const torch::data::Example<>&, volt::Context& ctx) {
      if (ctx.batch_idx() == 2) throw std::runtime_error("boom at batch 2");
      return torch::zeros({}, torch::requires_grad());
    }
  } m;
  bool seen = false;
  auto [x, y] = vt::regression_data(32);
  auto loader = make_loader(x, y, 4);
  auto t = volt::make_trainer({.max_epochs = 1}, SeenException{&seen});
  CHECK_THROWS_WITH(t.fit(m, loader), Contains("training_step failed in epoch 0, batch 2") && Contains("boom at batch 2"));
  CHECK(seen);
}

TEST_CASE("a failing predict reaches callbacks' on_exception, as fit, validate and test do", "[trainer]") {
  struct Boom : vt::RegressorImpl {
    torch::Tensor predict_step(const torch::data::Example<>&, volt::Context& ctx) {
      if (ctx.batch_idx() == 1) throw std::runtime_error("boom in predict");
      return torch::zeros({1});
    }
  } m;
  bool seen = false;
  auto [x, y] = vt::regression_data(16);
  auto t = volt::make_trainer({}, SeenException{&seen});
  CHECK_THROWS_WITH(t.predict(m, make_loader(x, y, 4)), Contains("predict_step failed in predict batch 1") &&
                                                            Contains("boom in predict"));
  CHECK(seen);
  CHECK(m.is_training());  // the module's mode is given back as after a predict that ends
}

TEST_CASE("an exception from a module's step says the step, the stage, the epoch and the batch", "[trainer]") {
  // Labels out of range in epoch 1, batch 2: torch's own "Target 10 is out of bounds." with where it happened.
  using volt::Stage;
  struct Labels : vt::RegressorImpl {
    int64_t bad_epoch = 1, bad_batch = 2;
    Stage bad_stage = Stage::train;
    torch::nn::Linear head{nullptr};
    Labels() { head = register_module("head", torch::nn::Linear(4, 10)); }
    torch::Tensor loss(const torch::data::Example<>& b, volt::Context& ctx) {
      auto target = torch::zeros({b.data.size(0)}, torch::kLong);
      if (ctx.stage() == bad_stage && ctx.current_epoch() == bad_epoch && ctx.batch_idx() == bad_batch) target.fill_(10);
      return torch::nn::functional::cross_entropy(head(b.data), target);
    }
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) { return loss(b, ctx); }
    void validation_step(const torch::data::Example<>& b, volt::Context& ctx) { ctx.log("val", loss(b, ctx)); }
    void test_step(const torch::data::Example<>& b, volt::Context& ctx) { ctx.log("t", loss(b, ctx)); }
  };
  auto [x, y] = vt::regression_data(32);
  auto message = [](auto&& run) -> std::pair<std::string, std::string> {
    try {
      run();
    } catch (const volt::StepError& e) {
      std::string inner;
      try {
        std::rethrow_if_nested(e);
      } catch (const std::exception& original) {
        inner = original.what();
      }
      return {e.what(), inner};
    }
    return {"no StepError", ""};
  };

  SECTION("training_step") {
    Labels m;
    volt::Trainer<> t({.max_epochs = 3});
    const auto [what, inner] = message([&] { t.fit(m, make_loader(x, y, 8)); });
    CHECK_THAT(what, Contains("volt: training_step failed in epoch 1, batch 2 (global step 6): ") &&
                         Contains("Target 10 is out of bounds"));
    CHECK_THAT(inner, Contains("Target 10 is out of bounds"));  // torch's own error, nested
    CHECK(t.global_step() == 6);
    // One line: LibTorch 1.x's C++ backtrace ("Exception raised from ...", ~20 frames) stays in the nested error.
    CHECK(what.find('\n') == std::string::npos);
    CHECK_THAT(what, !Contains("Exception raised from"));
  }
  SECTION("TORCH_SHOW_CPP_STACKTRACES=1 keeps LibTorch's whole message, backtrace and all") {
    Labels m;
    volt::Trainer<> t({.max_epochs = 3});
    setenv("TORCH_SHOW_CPP_STACKTRACES", "1", 1);
    const auto [what, inner] = message([&] { t.fit(m, make_loader(x, y, 8)); });
    unsetenv("TORCH_SHOW_CPP_STACKTRACES");
    CHECK_THAT(what, StartsWith("volt: training_step failed in epoch 1, batch 2 (global step 6): ") &&
                         EndsWith(inner));
  }
  SECTION("validation_step, in the fit and in its sanity check") {
    Labels m;
    m.bad_stage = Stage::validate;
    volt::Trainer<> t({.max_epochs = 3, .num_sanity_val_steps = 0});
    CHECK_THAT(message([&] { t.fit(m, make_loader(x, y, 8), make_loader(x, y, 8)); }).first,
               Contains("volt: validation_step failed in validate batch 2 (training epoch 1): ") &&
                   Contains("Target 10 is out of bounds"));
    Labels m2;
    m2.bad_stage = Stage::sanity_check, m2.bad_epoch = 0, m2.bad_batch = 1;
    volt::Trainer<> t2({.max_epochs = 1});
    CHECK_THAT(message([&] { t2.fit(m2, make_loader(x, y, 8), make_loader(x, y, 8)); }).first,
               Contains("volt: validation_step failed in sanity_check batch 1 (training epoch 0)"));
  }
  SECTION("test_step") {
    Labels m;
    m.bad_stage = Stage::test, m.bad_epoch = 0, m.bad_batch = 3;
    volt::Trainer<> t;
    CHECK_THAT(message([&] { t.test(m, make_loader(x, y, 8)); }).first,
               Contains("volt: test_step failed in test batch 3: ") && Contains("Target 10 is out of bounds"));
  }
}

TEST_CASE("an empty training or validation loader is said when fit starts", "[trainer]") {
  auto [x, y] = vt::regression_data(16);
  const std::vector<torch::data::Example<>> none;
  CaptureCerr err;
  vt::Regressor m;
  volt::Trainer<> t({.max_epochs = 2});
  t.fit(m, none);
  const std::string train_msg = err.str();
  err.clear();
  volt::Trainer<> t2({.max_epochs = 2});
  t2.fit(m, make_loader(x, y, 8), none);
  const std::string val_msg = err.str();
  CHECK_THAT(train_msg, Contains("no training batches") && Contains("the training loader is empty"));
  CHECK(t.global_step() == 0);
  CHECK_THAT(val_msg, Contains("validation loader given to fit is empty"));
  CHECK(t2.global_step() == 4);  // training still runs
}

TEST_CASE("detect_anomaly: a backward that makes NaN fails at once, naming the forward op; off, training goes on",
          "[trainer]") {
  // sqrt of a negative number: NaN forward, and SqrtBackward0 gives NaN gradients.
  struct NegativeRoot : vt::RegressorImpl {
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
      return torch::sqrt(forward(b.data).mean() - 1e3);
    }
  };
  auto [x, y] = vt::regression_data(16);
  NegativeRoot plain;
  volt::Trainer<>({.max_epochs = 1}).fit(plain, make_loader(x, y, 8));
  CHECK(torch::isnan(plain.parameters()[0]).any().item<bool>());  // trained on with NaN

  NegativeRoot watched;
  volt::Trainer<> t({.max_epochs = 1, .detect_anomaly = true});
  CHECK_THROWS_WITH(t.fit(watched, make_loader(x, y, 8)),
                    StartsWith("volt: the backward pass of training_step's loss failed in epoch 0, batch 0") &&
                        Contains("Function 'SqrtBackward0' returned nan values") &&
                        Contains("(the gradient of the forward op sqrt)"));
  CHECK_FALSE(torch::isnan(watched.parameters()[0]).any().item<bool>());  // no step was taken
  CHECK_FALSE(torch::autograd::AnomalyMode::is_enabled());                // the mode ends with the fit
  // The forward op of a gradient function with digits and capitals in its name:
  const std::string pool = volt::detail::step_error_message(
      std::runtime_error("Function 'MaxPool2DWithIndicesBackward0' returned nan values in its 0th output."));
  CHECK_THAT(pool, EndsWith("(the gradient of the forward op max_pool2d_with_indices)"));
}

namespace {
/// A callback whose on_exception fails itself (a logger whose flush fails on a full disk).
struct FailingFlush {
  void on_exception(auto&, auto&, std::exception_ptr) { throw std::runtime_error("flush failed too"); }
};
}  // namespace

TEST_CASE("a callback whose on_exception throws does not replace the run's error", "[trainer]") {
  struct Boom : vt::RegressorImpl {
    torch::Tensor training_step(const torch::data::Example<>&, volt::Context&) { throw std::runtime_error("boom"); }
  } m;
  auto [x, y] = vt::regression_data(16);
  auto t = volt::make_trainer({.max_epochs = 1}, FailingFlush{});
  CHECK_THROWS_WITH(t.fit(m, make_loader(x, y, 8)), Contains("training_step failed") && Contains("boom"));
}

TEST_CASE("max_time: the fit stops at a batch boundary with a checkpoint, returns, and resumes exactly",
          "[trainer][signals]") {
  // 40 ms steps against a 300 ms limit: the stop comes after a few batches of the 30 (3 epochs of 10). Reference:
  // the same fit without a limit; the run resumed from the time-up checkpoint must end bit-identical to it.
  struct Slow : vt::RegressorImpl {
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
      return vt::RegressorImpl::training_step(b, ctx);
    }
  };
  auto [x, y] = vt::regression_data(80);
  auto loader = [&] { return volt::data::TensorLoader(x, y, {.batch_size = 8, .shuffle = true, .seed = 3}); };
  const fs::path dir = scratch("max_time");
  torch::manual_seed(4);
  Slow ref;
  torch::manual_seed(4);
  Slow run;
  volt::Trainer<>({.max_epochs = 3}).fit(ref, loader());

  volt::Trainer<> t({.max_epochs = 3, .max_time = std::chrono::milliseconds(300), .default_root_dir = dir.string()});
  CaptureCerr err;
  REQUIRE_NOTHROW(t.fit(run, loader()));
  const std::string path = (dir / "checkpoints" / "interrupted.ckpt").string();
  const int64_t stopped = t.global_step();
  CHECK(stopped >= 1);
  CHECK(stopped < 30);
  CHECK_THAT(err.str(), Contains("volt: max_time (00:00) reached; stopped at epoch " +
                                 std::to_string(t.current_epoch()) + ", step " + std::to_string(stopped) +
                                 " and saved " + path + " (resume with fit(..., \"" + path + "\"))."));
  const auto loops = volt::checkpoint::read(path).at("loops").toGenericDict();
  CHECK(loops.at("global_step").toInt() == stopped);
  CHECK(loops.at("time_elapsed").toDouble() >= 0.3);
  // A save after the fit returned resumes where the stop's checkpoint does (after the batch it stopped in).
  t.save_checkpoint((dir / "after.ckpt").string());
  const auto after = volt::checkpoint::read((dir / "after.ckpt").string()).at("loops").toGenericDict();
  for (const char* key : {"epoch", "global_step", "batch_in_epoch", "total_batch_idx", "epoch_finished", "val_pending"}) {
    INFO(key);
    CHECK(after.at(key) == loops.at(key));
  }

  // The time of the fit it resumes from counts: with the same limit, one more batch and it stops again.
  Slow again;
  volt::Trainer<> t2({.max_epochs = 3, .max_time = std::chrono::milliseconds(300), .default_root_dir = (dir / "b").string()});
  t2.fit(again, loader(), volt::NoLoader{}, path);
  CHECK(t2.global_step() == stopped + 1);
  // Without a limit the rest of the fit runs, and ends as the fit that never stopped.
  Slow rest;
  volt::Trainer<> t3({.max_epochs = 3});
  t3.fit(rest, loader(), volt::NoLoader{}, path);
  CHECK(t3.global_step() == 30);
  CHECK(same_weights(rest, ref));
  // As Lightning's Timer, the time stops a fit only once min_steps (and min_epochs) are met: 12 steps of 40 ms
  // against 1 ms.
  Slow least;
  volt::Trainer<> t4({.max_epochs = 3, .min_steps = 12, .max_time = std::chrono::milliseconds(1),
                      .default_root_dir = (dir / "c").string()});
  t4.fit(least, loader());
  CHECK(t4.global_step() == 12);
}

TEST_CASE("overfit_batches: the same first batches, in order, for training and validation in every epoch",
          "[trainer]") {
  // Sample i has i in its first column; 40 samples, batches of 4, both loaders shuffled. Known answer: every epoch
  // trains on samples 0..7 and validates on 0..7, in that order; the loaders shuffle again after the fit.
  struct Seen : vt::RegressorImpl {
    std::vector<int64_t> trained, validated;
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      for (int64_t i = 0; i < b.data.size(0); ++i) trained.push_back(b.data[i][0].item<int64_t>());
      return vt::RegressorImpl::training_step(b, ctx);
    }
    void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
      for (int64_t i = 0; i < b.data.size(0); ++i) validated.push_back(b.data[i][0].item<int64_t>());
      vt::RegressorImpl::validation_step(b, ctx);
    }
  } m;
  auto x = torch::zeros({40, 4});
  x.select(1, 0).copy_(torch::arange(40));
  const auto y = torch::zeros({40, 1});
  volt::data::TensorLoader train(x, y, {.batch_size = 4, .shuffle = true, .seed = 1});
  volt::data::TensorLoader val(x, y, {.batch_size = 4, .shuffle = true, .seed = 2});
  CaptureCerr err;
  volt::Trainer<> t({.max_epochs = 3, .overfit_batches = 2, .num_sanity_val_steps = 0});
  t.fit(m, train, val);
  std::vector<int64_t> first8(8);
  std::iota(first8.begin(), first8.end(), 0);
  std::vector<int64_t> want;
  for (int e = 0; e < 3; ++e) want.insert(want.end(), first8.begin(), first8.end());
  CHECK(m.trained == want);
  CHECK(m.validated == want);
  CHECK(t.global_step() == 6);
  CHECK_THAT(err.str(), Contains("overfit_batches: the training loader shuffles; the fit turns that off") &&
                            Contains("the validation loader shuffles"));
  CHECK(train.options().shuffle);  // given back as it was
  CHECK(val.options().shuffle);

  // A checkpoint written during such a fit holds an unshuffled loader: a resume without overfit_batches is refused
  // with the reason; with the same overfit_batches it goes on.
  const auto dir = std::filesystem::temp_directory_path() / ("volt_overfit_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  vt::Regressor a;
  auto saving = volt::make_trainer({.max_epochs = 2, .overfit_batches = 2, .num_sanity_val_steps = 0},
                                   volt::ModelCheckpoint({.dirpath = dir.string(), .save_last = true}));
  saving.fit(a, train, val);
  const std::string last = (dir / "last.ckpt").string();
  vt::Regressor b;
  volt::Trainer<> plain({.max_epochs = 3, .num_sanity_val_steps = 0});
  CHECK_THROWS_WITH(plain.fit(b, train, val, last), Contains("shuffle false in the state vs true here") &&
                                                         Contains("give both the same overfit_batches"));
  vt::Regressor c;
  volt::Trainer<> same({.max_epochs = 3, .overfit_batches = 2, .num_sanity_val_steps = 0});
  same.fit(c, train, val, last);
  CHECK(same.global_step() == 6);
  std::filesystem::remove_all(dir);

  using T = volt::Trainer<>;
  CHECK_THROWS_WITH(T({.limit_train_batches = 3, .overfit_batches = 2}),
                    StartsWith("volt: overfit_batches with limit_train_batches or limit_val_batches is not allowed"));
  CHECK_THROWS_WITH(T({.overfit_batches = 2, .fast_dev_run = 1}),
                    StartsWith("volt: overfit_batches with fast_dev_run is not allowed"));
  CHECK_THROWS_WITH(T({.overfit_batches = 1.5}), Contains("overfit_batches=1.5"));
}
