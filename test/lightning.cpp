// A Lightning program ported as it is: what each hook sees on a resume and on a fit with nothing to train, the steps
// loggers file values under, and when ModelCheckpoint writes last.ckpt. Every expected sequence is Lightning 2.5's
// documented behaviour, written out by hand (the comments say which rule gives it); Lightning 2.5.5 running the same
// configurations printed the same sequences.

#include "common.hpp"

#include <tuple>

namespace {

/// What the training hooks see: the hook, the epoch and the global step (on_train_batch_start: the batch index).
struct Events {
  std::vector<std::string> seen;
  void add(const std::string& hook, int64_t a, int64_t b) {
    seen.push_back(hook + " " + std::to_string(a) + " " + std::to_string(b));
  }
  template <class T, class M>
  void on_train_start(T& t, M&) { add("train_start", t.current_epoch(), t.global_step()); }
  template <class T, class M>
  void on_train_end(T& t, M&) { add("train_end", t.current_epoch(), t.global_step()); }
  template <class T, class M>
  void on_train_epoch_start(T& t, M&) { add("epoch_start", t.current_epoch(), t.global_step()); }
  template <class T, class M>
  void on_train_epoch_end(T& t, M&) { add("epoch_end", t.current_epoch(), t.global_step()); }
  template <class T, class M, class B>
  void on_train_batch_start(T& t, M&, const B&, int64_t i) { add("batch", t.current_epoch(), i); }
};

/// What loggers receive: the step and the names (without "epoch").
struct LogSteps {
  std::vector<std::pair<int64_t, std::string>> rows;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
    for (const auto& [k, v] : metrics) {
      if (k != "epoch") rows.emplace_back(step, k);
    }
  }
};

/// The learning rates loggers receive, with their steps.
struct Rates {
  std::vector<std::pair<int64_t, double>> seen;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
    if (metrics.count("lr-SGD")) seen.emplace_back(step, metrics.at("lr-SGD"));
  }
};

/// 1 feature, y = x: sample i is (i, i).
volt::data::TensorLoader line_loader(int64_t n) {
  const auto x = torch::arange(n, torch::kFloat32).unsqueeze(1);
  return volt::data::TensorLoader(x, x.clone(), {.batch_size = 1});
}

struct LineImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  LineImpl() {
    torch::manual_seed(3);
    lin = register_module("lin", torch::nn::Linear(1, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto loss = (lin(b.data) - b.target).pow(2).mean();
    ctx.log("loss", loss);
    return loss;
  }
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("val", (lin(b.data) - b.target).pow(2).mean());
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.001)); }
};
TORCH_MODULE(Line);

int64_t saved_step(const fs::path& file) {
  return volt::checkpoint::read(file.string()).at(volt::checkpoint::keys::loops).toGenericDict().at("global_step").toInt();
}

std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("a resumed fit's hooks see what Lightning's do: the next epoch after an epoch-end checkpoint, no second "
          "epoch start after a mid-epoch one", "[lightning]") {
  const auto dir = scratch("lightning_resume");
  auto loader = line_loader(4);  // 4 batches an epoch
  using volt::ModelCheckpoint;
  SECTION("saved at an epoch's end") {
    {
      Line m;
      auto t = volt::make_trainer({.max_epochs = 1, .num_sanity_val_steps = 0},
                                  ModelCheckpoint({.dirpath = (dir / "ck").string(), .save_last = true}));
      t.fit(m, loader);
    }
    Line m;
    auto t = volt::make_trainer({.max_epochs = 2}, Events{});
    t.fit(m, loader, volt::NoLoader{}, (dir / "ck" / "last.ckpt").string());
    // The saved epoch is over: the training starts at epoch 1, as a fresh fit's first epoch starts at its own.
    CHECK(t.callback<Events>().seen ==
          std::vector<std::string>{"train_start 1 4", "epoch_start 1 4", "batch 1 0", "batch 1 1", "batch 1 2",
                                   "batch 1 3", "epoch_end 1 8", "train_end 2 8"});
  }
  SECTION("saved after a batch inside an epoch") {
    {
      Line m;
      auto t = volt::make_trainer(
          {.max_epochs = 1, .max_steps = 2},
          ModelCheckpoint({.dirpath = (dir / "ck").string(), .save_last = true, .every_n_train_steps = 2}), Events{});
      t.fit(m, loader);
      // max_steps inside an epoch leaves it open: no end hooks, the epoch still 0 (Lightning's fit loop ends it: the
      // departure docs/reference.md lists, so that a fit resumed with a larger max_steps goes on with batch 2).
      CHECK(t.callback<Events>().seen == std::vector<std::string>{"train_start 0 0", "epoch_start 0 0", "batch 0 0",
                                                                  "batch 0 1", "train_end 0 2"});
      CHECK(files_in(dir / "ck") == std::vector<std::string>{"epoch=0-step=2.ckpt", "last.ckpt"});
    }
    Line m;
    auto t = volt::make_trainer({.max_epochs = 1}, Events{});
    t.fit(m, loader, volt::NoLoader{}, (dir / "ck" / "last.ckpt").string());
    // The epoch had started before the save: no on_train_epoch_start again (what it would reset, the file restored).
    CHECK(t.callback<Events>().seen == std::vector<std::string>{"train_start 0 2", "batch 0 2", "batch 0 3",
                                                                "epoch_end 0 4", "train_end 1 4"});
  }
  fs::remove_all(dir);
}

