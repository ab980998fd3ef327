// The shipped callbacks in whole fits: EarlyStopping, LR schedulers with LearningRateMonitor and CSVLogger,
// ProgressBar, ModelCheckpoint (top k, every n, file names), and callback state across a resume.

#include "common.hpp"
#include "support/trace.hpp"

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <chrono>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>

TEST_CASE("EarlyStopping stops after patience checks without improvement", "[trainer][callbacks]") {
  struct Scripted : vt::RegressorImpl {
    std::vector<double> values{1.0, 0.9, 0.95, 0.96, 0.97, 0.5, 0.4};
    int64_t epoch = 0;
    void validation_step(const torch::data::Example<>&, volt::Context& ctx) {
      ctx.log("score", values[static_cast<std::size_t>(ctx.current_epoch())]);
    }
  } m;
  auto [x, y] = vt::regression_data(16);
  auto loader = make_loader(x, y, 8);
  auto t = volt::make_trainer({.max_epochs = 7, .num_sanity_val_steps = 0},
                              volt::EarlyStopping({.monitor = "score", .patience = 2}));
  t.fit(m, loader, loader);
  // checks: 1.0 best, 0.9 best, 0.95 wait 1, 0.96 wait 2 -> stop after epoch 3
  CHECK(t.current_epoch() == 4);
  CHECK(t.callback<volt::EarlyStopping>().stopped_epoch() == 3);
  CHECK(t.callback<volt::EarlyStopping>().best_score() == Approx(0.9));

  SECTION("a missing monitored metric is an error naming it and what was logged") {
    auto t2 = volt::make_trainer({.max_epochs = 2, .num_sanity_val_steps = 0},
                                 volt::EarlyStopping({.monitor = "nope"}));
    Scripted m2;
    CHECK_THROWS_WITH(t2.fit(m2, loader, loader), Contains("\"nope\"") && Contains("score"));
  }
  SECTION("min_epochs holds the stop back") {
    Scripted m3;
    auto t3 = volt::make_trainer({.max_epochs = 7, .min_epochs = 6, .num_sanity_val_steps = 0},
                                 volt::EarlyStopping({.monitor = "score", .patience = 2}));
    t3.fit(m3, loader, loader);
    CHECK(t3.current_epoch() == 6);
  }
}

TEST_CASE("LR schedulers step per epoch or per step; LearningRateMonitor and CSVLogger record them", "[trainer][callbacks]") {
  const auto dir = std::filesystem::temp_directory_path() / ("volt_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  struct Sched : vt::RegressorImpl {
    volt::Interval interval = volt::Interval::epoch;
    volt::OptimizerConfig configure_optimizers() {
      auto opt = std::make_shared<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.08));
      return {.optimizer = opt, .scheduler = std::make_shared<torch::optim::StepLR>(*opt, 1, 0.5), .interval = interval};
    }
  };
  auto [x, y] = vt::regression_data(32);
  auto loader = make_loader(x, y, 8);  // 4 batches
  SECTION("per epoch") {
    Sched m;
    auto t = volt::make_trainer({.max_epochs = 3, .log_every_n_steps = 2, .default_root_dir = dir.string()},
                                volt::LearningRateMonitor{}, volt::CSVLogger{});
    t.fit(m, loader);
    // LibTorch's StepLR counts its first step() as step 0 (PyTorch's constructor takes that step), so 3 epoch-end
    // steps decay twice: 0.08 -> 0.08 -> 0.04 -> 0.02, as the same scheduler in a hand-written LibTorch loop.
    CHECK(t.optimizer()->param_groups()[0].options().get_lr() == Approx(0.02));
    CHECK(*t.callback<volt::LearningRateMonitor>().last_lr() == Approx(0.04));  // recorded at the start of epoch 2
    const auto file = t.callback<volt::CSVLogger>().metrics_file();
    REQUIRE(std::filesystem::exists(file));
    std::ifstream f(file);
    std::string header;
    std::getline(f, header);
    CHECK_THAT(header, Contains("train_loss") && Contains("lr-SGD") && Contains("epoch") && Contains("step"));
    int rows = 0;
    for (std::string line; std::getline(f, line);) ++rows;
    CHECK(rows == 3 + 6);  // 3 LR records + 12 steps / log_every_n_steps=2
  }
  SECTION("per step") {
    Sched m;
    m.interval = volt::Interval::step;
    volt::Trainer<> t({.max_epochs = 1});
    t.fit(m, loader);
    CHECK(t.optimizer()->param_groups()[0].options().get_lr() == Approx(0.08 / 8));  // 4 steps, 3 decays (see above)
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("LearningRateMonitor names groups pg1, pg2 as Lightning, in one CSV row; CSVLogger writes as Python's csv",
          "[callbacks]") {
  const fs::path dir = vt::scratch("lr_groups");
  struct TwoGroups : vt::RegressorImpl {
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      ctx.log("a,b \"quoted\"", 1.0 / 3.0);
      return vt::RegressorImpl::training_step(b, ctx);
    }
    std::shared_ptr<torch::optim::SGD> configure_optimizers() {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(std::vector<torch::Tensor>{lin->weight}, std::make_unique<torch::optim::SGDOptions>(0.1));
      groups.emplace_back(std::vector<torch::Tensor>{lin->bias}, std::make_unique<torch::optim::SGDOptions>(0.01));
      return std::make_shared<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.1));
    }
  } m;
  auto [x, y] = vt::regression_data(16);
  auto t = volt::make_trainer({.max_epochs = 2, .log_every_n_steps = 1, .default_root_dir = dir.string()},
                              volt::LearningRateMonitor{}, volt::CSVLogger{});
  t.fit(m, make_loader(x, y, 8));
  std::ifstream f(t.callback<volt::CSVLogger>().metrics_file());
  std::string header;
  std::getline(f, header);
  // Python's csv.writer quotes a field with a comma or a quote, doubling the quotes.
  CHECK(header == "epoch,lr-SGD/pg1,lr-SGD/pg2,\"a,b \"\"quoted\"\"\",train_loss,step");
  int lr_rows = 0, value_rows = 0;
  for (std::string line; std::getline(f, line);) {
    lr_rows += line.find(",0.1,0.01,,,") != std::string::npos;  // both groups' rates in one row
    // Values as Python's repr writes them: the shortest text that reads back to the same double.
    value_rows += line.find(",,,0.3333333333333333,") != std::string::npos;
  }
  CHECK(value_rows == 4);  // 2 steps an epoch, 2 epochs
  CHECK(lr_rows == 2);  // one per epoch
}

TEST_CASE("ProgressBar draws step/total and metrics on rank zero", "[trainer][callbacks]") {
  std::ostringstream out;
  auto [x, y] = vt::regression_data(40);
  auto loader = make_loader(x, y, 4);
  struct Bar : vt::RegressorImpl {
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      auto loss = vt::mse(forward(b.data), b.target);
      ctx.log("loss", loss, {.prog_bar = true});
      return loss;
    }
  } m;
  auto t = volt::make_trainer({.max_epochs = 1}, volt::ProgressBar({.out = &out, .plain = true}));
  t.fit(m, loader);
  const std::string text = out.str();
  CHECK_THAT(text, Contains("Epoch 0/0") && Contains("10/10") && Contains("it/s") && Contains("loss="));
}

namespace {
/// The it/s of the last line a plain ProgressBar printed.
double last_rate(const std::string& text) {
  const std::size_t at = text.rfind(" it/s");
  REQUIRE(at != std::string::npos);
  const std::size_t from = text.rfind(' ', at - 1) + 1;
  return std::stod(text.substr(from, at - from));
}
}  // namespace

TEST_CASE("ProgressBar's it/s counts training batches only: not validation, not a resume's skipped batches",
          "[trainer][callbacks]") {
  // Each training step takes at least 20 ms, so no honest rate is above 50 it/s; each validation step 100 ms.
  struct Slow : vt::RegressorImpl {
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return vt::RegressorImpl::training_step(b, ctx);
    }
    void validation_step(const torch::data::Example<>&, volt::Context&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  };
  auto [x, y] = vt::regression_data(80);
  SECTION("validation in the middle of the epoch (5 x 100 ms against 10 x 20 ms of training)") {
    Slow m;
    std::ostringstream out;
    auto t = volt::make_trainer({.max_epochs = 1, .limit_val_batches = 5, .val_check_interval = 5,
                                 .num_sanity_val_steps = 0},
                                volt::ProgressBar({.out = &out, .plain = true}));
    t.fit(m, make_loader(x, y, 8), make_loader(x, y, 8));
    const double rate = last_rate(out.str());
    INFO(out.str());
    CHECK(rate <= 50.0);
    CHECK(rate > 25.0);  // with the validation time in it: 10 batches / 1.2 s, about 8 it/s
  }
  SECTION("right after a resume at batch 8 of 10, two batches ran") {
    const fs::path dir = scratch("bar_resume");
    Slow m;
    auto a = volt::make_trainer({.max_epochs = 1}, volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "{step}",
                                                                           .save_top_k = -1, .every_n_train_steps = 8}));
    a.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}));
    std::ostringstream out;
    auto b = volt::make_trainer({.max_epochs = 1}, volt::ModelCheckpoint({.dirpath = (dir / "b").string()}),
                                volt::ProgressBar({.out = &out, .plain = true}));
    b.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}), (dir / "step=8.ckpt").string());
    INFO(out.str());
    CHECK_THAT(out.str(), Contains("10/10"));
    CHECK(last_rate(out.str()) <= 50.0);  // counting the 8 skipped batches: 10 / 40 ms, about 250 it/s
  }
}

TEST_CASE("ProgressBar: no empty line for an epoch a resume finds ended; a stopped run's notice starts its own line",
          "[trainer][callbacks][signals]") {
  auto [x, y] = vt::regression_data(40);
  SECTION("a resume from the epoch's last batch") {
    const fs::path dir = scratch("bar_epoch_end");
    Regressor m;
    auto a = volt::make_trainer({.max_epochs = 1}, volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "{step}",
                                                                           .save_top_k = -1, .every_n_train_steps = 5}));
    a.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}));  // 5 batches: step=5.ckpt after epoch 0's last
    std::ostringstream out;
    auto b = volt::make_trainer({.max_epochs = 2}, volt::ProgressBar({.out = &out, .plain = true}));
    b.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}), (dir / "step=5.ckpt").string());
    INFO(out.str());
    CHECK_THAT(out.str(), StartsWith("Epoch 1/1") && Contains("5/5"));
    CHECK_THAT(out.str(), !Contains("Epoch 0"));  // epoch 0 had nothing left to run
  }
  SECTION("SIGTERM in the middle of a redrawn line") {
    struct Stops : vt::RegressorImpl {
      torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
        if (ctx.batch_idx() == 2) std::raise(SIGTERM);
        return vt::RegressorImpl::training_step(b, ctx);
      }
    };
    const fs::path dir = scratch("bar_sigterm");
    std::ostringstream both;  // the bar's stream and std::cerr, in the order written
    std::streambuf* old = std::cerr.rdbuf(both.rdbuf());
    std::string what;
    try {
      Stops m;
      auto t = volt::make_trainer({.max_epochs = 1, .default_root_dir = dir.string(), .signals = {.exit_process = false}},
                                  volt::ProgressBar({.out = &both, .plain = false, .redraws_per_second = 1e9}));
      t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}));
    } catch (const volt::Interrupted& stop) {
      what = stop.what();
    }
    std::cerr.rdbuf(old);
    INFO(both.str());
    const std::string path = (dir / "checkpoints" / "interrupted.ckpt").string();
    // No ModelCheckpoint: "last" would not find the file, so the notice names the path only.
    CHECK(what == "volt: SIGTERM received; stopped at epoch 0, step 3 and saved " + path + " (resume with fit(..., \"" +
                      path + "\")).");
    CHECK_THAT(both.str(), Contains("3/5") && Contains("\n" + what + "\n"));
  }
  SECTION("max_time in the middle of a redrawn line") {
    struct Slow : vt::RegressorImpl {
      torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        return vt::RegressorImpl::training_step(b, ctx);
      }
    } m;
    const fs::path dir = scratch("bar_max_time");
    std::ostringstream both;
    std::streambuf* old = std::cerr.rdbuf(both.rdbuf());
    {
      auto t = volt::make_trainer({.max_epochs = 1, .max_time = std::chrono::milliseconds(50),
                                   .default_root_dir = dir.string()},
                                  volt::ProgressBar({.out = &both, .plain = false, .redraws_per_second = 1e9}));
      t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 4}));
    }
    std::cerr.rdbuf(old);
    INFO(both.str());
    CHECK_THAT(both.str(), Contains("\nvolt: max_time (00:00) reached; stopped at epoch 0"));
  }
  SECTION("with a ModelCheckpoint the notice offers \"last\" too") {
    struct Stops : vt::RegressorImpl {
      torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
        if (ctx.batch_idx() == 1) std::raise(SIGTERM);
        return vt::RegressorImpl::training_step(b, ctx);
      }
    } m;
    const fs::path dir = scratch("bar_sigterm_last");
    auto t = volt::make_trainer({.max_epochs = 1, .signals = {.exit_process = false}},
                                volt::ModelCheckpoint({.dirpath = dir.string()}));
    const std::string path = (dir / "interrupted.ckpt").string();
    CHECK_THROWS_WITH(t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8})),
                      Contains("(resume with fit(..., \"last\") or fit(..., \"" + path + "\"))."));
  }
}

// ---- ModelCheckpoint -------------------------------------------------------------------------------------

namespace {
/// Logs a scripted "score" at each validation run (epoch e: scores[e]) and the training loss.
struct ScriptedImpl : vt::RegressorImpl {
  std::vector<double> scores;
  explicit ScriptedImpl(std::vector<double> s) : scores(std::move(s)) {}
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("score", scores.at(static_cast<std::size_t>(ctx.current_epoch())));
    ctx.log("val_loss", vt::mse(forward(b.data), b.target));
  }
};
TORCH_MODULE(Scripted);

std::set<std::string> files_in(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}
}  // namespace