TEST_CASE("a fit with nothing to train runs no training loop and none of its hooks", "[lightning]") {
  const auto dir = scratch("lightning_empty");
  auto loader = line_loader(4);
  auto fit_with = [&](volt::TrainerOptions o, const std::string& ckpt = "") {
    Line m;
    std::vector<std::string> log;
    o.num_sanity_val_steps = 0;
    o.default_root_dir = dir.string();
    auto t = volt::make_trainer(o, vt::Recorder{&log});
    t.fit(m, loader, volt::NoLoader{}, ckpt);
    return log;
  };
  const std::vector<std::string> fit_hooks_only{"cb:on_fit_start", "cb:on_fit_end"};
  CHECK(fit_with({.max_epochs = 0}) == fit_hooks_only);
  CHECK(fit_with({.max_epochs = 1, .max_steps = 0}) == fit_hooks_only);
  CHECK(fit_with({.max_epochs = 1, .limit_train_batches = volt::Limit(int64_t{0})}) == fit_hooks_only);
  {  // a finished fit, resumed with the same limits
    Line m;
    auto t = volt::make_trainer({.max_epochs = 1, .default_root_dir = dir.string()},
                                volt::ModelCheckpoint({.dirpath = (dir / "ck").string(), .save_last = true}));
    t.fit(m, loader);
  }
  CHECK(fit_with({.max_epochs = 1}, (dir / "ck" / "last.ckpt").string()) == fit_hooks_only);
  fs::remove_all(dir);
}

TEST_CASE("loggers get values at Lightning's steps: a validation inside an accumulation window at the batches that "
          "stepped before it", "[lightning]") {
  Line m;
  auto train = line_loader(10), val = line_loader(2);
  auto t = volt::make_trainer({.max_epochs = 1, .val_check_interval = volt::Limit(int64_t{5}), .num_sanity_val_steps = 0,
                               .accumulate_grad_batches = 3, .log_every_n_steps = 1},
                              LogSteps{});
  t.fit(m, train, val);
  // Batches 2, 5, 8 and 9 (the last) step. A batch's values go out at the number of batches that stepped before it;
  // the validation after batch 4, inside the second window, at 1 (one window closed); the one after batch 9 at 3.
  using Row = std::pair<int64_t, std::string>;
  CHECK(t.callback<LogSteps>().rows ==
        std::vector<Row>{{0, "loss"}, {1, "val"}, {1, "loss"}, {2, "loss"}, {3, "loss"}, {3, "val"}});
}