TEST_CASE("ModelCheckpoint keeps the top k by the monitored value and deletes the rest", "[checkpoint][model_checkpoint]") {
  const fs::path dir = scratch("topk");
  auto [x, y] = vt::regression_data(16);
  Scripted model(std::vector<double>{5, 3, 4, 1, 2, 6});
  auto trainer = volt::make_trainer({.max_epochs = 6, .num_sanity_val_steps = 0},
                                    volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "{epoch}-{score:.1f}",
                                                           .monitor = "score", .save_top_k = 2, .save_last = true}));
  trainer.fit(model, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::data::TensorLoader(x, y, {.batch_size = 8}));
  CHECK(files_in(dir) == std::set<std::string>{"epoch=3-score=1.0.ckpt", "epoch=4-score=2.0.ckpt", "last.ckpt"});
  const auto& cb = trainer.callback<volt::ModelCheckpoint>();
  CHECK(cb.best_model_path() == (dir / "epoch=3-score=1.0.ckpt").string());
  CHECK(cb.best_model_score() == 1.0);
  CHECK(trainer.best_model_path() == cb.best_model_path());
  const auto last = volt::checkpoint::read((dir / "last.ckpt").string());
  CHECK(last.at("loops").toGenericDict().at("global_step").toInt() == 12);
  const auto state = last.at("callbacks").toGenericDict().at(cb.state_key()).toGenericDict();
  CHECK(state.at("best_model_path").toStringRef() == cb.best_model_path());
  CHECK(state.at("best_k_models").toGenericDict().size() == 2);
  // the file of the best epoch holds that epoch's weights: its step is 2 per epoch
  CHECK(volt::checkpoint::read(cb.best_model_path()).at("loops").toGenericDict().at("global_step").toInt() == 8);

  SECTION("mode max, and a new process finds the best through the last checkpoint") {
    auto t2 = volt::make_trainer({.max_epochs = 6},
                                 volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "{epoch}-{score:.1f}",
                                                        .monitor = "score", .save_top_k = 2, .save_last = true}));
    Scripted m2(std::vector<double>{5, 3, 4, 1, 2, 6});
    // fit from "best": epoch 3's checkpoint; two more epochs (4, 5) remain
    t2.fit(m2, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::data::TensorLoader(x, y, {.batch_size = 8}), "best");
    CHECK(t2.global_step() == 12);
  }
  SECTION("mode max") {
    const fs::path d2 = scratch("topk_max");
    Scripted m3(std::vector<double>{5, 3, 4, 1, 2, 6});
    auto t3 = volt::make_trainer({.max_epochs = 6},
                                 volt::ModelCheckpoint({.dirpath = d2.string(), .monitor = "score",
                                                        .mode = volt::ModelCheckpoint::Mode::max, .save_top_k = 1}));
    t3.fit(m3, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::data::TensorLoader(x, y, {.batch_size = 8}));
    CHECK(files_in(d2) == std::set<std::string>{"epoch=5-step=12.ckpt"});
  }
}

TEST_CASE("ModelCheckpoint saves every n steps or epochs, names files from a template, keeps one without a monitor",
          "[checkpoint][model_checkpoint]") {
  auto [x, y] = vt::regression_data(32);
  SECTION("every 3 steps, all kept") {
    const fs::path dir = scratch("steps");
    vt::Regressor m;
    auto t = volt::make_trainer({.max_epochs = 2},
                                volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "s{step:03d}", .save_top_k = -1,
                                                       .every_n_train_steps = 3, .auto_insert_metric_name = false}));
    t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 4}));  // 16 steps
    CHECK(files_in(dir) == std::set<std::string>{"s003.ckpt", "s006.ckpt", "s009.ckpt", "s012.ckpt", "s015.ckpt"});
  }
  SECTION("every 2 epochs; without a monitor only the latest stays") {
    const fs::path dir = scratch("epochs");
    vt::Regressor m;
    auto t = volt::make_trainer({.max_epochs = 5},
                                volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "{epoch}-{train_loss:.3e}",
                                                       .every_n_epochs = 2}));
    t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}));
    const auto files = files_in(dir);
    REQUIRE(files.size() == 1);
    CHECK(files.begin()->rfind("epoch=3-train_loss=", 0) == 0);
    CHECK(t.callback<volt::ModelCheckpoint>().best_model_path() == (dir / *files.begin()).string());
  }
  SECTION("a file of another run is not overwritten") {
    const fs::path dir = scratch("versions");
    std::ofstream(dir / "epoch=0-step=8.ckpt") << "someone else's";
    vt::Regressor m;
    auto t = volt::make_trainer({.max_epochs = 1}, volt::ModelCheckpoint({.dirpath = dir.string()}));
    t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 4}));
    CHECK(files_in(dir) == std::set<std::string>{"epoch=0-step=8.ckpt", "epoch=0-step=8-v1.ckpt"});
  }
  SECTION("bad options and unknown names") {
    CHECK_THROWS_WITH(volt::ModelCheckpoint({.save_top_k = 3}), Contains("save_top_k=3") && Contains("monitor"));
    CHECK_THROWS_WITH(volt::ModelCheckpoint({.save_top_k = -2}), Contains("save_top_k=-2"));
    CHECK_THROWS_WITH(volt::ModelCheckpoint({.every_n_train_steps = 2, .every_n_epochs = 1}), Contains("choose one"));
    const fs::path dir = scratch("unknown");
    vt::Regressor m;
    auto t = volt::make_trainer({.max_epochs = 1},
                                volt::ModelCheckpoint({.dirpath = dir.string(), .monitor = "nope"}));
    CHECK_THROWS_WITH(t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8})),
                      Contains("\"nope\"") && Contains("train_loss"));
    auto t2 = volt::make_trainer({.max_epochs = 1}, volt::ModelCheckpoint({.dirpath = dir.string()}));
    vt::Regressor m2;
    CHECK_THROWS_WITH(t2.fit(m2, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, "best"),
                      Contains("no best checkpoint"));
    volt::Trainer<> plain({.max_epochs = 1});
    CHECK_THROWS_WITH(plain.fit(m2, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, "last"),
                      Contains("ModelCheckpoint"));
  }
}