TEST_CASE("ModelCheckpoint writes last.ckpt at every epoch's end whatever every_n_epochs or every_n_train_steps say, "
          "and at the fit's end", "[lightning]") {
  const auto dir = scratch("lightning_last");
  auto loader = line_loader(4);
  auto fit_with = [&](volt::ModelCheckpoint::Options o, volt::TrainerOptions to = {.max_epochs = 3}) {
    fs::remove_all(dir / "ck");
    o.dirpath = (dir / "ck").string();
    o.save_last = true;
    Line m;
    to.num_sanity_val_steps = 0;
    auto t = volt::make_trainer(to, volt::ModelCheckpoint(o));
    t.fit(m, loader);
  };
  // 3 epochs of 4 steps. every_n_epochs = 2: the top-1 file of epoch 1; last.ckpt also at the end of epochs 0 and 2.
  fit_with({.every_n_epochs = 2});
  CHECK(files_in(dir / "ck") == std::vector<std::string>{"epoch=1-step=8.ckpt", "last.ckpt"});
  CHECK(saved_step(dir / "ck" / "last.ckpt") == 12);
  // every_n_train_steps = 5: the top-1 file of step 10; last.ckpt at each of those and at every epoch's end.
  fit_with({.every_n_train_steps = 5});
  CHECK(files_in(dir / "ck") == std::vector<std::string>{"epoch=2-step=10.ckpt", "last.ckpt"});
  CHECK(saved_step(dir / "ck" / "last.ckpt") == 12);
  SECTION("max_steps inside an epoch whose saves follow validation: last.ckpt at the fit's end (volt's rule)") {
    fs::remove_all(dir / "ck");
    Line m;
    auto val = line_loader(2);
    auto t = volt::make_trainer({.max_epochs = 3, .max_steps = 3, .val_check_interval = volt::Limit(int64_t{2}),
                                 .num_sanity_val_steps = 0},
                                volt::ModelCheckpoint({.dirpath = (dir / "ck").string(), .save_last = true}));
    t.fit(m, loader, val);
    CHECK(files_in(dir / "ck") == std::vector<std::string>{"epoch=0-step=2.ckpt", "last.ckpt"});
    CHECK(saved_step(dir / "ck" / "last.ckpt") == 3);
  }
  SECTION("fast_dev_run writes no checkpoint") {
    fs::remove_all(dir / "ck");
    fit_with({}, {.max_epochs = 3, .fast_dev_run = 1});
    CHECK(!fs::exists(dir / "ck" / "last.ckpt"));
  }
  fs::remove_all(dir);
}

namespace {

/// Logs "neg_epoch" (-epoch) in validation, so that a ModelCheckpoint with mode max finds epoch 0 best; counts its
/// on_load_checkpoint calls.
struct MarkedImpl : LineImpl {
  int loads = 0;
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    LineImpl::validation_step(b, ctx);
    ctx.log("neg_epoch", -static_cast<double>(ctx.current_epoch()));
  }
  void test_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("test", (lin(b.data) - b.target).pow(2).mean());
  }
  torch::Tensor predict_step(const torch::data::Example<>& b, volt::Context&) { return lin(b.data); }
  void on_load_checkpoint(const volt::checkpoint::Dict&) { ++loads; }
};

/// The mean squared error of `file`'s weights on samples 0..n-1 of the line, by a hand-written loop.
double loss_of(const fs::path& file, int64_t n) {
  LineImpl m;
  volt::load_weights(m, file.string());
  torch::NoGradGuard g;
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto x = torch::full({1, 1}, static_cast<float>(i));
    sum += (m.lin(x) - x).pow(2).mean().item<double>();
  }
  return sum / static_cast<double>(n);
}

}  // namespace