TEST_CASE("A fresh fit in a folder of another run's checkpoints warns once and replaces no last.ckpt it did not write",
          "[checkpoint][model_checkpoint]") {
  // Run A writes last.ckpt; run B, another model, starts afresh in the same folder. Reference: A's weights, read
  // back from the file after B, and B's own weights.
  auto [x, y] = vt::regression_data(32);
  const fs::path dir = scratch("other_run_last");
  auto last_of = [&](const fs::path& file) {
    vt::Regressor r;
    volt::checkpoint::load_module_state(*r, volt::checkpoint::read(file.string()).at("state_dict").toGenericDict());
    return r;
  };
  auto run = [&](vt::Regressor& m, volt::ModelCheckpoint::Options o, const std::string& resume = "") {
    o.dirpath = dir.string();
    o.save_last = true;
    auto t = volt::make_trainer({.max_epochs = resume.empty() ? 1 : 2}, volt::ModelCheckpoint(o));
    CaptureCerr err;
    resume.empty() ? (void)t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}))
                   : (void)t.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, resume);
    return err.str();
  };
  vt::Regressor a(0.05, /*seed=*/1);
  CHECK_THAT(run(a, {}), !Contains("ModelCheckpoint"));  // an empty folder: nothing to say
  vt::Regressor b(0.05, /*seed=*/2);  // other first weights, so other weights at the end
  REQUIRE_FALSE(same_weights(*a, *b));
  const std::string said = run(b, {});
  INFO(said);
  CHECK_THAT(said, StartsWith("volt: ModelCheckpoint: the checkpoint folder " + dir.string() +
                              " already holds 2 checkpoints of another run (epoch=0-step=4.ckpt, last.ckpt)"));
  CHECK_THAT(said, Contains("fit(..., \"last\")") && Contains("last-v1.ckpt"));
  CHECK(said.find("volt:", 1) == std::string::npos);  // once
  CHECK(same_weights(*last_of(dir / "last.ckpt"), *a));  // A's last is A's still
  CHECK(same_weights(*last_of(dir / "last-v1.ckpt"), *b));
  CHECK(files_in(dir) ==
        std::set<std::string>{"epoch=0-step=4.ckpt", "epoch=0-step=4-v1.ckpt", "last.ckpt", "last-v1.ckpt"});

  // Resuming B's run (a second epoch), from its top-k file, is B's run going on: it writes over B's last
  // (last-v1.ckpt), warning nothing, and keeps the file it resumed from.
  vt::Regressor b2;
  CHECK_THAT(run(b2, {}, (dir / "epoch=0-step=4-v1.ckpt").string()), !Contains("ModelCheckpoint"));
  CHECK(same_weights(*last_of(dir / "last-v1.ckpt"), *b2));
  CHECK(same_weights(*last_of(dir / "last.ckpt"), *a));
  CHECK(files_in(dir) == std::set<std::string>{"epoch=0-step=4.ckpt", "epoch=0-step=4-v1.ckpt", "epoch=1-step=8.ckpt",
                                               "last.ckpt", "last-v1.ckpt"});

  // Said so: enable_version_counter=false replaces the files of the names it writes.
  vt::Regressor c(0.05, /*seed=*/3);
  CHECK_THAT(run(c, {.enable_version_counter = false}), Contains("enable_version_counter=false, so it replaces"));
  CHECK(same_weights(*last_of(dir / "last.ckpt"), *c));
}

namespace {
/// A small tmpfs mounted at `dir` while it lives (root only; `ok` is false where mounting is not allowed).
struct TmpfsMount {
  fs::path dir;
  bool ok;
  TmpfsMount(fs::path d, const std::string& options) : dir(std::move(d)) {
    fs::create_directories(dir);
    ok = std::system(("mount -t tmpfs -o " + options + " volt-test " + dir.string() + " 2>/dev/null").c_str()) == 0;
  }
  ~TmpfsMount() {
    if (ok) (void)std::system(("umount " + dir.string()).c_str());
  }
};
}  // namespace

TEST_CASE("ModelCheckpoint finds a folder it cannot write into when the fit starts, before any training",
          "[checkpoint][model_checkpoint]") {
  auto [x, y] = vt::regression_data(32);
  auto fit_into = [&](const fs::path& dirpath, vt::Regressor& m) {
    auto t = volt::make_trainer({.max_epochs = 2}, volt::ModelCheckpoint({.dirpath = dirpath.string()}));
    std::string what;
    try {
      t.fit(m, make_loader(x, y, 8));
    } catch (const volt::CheckpointError& e) {
      what = e.what();
    }
    CHECK(t.global_step() == 0);  // refused before the first step
    return what;
  };
  const fs::path base = scratch("unwritable");
  vt::Regressor m;
  SECTION("a folder that cannot be created (a file is in the way)") {
    std::ofstream(base / "file") << "x";
    CHECK_THAT(fit_into(base / "file" / "checkpoints", m),
               Contains("ModelCheckpoint cannot write checkpoints into " + (base / "file" / "checkpoints").string()) &&
                   Contains("cannot be created"));
  }
  SECTION("a read-only disk, a full disk, a disk smaller than the weights") {
    const TmpfsMount ro(base / "ro", "ro,size=64k");
    const TmpfsMount full(base / "full", "size=64k");
    const TmpfsMount tiny(base / "tiny", "size=16k");
    if (!ro.ok || !full.ok || !tiny.ok) {
      WARN("mounting a tmpfs is not allowed here (not root?): the read-only and full disk cases did not run");
      return;
    }
    CHECK_THAT(fit_into(ro.dir, m), Contains(ro.dir.string()) && Contains(std::strerror(EROFS)));
    {  // fill it: the kernel refuses the next block
      std::ofstream fill(full.dir / "filler", std::ios::binary);
      const std::string block(4096, 'x');
      for (int i = 0; i < 64 && fill; ++i) fill << block << std::flush;
    }
    CHECK_THAT(fit_into(full.dir, m), Contains(full.dir.string()) && Contains(std::strerror(ENOSPC)));
    struct Wide : vt::RegressorImpl {  // 64 KiB of weights on a 16 KiB disk
      torch::nn::Linear wide{nullptr};
      Wide() { wide = register_module("wide", torch::nn::Linear(128, 128)); }
    } wide;
    auto t = volt::make_trainer({.max_epochs = 1}, volt::ModelCheckpoint({.dirpath = tiny.dir.string()}));
    // float32 weights: 128 x 128 + 128 (wide) + 4 + 1 (the regressor's own) = 16517 numbers, 66068 bytes
    CHECK_THROWS_WITH(t.fit(wide, make_loader(x, y, 8)),
                      Contains(tiny.dir.string()) && Contains("bytes free and one checkpoint needs at least 66068"));
  }
}

TEST_CASE("ModelCheckpoint deletes nothing outside its folder, nor the checkpoint it resumed from",
          "[checkpoint][model_checkpoint]") {
  // Run A writes its checkpoints into a.; run B, in a new folder, resumes from A's best and trains on: every file of
  // A must still be there afterwards (Lightning prunes only inside its own dirpath).
  auto [x, y] = vt::regression_data(16);
  auto loader = [&] { return volt::data::TensorLoader(x, y, {.batch_size = 8}); };
  const std::vector<double> scores{5, 3, 4, 1, 2, 6, 0.5, 7};
  struct Case {
    const char* name;
    volt::ModelCheckpoint::Options options;
  };
  for (const Case& c : {Case{"top1_default", {}}, Case{"top2_monitor", {.monitor = "score", .save_top_k = 2}},
                        Case{"top1_monitor", {.monitor = "score"}}}) {
    DYNAMIC_SECTION(c.name) {
      const fs::path a = scratch(std::string("other_run_a_") + c.name), b = scratch(std::string("other_run_b_") + c.name);
      Scripted ma(scores);
      auto ta = volt::make_trainer({.max_epochs = 3, .num_sanity_val_steps = 0, .default_root_dir = a.string()},
                                   volt::ModelCheckpoint(c.options));
      ta.fit(ma, loader(), loader());
      const auto a_files = files_in(a / "checkpoints");
      REQUIRE(!a_files.empty());
      const std::string a_best = ta.callback<volt::ModelCheckpoint>().best_model_path();
      REQUIRE(fs::exists(a_best));

      Scripted mb(scores);
      auto tb = volt::make_trainer({.max_epochs = 8, .num_sanity_val_steps = 0, .default_root_dir = b.string()},
                                   volt::ModelCheckpoint(c.options));
      tb.fit(mb, loader(), loader(), a_best);
      CHECK(tb.global_step() == 16);
      CHECK(files_in(a / "checkpoints") == a_files);  // run A's files, untouched
      CHECK(!files_in(b / "checkpoints").empty());
      const std::string b_best = tb.callback<volt::ModelCheckpoint>().best_model_path();
      CHECK(fs::path(b_best).parent_path() == b / "checkpoints");  // the best is one of its own by now
      if (c.options.save_top_k == 2) CHECK(files_in(b / "checkpoints").size() == 2);
    }
  }
  SECTION("in its own folder, the checkpoint it resumed from stays; the others it ranked out are deleted") {
    const fs::path dir = scratch("resumed_from_kept");
    Scripted m1(scores);
    auto t1 = volt::make_trainer({.max_epochs = 2, .num_sanity_val_steps = 0},
                                 volt::ModelCheckpoint({.dirpath = dir.string()}));
    t1.fit(m1, loader(), loader());
    const std::string resumed = t1.callback<volt::ModelCheckpoint>().best_model_path();  // epoch=1-step=4
    Scripted m2(scores);
    auto t2 = volt::make_trainer({.max_epochs = 4, .num_sanity_val_steps = 0},
                                 volt::ModelCheckpoint({.dirpath = dir.string()}));
    t2.fit(m2, loader(), loader(), resumed);
    CHECK(t2.ckpt_path() == resumed);
    // top 1 without a monitor: epoch 2's file was replaced by epoch 3's; the resumed-from file stays
    CHECK(files_in(dir) == std::set<std::string>{"epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt"});
  }
}

TEST_CASE("ModelCheckpoint monitoring a validation metric warns, not fails, when it saves before the first validation",
          "[checkpoint][model_checkpoint]") {
  // The README's settings: monitor val_loss, save every n steps; validation runs at each epoch's end, after the
  // first step-based saves.
  auto [x, y] = vt::regression_data(32);
  const fs::path dir = scratch("monitor_before_validation");
  vt::Regressor m;
  CaptureCerr err;
  auto t = volt::make_trainer({.max_epochs = 2, .num_sanity_val_steps = 0},
                              volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "{step}", .monitor = "val_loss",
                                                     .save_top_k = -1, .every_n_train_steps = 3}));
  t.fit(m, make_loader(x, y, 8), make_loader(x, y, 8));  // 4 steps per epoch: saves at 3 (no validation yet), 6
  CHECK_THAT(err.str(), Contains("\"val_loss\"") && Contains("warning until the fit's first validation"));
  CHECK(t.validation_has_run());
  // step 3 came before any validation: no ranked file; step 6 came after epoch 0's validation
  CHECK(files_in(dir) == std::set<std::string>{"step=6.ckpt"});

  SECTION("once a validation has run, a monitor that is still missing is an error") {
    const fs::path d2 = scratch("monitor_misspelt");
    vt::Regressor m2;
    auto t2 = volt::make_trainer({.max_epochs = 2, .num_sanity_val_steps = 0},
                                 volt::ModelCheckpoint({.dirpath = d2.string(), .monitor = "val_los",
                                                        .every_n_train_steps = 3}));
    CaptureCerr quiet;
    CHECK_THROWS_WITH(t2.fit(m2, make_loader(x, y, 8), make_loader(x, y, 8)),
                      Contains("\"val_los\"") && Contains("val_loss"));
    CHECK(t2.global_step() == 6);  // the warning at step 3, the error at step 6
  }
}

// ---- callback state across a resume -------------------------------------------------------------------

TEST_CASE("callback states with numbers (EarlyStopping) resume; \"last\" with no checkpoint yet starts afresh",
          "[checkpoint]") {
  const fs::path dir = scratch("early_stopping");
  auto [x, y] = vt::regression_data(32);
  auto make = [&] {
    return volt::make_trainer({.max_epochs = 3},
                              volt::EarlyStopping({.monitor = "train_loss", .mode = volt::EarlyStopping::Mode::max,
                                                   .patience = 50}),
                              volt::ModelCheckpoint({.dirpath = dir.string(), .save_last = true}));
  };
  vt::Regressor a;
  auto t = make();
  t.fit(a, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, "last");  // nothing yet: from the start
  CHECK(t.global_step() == 12);
  const auto& es = t.callback<volt::EarlyStopping>();
  REQUIRE(es.wait_count() > 0);  // the loss falls, so "max" waits
  const auto saved = volt::checkpoint::read((dir / "last.ckpt").string()).at("callbacks").toGenericDict();
  CHECK(saved.at("volt::EarlyStopping").toGenericDict().at("wait_count").toDouble() == static_cast<double>(es.wait_count()));
  vt::Regressor b;
  auto t2 = volt::make_trainer({.max_epochs = 4},
                               volt::EarlyStopping({.monitor = "train_loss", .mode = volt::EarlyStopping::Mode::max,
                                                    .patience = 50}),
                               volt::ModelCheckpoint({.dirpath = dir.string(), .save_last = true}));
  t2.fit(b, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, "last");
  CHECK(t2.global_step() == 16);  // one more epoch
  CHECK(t2.callback<volt::EarlyStopping>().wait_count() == es.wait_count() + 1);
  CHECK(t2.callback<volt::EarlyStopping>().best_score() == es.best_score());
}

namespace {
/// A regressor whose validation records the weights it sees (the average, swapped in).
struct SeesWeights : vt::RegressorImpl {
  std::vector<torch::Tensor> seen;
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    if (ctx.batch_idx() == 0) seen.push_back(vt::flat_params(*this));
    vt::RegressorImpl::validation_step(b, ctx);
  }
};

/// A module with a batch norm: its running statistics are floating-point buffers, its batch count an integer one.
struct WithNorm : torch::nn::Module {
  torch::nn::Linear lin{4, 1};
  torch::nn::BatchNorm1d bn{4};
  WithNorm() {
    torch::manual_seed(3);
    register_module("lin", lin);
    register_module("bn", bn);
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return vt::mse(lin(bn(b.data)), b.target);
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.05)); }
};

/// Records the module's running mean after every training batch (before EMAWeightAveraging, which comes after it).
struct RunningMeans {
  std::vector<torch::Tensor> after_step;
  void on_train_batch_end(auto&, WithNorm& m, const auto&, const auto&, int64_t) {
    after_step.push_back(m.bn->running_mean.clone().to(torch::kFloat64));
  }
};
/// Manual optimization: SGD steps after every second batch, the two batches' gradients summed.
struct ManualEveryOther : vt::RegressorImpl {
  static constexpr bool automatic_optimization = false;
  void training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto opts = ctx.optimizers();
    ctx.manual_backward(vt::mse(forward(b.data), b.target));
    if (ctx.batch_idx() % 2 == 1) {
      opts[0].step();
      opts[0].zero_grad();
    }
  }
};