TEST_CASE("validate, test and predict from a checkpoint: \"best\", \"last\" or a path, weights loaded as Lightning's",
          "[lightning]") {
  const auto dir = scratch("lightning_eval_ckpt");
  MarkedImpl m;
  auto train = line_loader(4), val = line_loader(3);
  auto t = volt::make_trainer({.max_epochs = 3, .num_sanity_val_steps = 0},
                              volt::ModelCheckpoint({.dirpath = (dir / "ck").string(), .filename = "{epoch}",
                                                     .monitor = "neg_epoch", .mode = volt::Mode::max,
                                                     .save_last = true}));
  t.fit(m, train, val);
  const fs::path best = dir / "ck" / "epoch=0.ckpt", last = dir / "ck" / "last.ckpt";
  REQUIRE(t.callback<volt::ModelCheckpoint>().best_model_path() == best.string());
  REQUIRE(loss_of(best, 3) != loss_of(last, 3));
  CHECK(t.validate(m, val, "best").at("val") == Approx(loss_of(best, 3)).epsilon(1e-6));
  CHECK(m.loads == 1);
  CHECK(t.test(m, val, "last").at("test") == Approx(loss_of(last, 3)).epsilon(1e-6));
  CHECK(t.validate(m, val, best.string()).at("val") == Approx(loss_of(best, 3)).epsilon(1e-6));
  CHECK(m.loads == 3);
  // Without a path the module keeps what it has: the last load (best).
  CHECK(t.validate(m, val).at("val") == Approx(loss_of(best, 3)).epsilon(1e-6));
  const auto predicted = t.predict(m, val, "last");
  REQUIRE(predicted.size() == 3);
  LineImpl ref;
  volt::load_weights(ref, last.string());
  for (int64_t i = 0; i < 3; ++i) {
    CHECK(predicted[static_cast<std::size_t>(i)].item<double>() ==
          Approx(ref.lin(torch::full({1, 1}, static_cast<float>(i))).item<double>()));
  }
  SECTION("a checkpoint of another module is refused before anything changes") {
    const auto before = vt::flat_params(m);
    struct Other : torch::nn::Module {
      torch::nn::Linear lin{nullptr};
      Other() { lin = register_module("lin", torch::nn::Linear(2, 1)); }
      void validation_step(const torch::data::Example<>&, volt::Context&) {}
    } other;
    CHECK_THROWS_AS(t.validate(other, val, "best"), volt::CheckpointError);
    CHECK(torch::equal(vt::flat_params(m), before));
  }
  SECTION("\"best\" without a ModelCheckpoint says how to get one") {
    volt::Trainer<> plain({.max_epochs = 1});
    CHECK_THROWS_WITH(plain.validate(m, val, "best"), Contains("validate(..., ckpt_path=\"best\")") &&
                                                           Contains("ModelCheckpoint"));
  }
  fs::remove_all(dir);
}

TEST_CASE("ctx.log_dict logs each value with the same options", "[lightning]") {
  struct Dict : LineImpl {
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      auto loss = (lin(b.data) - b.target).pow(2).mean();
      ctx.log_dict({{"a", loss}, {"b", loss * 2}}, {.on_step = false, .on_epoch = true, .reduce = volt::Reduce::sum});
      ctx.log_dict(std::map<std::string, double>{{"ones", 1.0}}, {.on_step = false, .on_epoch = true,
                                                                 .reduce = volt::Reduce::sum});
      return loss;
    }
  } m;
  auto loader = line_loader(4);
  auto t = volt::make_trainer({.max_epochs = 1});
  const auto r = t.fit(m, loader);
  CHECK(r.metrics.at("ones") == 4.0);  // one per batch, summed
  CHECK(r.metrics.at("b") == Approx(2 * r.metrics.at("a")));
}

TEST_CASE("LearningRateMonitor at step interval: every log_every_n_steps, step i's rate filed at step i", "[lightning]") {
  struct Decay : LineImpl {
    volt::OptimizerConfig configure_optimizers() {
      auto opt = std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(1.0));
      // LibTorch's StepLR takes its first step() as step 0: steps 0, 1, 2, 3, ... run at 1, 1, 0.5, 0.25, ...
      // (see module.hpp).
      return {.optimizer = opt, .scheduler = std::make_shared<torch::optim::StepLR>(*opt, 1, 0.5),
              .interval = volt::Interval::step};
    }
  } m;
  auto loader = line_loader(8);
  auto t = volt::make_trainer({.max_epochs = 1, .log_every_n_steps = 2},
                              volt::LearningRateMonitor({.logging_interval = volt::Interval::step}), Rates{});
  t.fit(m, loader);
  // Lightning records at the start of a batch when (batches that stepped + 1) % log_every_n_steps == 0: before the
  // batches of steps 1, 3, 5 and 7, each filed at that step, with the rate that step runs with.
  using Row = std::pair<int64_t, double>;
  CHECK(t.callback<Rates>().seen == std::vector<Row>{{1, 1.0}, {3, 0.25}, {5, 0.0625}, {7, 0.015625}});
}

namespace {

/// The validation hooks, with the loader and batch index of each batch.
struct EvalEvents {
  std::vector<std::string> seen;
  template <class T, class M>
  void on_validation_start(T& t, M&) { seen.push_back(t.sanity_checking() ? "start sanity" : "start"); }
  template <class T, class M>
  void on_validation_epoch_start(T&, M&) { seen.push_back("epoch_start"); }
  template <class T, class M, class B>
  void on_validation_batch_start(T& t, M&, const B&, int64_t i) {
    seen.push_back("batch " + std::to_string(t.dataloader_idx()) + " " + std::to_string(i));
  }
  template <class T, class M>
  void on_validation_epoch_end(T&, M&) { seen.push_back("epoch_end"); }
  template <class T, class M>
  void on_validation_end(T&, M&) { seen.push_back("end"); }
};

/// Validates on examples and tests on examples and on plain tensors (x = y); logs the mean squared error and the
/// number of samples, and once at the epoch's end.
struct SeveralImpl : LineImpl {
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("val", (lin(b.data) - b.target).pow(2).mean());
    ctx.log("n", static_cast<double>(b.data.size(0)), {.reduce = volt::Reduce::sum});
    ctx.log("loader", static_cast<double>(ctx.dataloader_idx()), {.reduce = volt::Reduce::max});
  }
  void on_validation_epoch_end(volt::Context& ctx) { ctx.log("ends", 1.0); }
  void test_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("test", (lin(b.data) - b.target).pow(2).mean());
  }
  void test_step(const torch::Tensor& x, volt::Context& ctx) { ctx.log("test", (lin(x) - x).pow(2).mean()); }
};
TORCH_MODULE(Several);

/// The mean squared error of `m` on the samples x = y = first..last.
double line_loss(LineImpl& m, int64_t first, int64_t last) {
  torch::NoGradGuard g;
  const auto x = torch::arange(first, last + 1, torch::kFloat32).unsqueeze(1);
  return (m.lin(x) - x).pow(2).mean().item<double>();
}

}  // namespace

TEST_CASE("several validation and test loaders: each in turn inside one run, values named by dataloader_idx, as "
          "Lightning's", "[lightning]") {
  Several m;
  auto train = line_loader(2);
  auto val_a = line_loader(3);
  const auto x = torch::arange(4, torch::kFloat32).unsqueeze(1);
  volt::data::TensorLoader val_b(x, x.clone(), {.batch_size = 2});
  auto t = volt::make_trainer({.max_epochs = 1, .limit_val_batches = volt::Limit(int64_t{2}), .num_sanity_val_steps = 1},
                              EvalEvents{});
  const auto r = t.fit(m, train, volt::data::loaders(val_a, val_b));
  // Lightning 2.5: the sanity check takes num_sanity_val_steps of each loader, a validation limit_val_batches of
  // each; one epoch start and end around all of them.
  CHECK(t.callback<EvalEvents>().seen ==
        std::vector<std::string>{"start sanity", "epoch_start", "batch 0 0", "batch 1 0", "epoch_end", "end", "start",
                                 "epoch_start", "batch 0 0", "batch 0 1", "batch 1 0", "batch 1 1", "epoch_end",
                                 "end"});
  // Loader 0: samples 0 and 1 (limit 2 of 3 batches of 1); loader 1: samples 0..3 (2 batches of 2).
  CHECK(r.metrics.at("val/dataloader_idx_0") == Approx(line_loss(*m, 0, 1)).epsilon(1e-6));
  CHECK(r.metrics.at("val/dataloader_idx_1") == Approx(line_loss(*m, 0, 3)).epsilon(1e-6));
  CHECK(r.metrics.at("n/dataloader_idx_0") == 2.0);
  CHECK(r.metrics.at("n/dataloader_idx_1") == 4.0);
  CHECK(r.metrics.at("loader/dataloader_idx_1") == 1.0);
  CHECK(r.metrics.at("ends") == 1.0);  // logged at the epoch's end: no loader's
  CHECK(r.metrics.count("val") == 0);
  // A standalone test over loaders of two batch types, each to its own test_step.
  std::vector<torch::Tensor> plain{torch::arange(5, torch::kFloat32).unsqueeze(1)};
  volt::Trainer<> tester;
  const auto tested = tester.test(m, volt::data::loaders(val_a, plain));
  CHECK(tested.at("test/dataloader_idx_0") == Approx(line_loss(*m, 0, 2)).epsilon(1e-6));
  CHECK(tested.at("test/dataloader_idx_1") == Approx(line_loss(*m, 0, 4)).epsilon(1e-6));
}