/// The module's weights after the last training batch.
struct LastWeights {
  torch::Tensor* out;
  void on_train_batch_end(auto&, auto& m, const auto&, const auto&, int64_t) { *out = vt::flat_params(m); }
};

/// Reads EMAWeightAveraging's average after each training batch (it comes after the callback in the pack).
struct ReadAverage {
  std::vector<torch::Tensor>* out;
  void on_train_batch_end(auto& t, auto&, const auto&, const auto&, int64_t) {
    std::vector<torch::Tensor> flat;
    for (const auto& [name, v] : t.template callback<volt::EMAWeightAveraging>().average()) flat.push_back(v.flatten());
    out->push_back(torch::cat(flat));
  }
};
}  // namespace

TEST_CASE("EMAWeightAveraging equals a hand-written average; validation sees it; the module ends with it", "[callbacks][ema]") {
  auto [x, y] = vt::regression_data(32);
  const double decay = 0.9;
  SeesWeights m;
  auto t = volt::make_trainer({.max_epochs = 3, .num_sanity_val_steps = 1},
                              volt::EMAWeightAveraging({.decay = decay, .update_every_n_steps = 2,
                                                        .update_starting_at_step = 3}));
  t.fit(m, make_loader(x, y, 8), make_loader(x, y, 16));  // 4 steps an epoch, 12 in all

  // By hand: the same model and SGD steps; after step index s in {4, 6, 8, 10}, the average in float64.
  vt::RegressorImpl ref;
  torch::optim::SGD opt(ref.parameters(), torch::optim::SGDOptions(ref.lr));
  torch::Tensor average = vt::flat_params(ref);  // before any update: the weights when the fit started
  std::vector<torch::Tensor> at_validation{average.clone()};  // the sanity check
  int updates = 0;
  for (int64_t s = 0; s < 12; ++s) {
    const int64_t b = s % 4;
    opt.zero_grad();
    vt::mse(ref.forward(x.slice(0, 8 * b, 8 * b + 8)), y.slice(0, 8 * b, 8 * b + 8)).backward();
    opt.step();
    if (s >= 3 && s % 2 == 0) {
      average = updates++ == 0 ? vt::flat_params(ref) : decay * average + (1 - decay) * vt::flat_params(ref);
    }
    if (b == 3) at_validation.push_back(average.clone());
  }
  CHECK(t.callback<volt::EMAWeightAveraging>().num_updates() == 4);
  REQUIRE(m.seen.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    INFO("validation " << i);
    CHECK(torch::allclose(m.seen[i], at_validation[i], 1e-6, 1e-7));
  }
  CHECK(torch::allclose(vt::flat_params(m), average, 1e-6, 1e-7));  // copied in when training ended
  CHECK_FALSE(torch::allclose(vt::flat_params(ref), average, 1e-4, 1e-5));  // and not the last weights

  SECTION("buffers: floating ones averaged with use_buffers, integer ones current; without, the last update's") {
    for (const bool use_buffers : {true, false}) {
      WithNorm n;
      auto tb = volt::make_trainer({.max_epochs = 2}, RunningMeans{},
                                   volt::EMAWeightAveraging({.decay = 0.5, .use_buffers = use_buffers}));
      tb.fit(n, make_loader(x, y, 8));
      const auto& means = tb.callback<RunningMeans>().after_step;
      REQUIRE(means.size() == 8);
      torch::Tensor mean = means[0];
      for (std::size_t i = 1; i < means.size(); ++i) mean = use_buffers ? 0.5 * mean + 0.5 * means[i] : means[i];
      INFO("use_buffers " << use_buffers);
      CHECK(torch::allclose(n.bn->running_mean.to(torch::kFloat64), mean, 1e-6, 1e-7));
      CHECK(n.bn->num_batches_tracked.item<int64_t>() == 8);
    }
  }
  SECTION("manual optimization: one update per batch that stepped") {
    ManualEveryOther mm;
    auto tm = volt::make_trainer({.max_epochs = 2}, volt::EMAWeightAveraging({.decay = 0.6}));
    tm.fit(mm, make_loader(x, y, 8));  // 4 batches an epoch: steps after batches 1 and 3
    vt::RegressorImpl hand;
    torch::optim::SGD sgd(hand.parameters(), torch::optim::SGDOptions(hand.lr));
    torch::Tensor avg;
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t b = i % 4;
      vt::mse(hand.forward(x.slice(0, 8 * b, 8 * b + 8)), y.slice(0, 8 * b, 8 * b + 8)).backward();
      if (b % 2 == 1) {
        sgd.step();
        sgd.zero_grad();
        avg = avg.defined() ? 0.6 * avg + 0.4 * vt::flat_params(hand) : vt::flat_params(hand);
      }
    }
    CHECK(tm.callback<volt::EMAWeightAveraging>().num_updates() == 4);
    CHECK(torch::allclose(vt::flat_params(mm), avg, 1e-6, 1e-7));
  }
  CHECK_THROWS_WITH(volt::EMAWeightAveraging({.decay = 1.5}), Contains("decay=1.5") && Contains("0 <= decay <= 1"));
  CHECK_THROWS_WITH(volt::EMAWeightAveraging({.update_every_n_steps = -1}), Contains("update_every_n_steps=-1"));
}