#if VOLT_TEST_PNG
#include "../examples/png.hpp"
#include <volt/data/image_folder.hpp>

TEST_CASE("ImageFolder refuses empty class folders as torchvision does, takes .PNG, and names an image of another size",
          "[lightning]") {
  const auto root = scratch("lightning_images");
  auto image = [&](const std::string& rel, uint32_t w, uint32_t h) {
    fs::create_directories((root / rel).parent_path());
    png::write_gray(root / rel, std::vector<uint8_t>(static_cast<std::size_t>(w) * h, 128), w, h);
  };
  image("cat/1.png", 4, 4);
  image("cat/2.PNG", 4, 4);
  fs::create_directories(root / "cow");
  image("dog/1.png", 4, 4);
  CHECK_THROWS_WITH(volt::data::ImageFolder(root.string(), {.channels = 1}),
                    Contains("found no valid file for the classes cow") && Contains(".png (in any case)"));
  fs::remove(root / "cow");
  const volt::data::ImageFolder images(root.string(), {.channels = 1});
  CHECK(images.classes() == std::vector<std::string>{"cat", "dog"});
  REQUIRE(images.size() == 3);
  CHECK(images.path(1) == (root / "cat" / "2.PNG").string());
  at::Generator gen;
  CHECK(images.get(2, gen).target.item<int64_t>() == 1);
  image("dog/2.png", 5, 4);
  volt::data::SampleLoader loader(volt::data::ImageFolder(root.string(), {.channels = 1}), {.batch_size = 4});
  CHECK_THROWS_WITH([&] { for (auto it = loader.begin(); it != loader.end(); ++it) (void)*it; }(),
                    Contains((root / "dog" / "2.png").string()) && Contains("[1, 4, 5]") && Contains("[1, 4, 4]"));
  fs::remove_all(root);
}
#endif

TEST_CASE("after a resume inside an epoch: no sanity check, and the pending validation logs at the step it had",
          "[lightning]") {
  const auto dir = scratch("lightning_resume_val");
  auto train = line_loader(4), val = line_loader(2);
  {  // the uninterrupted fit
    Line m;
    auto t = volt::make_trainer(
        {.max_epochs = 1, .val_check_interval = volt::Limit(int64_t{2}), .num_sanity_val_steps = 0,
         .log_every_n_steps = 1},
        LogSteps{});
    t.fit(m, train, val);
    // Uninterrupted: validations after batches 1 and 3, at the batches that stepped before each (1 and 3).
    using Row = std::pair<int64_t, std::string>;
    CHECK(t.callback<LogSteps>().rows ==
          std::vector<Row>{{0, "loss"}, {1, "loss"}, {1, "val"}, {2, "loss"}, {3, "loss"}, {3, "val"}});
  }
  {  // stopped by max_steps after batch 1: last.ckpt of step 2, written before that batch's validation ran
    Line first;
    auto a = volt::make_trainer({.max_epochs = 1, .max_steps = 2, .val_check_interval = volt::Limit(int64_t{2}),
                                 .num_sanity_val_steps = 0},
                                volt::ModelCheckpoint({.dirpath = (dir / "two").string(), .save_top_k = 0,
                                                       .save_last = true, .every_n_train_steps = 2}));
    a.fit(first, train, val);
  }
  Line m;
  std::vector<std::string> log;
  auto t = volt::make_trainer({.max_epochs = 1, .val_check_interval = volt::Limit(int64_t{2}), .log_every_n_steps = 1},
                              vt::Recorder{&log}, LogSteps{});
  t.fit(m, train, val, (dir / "two" / "last.ckpt").string());
  // Lightning's loops are restarting inside the epoch: no sanity check; the pending validation at step 1, as above.
  CHECK(t.callback<vt::Recorder>().sanity_batches == 0);
  using Row = std::pair<int64_t, std::string>;
  CHECK(t.callback<LogSteps>().rows == std::vector<Row>{{1, "val"}, {2, "loss"}, {3, "loss"}, {3, "val"}});
  SECTION("after an epoch-end checkpoint the sanity check runs, as for a fresh epoch") {
    Line e;
    auto one = volt::make_trainer({.max_epochs = 1, .num_sanity_val_steps = 0},
                                  volt::ModelCheckpoint({.dirpath = (dir / "end").string(), .save_last = true}));
    one.fit(e, train, val);
    std::vector<std::string> log2;
    auto two = volt::make_trainer({.max_epochs = 2}, vt::Recorder{&log2});
    two.fit(e, train, val, (dir / "end" / "last.ckpt").string());
    CHECK(two.callback<vt::Recorder>().sanity_batches == 2);
  }
  fs::remove_all(dir);
}