TEST_CASE("EMAWeightAveraging: checkpoints hold the average as their weights, and a resume goes on bit for bit",
          "[callbacks][ema][checkpoint]") {
  auto [x, y] = vt::regression_data(40);
  auto loader = [&] { return make_loader(x, y, 8, /*shuffle=*/true, 11); };  // 5 steps an epoch
  const volt::EMAWeightAveraging::Options ema{.decay = 0.7};
  auto every_step = [](const fs::path& dir) {
    return volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "s{step}", .save_top_k = -1,
                                  .every_n_train_steps = 1, .auto_insert_metric_name = false});
  };
  // The uninterrupted run, the callback before ModelCheckpoint: each file holds the average after its step's update.
  const fs::path ref_dir = scratch("ema_ref");
  vt::RegressorImpl ref;
  std::vector<torch::Tensor> averages;  // after each step, read from the callback
  auto tr = volt::make_trainer({.max_epochs = 3}, volt::EMAWeightAveraging(ema), ReadAverage{&averages}, every_step(ref_dir));
  tr.fit(ref, loader());
  REQUIRE(averages.size() == 15);
  const auto file7 = volt::checkpoint::read((ref_dir / "s7.ckpt").string());
  const auto weights7 = file7.at("state_dict").toGenericDict();
  CHECK(torch::equal(torch::cat({weights7.at("lin.weight").toTensor().flatten(), weights7.at("lin.bias").toTensor().flatten()}),
                     averages[6]));
  const auto state7 = file7.at("callbacks").toGenericDict().at("volt::EMAWeightAveraging").toGenericDict();
  CHECK(state7.at("n_averaged").toInt() == 7);
  CHECK_FALSE(torch::equal(state7.at("current_model_state").toGenericDict().at("lin.weight").toTensor(),
                           weights7.at("lin.weight").toTensor()));

  // Resumed from step 7 and from step 10 (an epoch's end), with ModelCheckpoint first in the pack this time (its
  // files miss the batch's update, which the resumed fit makes first): the same weights, bit for bit.
  for (const int step : {7, 10}) {
    const fs::path dir = scratch("ema_resume_" + std::to_string(step));
    {
      vt::RegressorImpl first;
      auto t1 = volt::make_trainer({.max_steps = step}, every_step(dir), volt::EMAWeightAveraging(ema));
      t1.fit(first, loader());
    }
    vt::RegressorImpl resumed(0.05, /*seed=*/99);  // other initial weights: everything must come from the file
    auto t2 = volt::make_trainer({.max_epochs = 3}, every_step(dir), volt::EMAWeightAveraging(ema));
    t2.fit(resumed, loader(), (dir / ("s" + std::to_string(step) + ".ckpt")).string());
    INFO("resumed from step " << step);
    CHECK(t2.callback<volt::EMAWeightAveraging>().num_updates() == 15);
    CHECK(vt::same_weights(resumed, ref));
  }
  SECTION("a checkpoint written without the callback: no update made yet, the next copies the weights") {
    const fs::path dir = scratch("ema_plain");
    vt::RegressorImpl first;
    auto t1 = volt::make_trainer({.max_steps = 5}, every_step(dir));
    t1.fit(first, make_loader(x, y, 8));  // one epoch of 5 batches, in order
    vt::RegressorImpl resumed(0.05, 99);
    auto t2 = volt::make_trainer({.max_steps = 10}, volt::EMAWeightAveraging(ema));
    t2.fit(resumed, make_loader(x, y, 8), (dir / "s5.ckpt").string());
    // By hand: SGD (no momentum: no state) from the file's weights over epoch 1's batches, averaged from step 6 on.
    torch::optim::SGD sgd(first.parameters(), torch::optim::SGDOptions(first.lr));
    torch::Tensor avg;
    for (int64_t b = 0; b < 5; ++b) {
      sgd.zero_grad();
      vt::mse(first.forward(x.slice(0, 8 * b, 8 * b + 8)), y.slice(0, 8 * b, 8 * b + 8)).backward();
      sgd.step();
      avg = avg.defined() ? 0.7 * avg + 0.3 * vt::flat_params(first) : vt::flat_params(first);
    }
    CHECK(t2.callback<volt::EMAWeightAveraging>().num_updates() == 5);
    CHECK(torch::allclose(vt::flat_params(resumed), avg, 1e-6, 1e-7));
  }
  SECTION("a run failing during validation leaves the module its training weights, and validate() after a fit swaps nothing") {
    struct FailsInValidation : vt::RegressorImpl {
      int64_t validations = 0;
      void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
        if (++validations == 3) throw std::runtime_error("boom in validation");
        vt::RegressorImpl::validation_step(b, ctx);
      }
    } f;
    torch::Tensor last_step;
    auto tf = volt::make_trainer({.max_epochs = 2, .num_sanity_val_steps = 0},
                                 volt::EMAWeightAveraging({.decay = 0.5}), LastWeights{&last_step});
    CHECK_THROWS_WITH(tf.fit(f, make_loader(x, y, 8), make_loader(x, y, 20)), Contains("boom in validation"));
    // Epoch 1's validation failed on its first batch, the average swapped in: the module has its last step's weights.
    CHECK(torch::equal(vt::flat_params(f), last_step));
    auto tv = volt::make_trainer({}, volt::EMAWeightAveraging({.decay = 0.5}));
    vt::RegressorImpl trained;
    tv.fit(trained, make_loader(x, y, 8));
    const torch::Tensor before = vt::flat_params(trained);  // the average, copied in at the end
    torch::NoGradGuard no_grad;
    for (auto& p : trained.parameters()) p.add_(1.0);  // as if other weights were loaded
    const torch::Tensor loaded = vt::flat_params(trained);
    tv.validate(trained, make_loader(x, y, 20));
    CHECK(torch::equal(vt::flat_params(trained), loaded));
    CHECK_FALSE(torch::equal(loaded, before));
  }
}

TEST_CASE("Profiler: self times of nested events, by hand", "[callbacks][profiler]") {
  // Thread 1: a (0-100 us) holds b (10-40) which holds c (20-30), then d (50-60); thread 2: a again (0-5) alone.
  using E = volt::detail::TraceEvent;
  auto ev = [](const char* name, uint64_t thread, uint64_t start_us, uint64_t end_us) {
    E e;
    e.name = name;
    e.thread = thread;
    e.start_ns = start_us * 1000;
    e.dur_ns = (end_us - start_us) * 1000;
    return e;
  };
  E memory = ev("[memory]", 1, 15, 15);
  memory.memory = true;
  const auto table = volt::detail::op_table(
      {ev("d", 1, 50, 60), ev("c", 1, 20, 30), ev("a", 2, 0, 5), ev("b", 1, 10, 40), ev("a", 1, 0, 100), memory});
  std::map<std::string, volt::ProfiledOp> by;
  for (const auto& op : table) by[op.name] = op;
  REQUIRE(table.size() == 4);
  CHECK(table.front().name == "a");  // the slowest by self time first
  CHECK(by["a"].calls == 2);
  CHECK(by["a"].total_us == Approx(105));
  CHECK(by["a"].self_us == Approx(100 - 30 - 10 + 5));
  CHECK(by["b"].self_us == Approx(30 - 10));
  CHECK(by["c"].self_us == Approx(10));
  CHECK(by["d"].self_us == Approx(10));
}

TEST_CASE("Profiler: a window of training batches, its Chrome trace read back, the table of its ops", "[callbacks][profiler]") {
  const auto dir = vt::scratch("profiler");
  auto [x, y] = vt::regression_data(48);
  {
    vt::ProfiledNet net;
    auto t = volt::make_trainer({.max_epochs = 1},
                                volt::Profiler({.dirpath = dir.string(), .skip_first = 1, .wait = 1, .warmup = 1,
                                                .active = 3, .record_shapes = true, .profile_memory = true,
                                                .row_limit = 5}));
    t.fit(net, make_loader(x, y, 4));  // 12 batches
    const auto& p = t.callback<volt::Profiler>();
    CHECK(p.trace_path() == (dir / "trace.rank0.pt.trace.json").string());
    CHECK(p.steps_recorded() == 3);
    CHECK(vt::check_profiler_trace(p.trace_path(), 0, {3, 4, 5}, p.summary()) == "");
    std::ifstream in(p.trace_path());
    const auto trace = nlohmann::json::parse(in);
    bool shapes = false, memory = false;
    for (const auto& e : trace.at("traceEvents")) {
      if (e.at("name") == "aten::addmm" && e.contains("args")) shapes = shapes || e["args"].contains("Input Dims");
      if (e.at("name") == "[memory]" && e.at("ph") == "i") memory = memory || e["args"].at("Bytes").get<int64_t>() != 0;
    }
    CHECK(shapes);
    CHECK(memory);
  }
  {  // A window past the fit's end: the fit's end writes what it recorded.
    vt::ProfiledNet net;
    auto t = volt::make_trainer({.max_epochs = 1},
                                volt::Profiler({.dirpath = dir.string(), .filename = "short", .wait = 10, .warmup = 0,
                                                .active = 5, .row_limit = 0}));
    t.fit(net, make_loader(x, y, 4));
    const auto& p = t.callback<volt::Profiler>();
    CHECK(p.steps_recorded() == 2);
    CHECK(vt::check_profiler_trace(p.trace_path(), 0, {10, 11}, p.summary()) == "");
  }
}

namespace {
struct ThrowAt {
  int64_t batch;
  template <class T, class M, class B>
  void on_train_batch_start(T&, M&, const B&, int64_t i) {
    if (i == batch) throw std::runtime_error("stop here");
  }
};
}  // namespace

TEST_CASE("Profiler: a fit that fails inside the window stops the profiler; bad options are refused",
          "[callbacks][profiler]") {
  const auto dir = vt::scratch("profiler_fail");
  auto [x, y] = vt::regression_data(32);
  for (int round = 0; round < 2; ++round) {  // a profiler left running would refuse the second round's start
    vt::ProfiledNet net;
    auto t = volt::make_trainer({.max_epochs = 1}, volt::Profiler({.dirpath = dir.string(), .wait = 0, .active = 4}),
                                ThrowAt{3});
    CHECK_THROWS_WITH(t.fit(net, make_loader(x, y, 4)), Contains("stop here"));
    CHECK_FALSE(std::filesystem::exists(dir / "trace.rank0.pt.trace.json"));
  }
  vt::ProfiledNet net;
  auto t = volt::make_trainer({.max_epochs = 1}, volt::Profiler({.dirpath = dir.string(), .wait = 0, .active = 2}));
  t.fit(net, make_loader(x, y, 4));
  CHECK(vt::check_profiler_trace((dir / "trace.rank0.pt.trace.json").string(), 0, {1, 2},
                                 t.callback<volt::Profiler>().summary()) == "");
  CHECK_THROWS_WITH(volt::Profiler({.active = 0}), Contains("active = 0") && Contains("1 or more"));
  CHECK_THROWS_WITH(volt::Profiler({.wait = -1}), Contains("wait = -1"));
  CHECK_THROWS_WITH(volt::Profiler({.filename = "a/b"}), Contains("\"a/b\"") && Contains("without a folder"));
}

namespace {
/// A backbone (a pretrained part) and a head; its optimizer takes the parameters that require gradients, as
/// Lightning's documentation of BackboneFinetuning asks.
struct FinetuneNetImpl : torch::nn::Module {
  torch::nn::Sequential backbone{nullptr};
  torch::nn::Linear head{nullptr};
  FinetuneNetImpl() {
    torch::manual_seed(4);
    backbone = register_module("backbone", torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Tanh()));
    head = register_module("head", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(backbone->forward(x)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return vt::mse(forward(b.data), b.target);
  }
  torch::optim::SGD configure_optimizers() {
    std::vector<torch::Tensor> trainable;
    for (const auto& p : parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    return torch::optim::SGD(trainable, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
};
TORCH_MODULE(FinetuneNet);

struct GroupRates {
  std::vector<double>* rates;
  template <class T, class M>
  void on_train_epoch_end(T& trainer, M&) {
    rates->push_back(trainer.optimizer()->param_groups().back().options().get_lr());
  }
};

volt::BackboneFinetuning finetuning() {
  return volt::BackboneFinetuning({.unfreeze_backbone_at_epoch = 2, .lambda_func = [](int64_t) { return 3.0; }});
}
}  // namespace

TEST_CASE("BackboneFinetuning: the backbone frozen, then trained at its own growing rate, as a hand-written loop",
          "[callbacks][finetuning]") {
  auto [x, y] = vt::regression_data(16);
  std::vector<double> rates;
  FinetuneNet net;
  auto t = volt::make_trainer({.max_epochs = 6}, finetuning(), GroupRates{&rates});
  t.fit(net, make_loader(x, y, 4));
  // Lightning's rule: 0.1 x 0.1 at epoch 2, then x3 each epoch, at most the head's 0.1 (should_align).
  REQUIRE(rates.size() == 6);
  const std::vector<double> want = {0.0, 0.0, 0.01, 0.03, 0.09, 0.1};
  for (std::size_t e = 0; e < want.size(); ++e) CHECK(rates[e] == Approx(want[e]).margin(1e-15));
  CHECK(t.callback<volt::BackboneFinetuning>().backbone_lr() == Approx(0.1));

  // The reference: Lightning's BackboneFinetuning by hand, the backbone's group added when it unfreezes.
  FinetuneNet ref;
  for (auto& p : ref->backbone->parameters()) p.set_requires_grad(false);
  torch::optim::SGD opt(ref->head->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  double previous = 0.0;
  for (int64_t epoch = 0; epoch < 6; ++epoch) {
    if (epoch == 2) {
      for (auto& p : ref->backbone->parameters()) p.set_requires_grad(true);
      previous = 0.1 * 0.1;
      auto options = std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(previous).momentum(0.9));
      opt.add_param_group(torch::optim::OptimizerParamGroup(ref->backbone->parameters(), std::move(options)));
    } else if (epoch > 2) {
      previous = std::min(3.0 * previous, 0.1);
      opt.param_groups()[1].options().set_lr(previous);
    }
    for (auto batch : make_loader(x, y, 4)) {
      opt.zero_grad();
      vt::mse(ref->forward(batch.data), batch.target).backward();
      opt.step();
    }
  }
  CHECK(torch::equal(vt::flat_params(*net), vt::flat_params(*ref)));
  FinetuneNet initial;
  CHECK_FALSE(torch::equal(net->backbone->parameters()[0], initial->backbone->parameters()[0]));  // it did train
}

TEST_CASE("BackboneFinetuning: a fit resumed before, at and after the unfreezing ends bit-identical",
          "[callbacks][finetuning]") {
  const fs::path dir = scratch("finetune_resume");
  auto [x, y] = vt::regression_data(16);
  FinetuneNet whole;
  auto a = volt::make_trainer({.max_epochs = 6}, finetuning(),
                              volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "{step}", .save_top_k = -1,
                                                     .every_n_train_steps = 1}));
  a.fit(whole, make_loader(x, y, 4));  // 4 batches an epoch
  for (const int step : {6, 8, 10, 13, 16}) {
    INFO("resumed from step " << step);
    FinetuneNet resumed;
    auto b = volt::make_trainer({.max_epochs = 6}, finetuning());
    b.fit(resumed, make_loader(x, y, 4), (dir / ("step=" + std::to_string(step) + ".ckpt")).string());
    CHECK(torch::equal(vt::flat_params(*resumed), vt::flat_params(*whole)));
    CHECK(b.callback<volt::BackboneFinetuning>().backbone_lr() ==
          a.callback<volt::BackboneFinetuning>().backbone_lr());
    for (const auto& p : resumed->backbone->parameters()) CHECK(p.requires_grad());
  }
  FinetuneNet net;
  auto bad = volt::make_trainer({.max_epochs = 1}, volt::BackboneFinetuning({.backbone = "features"}));
  CHECK_THROWS_WITH(bad.fit(net, make_loader(x, y, 4)),
                    Contains("no submodule \"features\"") && Contains("backbone, head"));
  CHECK_THROWS_WITH(volt::BackboneFinetuning({.unfreeze_backbone_at_epoch = -1}), Contains("= -1"));
}