TEST_CASE("a fraction of an empty loader (a rank dealt no batch) is no batch, not an error", "[lightning]") {
  CHECK(volt::Limit(0.5).resolve(0, "limit_val_batches") == 0);
  CHECK_THROWS_WITH(volt::Limit(0.5).resolve(1, "limit_val_batches"), Contains("less than one batch"));
}

namespace {
/// Counts its on_save_checkpoint calls.
struct CountingLineImpl : LineImpl {
  int saves = 0;
  void on_save_checkpoint(volt::checkpoint::Dict&) { ++saves; }
};
}  // namespace

// Both measured with Lightning 2.6.6 on the same loops (10 batches an epoch, a validation loader, ModelCheckpoint with
// save_last): it skips the sanity check in a resumed fit that sets max_steps (from the last.ckpt of a fit max_steps
// ended at batch 7, and from an epoch-end checkpoint alike) and runs it in one that sets max_epochs only; and it calls
// on_save_checkpoint once per file written (a top-k file and last.ckpt at one epoch end: twice).
TEST_CASE("a resumed fit that sets max_steps runs no sanity check, as Lightning's; on_save_checkpoint runs once per "
          "save (the README's departure)", "[lightning]") {
  const auto dir = scratch("lightning_resume_max_steps");
  auto train = line_loader(10), val = line_loader(2);
  {  // max_steps ends the fit at batch 7 of 10: last.ckpt from the fit's end, the epoch left open
    Line first;
    auto a = volt::make_trainer({.max_steps = 7, .num_sanity_val_steps = 0},
                                volt::ModelCheckpoint({.dirpath = (dir / "seven").string(), .save_last = true}));
    a.fit(first, train, val);
    REQUIRE(saved_step(dir / "seven" / "last.ckpt") == 7);
    // The epoch and the step at the top level too, where Lightning's checkpoints have them (tools read them there).
    const auto saved = volt::checkpoint::read((dir / "seven" / "last.ckpt").string());
    CHECK(saved.at("epoch").toInt() == 0);
    CHECK(saved.at("global_step").toInt() == 7);
  }
  Line m;
  std::vector<std::string> log;
  auto t = volt::make_trainer({.max_steps = 15}, vt::Recorder{&log});
  t.fit(m, train, val, (dir / "seven" / "last.ckpt").string());
  CHECK(t.callback<vt::Recorder>().sanity_batches == 0);
  CHECK(t.global_step() == 15);
  {  // from an epoch-end checkpoint of a whole epoch: none with max_steps either
    Line whole;
    auto one = volt::make_trainer({.max_epochs = 1, .num_sanity_val_steps = 0},
                                  volt::ModelCheckpoint({.dirpath = (dir / "ten").string(), .save_last = true}));
    one.fit(whole, train, val);
    Line again;
    auto two = volt::make_trainer({.max_steps = 15}, vt::Recorder{&log});
    two.fit(again, train, val, (dir / "ten" / "last.ckpt").string());
    CHECK(two.callback<vt::Recorder>().sanity_batches == 0);
  }
  // One save that writes a top-k file and last.ckpt serialises one state into both: the hooks run once (Lightning:
  // once per file). The two files hold the same bytes.
  CountingLineImpl counting;
  auto c = volt::make_trainer({.max_epochs = 1, .num_sanity_val_steps = 0},
                              volt::ModelCheckpoint({.dirpath = (dir / "count").string(), .save_last = true}));
  c.fit(counting, train, val);
  CHECK(files_in(dir / "count") == std::vector<std::string>{"epoch=0-step=10.ckpt", "last.ckpt"});
  CHECK(counting.saves == 1);
  fs::remove_all(dir);
}
