// Loggers and monitors: TensorBoardLogger's run for Python's tensorboard to read back (test/tensorboard_check.py),
// the version folder loggers share, ModelSummary against hand-counted parameters, ThroughputMonitor against the
// test's own clock and batch sizes, DeviceStatsMonitor against the process's own counters.

#include "common.hpp"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <map>
#include <thread>
#include <algorithm>
#include <tuple>
#include <unistd.h>
#include <vector>

namespace {

/// What loggers receive, every (tag, step, value), in order.
struct LogRecorder {
  std::vector<std::tuple<std::string, int64_t, double>> rows;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
    for (const auto& [k, v] : metrics) rows.emplace_back(k, step, v);
  }
};

/// A regressor that also logs values a float cannot hold exactly, tiny and large ones, and a constant.
struct ManyValues : vt::RegressorImpl {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto loss = vt::RegressorImpl::training_step(b, ctx);
    const double s = static_cast<double>(ctx.global_step());
    ctx.log("third", 1.0 / 3.0 + s);
    ctx.log("tiny", -1e-30 * (s + 1.0));
    ctx.log("large", 123456.789 * (s + 1.0), {.on_step = true, .on_epoch = true});
    return loss;
  }
};

std::filesystem::path env_dir(const char* name) {
  const char* dir = std::getenv(name);
  REQUIRE(dir != nullptr);
  return dir;
}

}  // namespace

// Run by the ctest `tensorboard.read` (test/CMakeLists.txt), which then reads the files with Python's tensorboard.
TEST_CASE("TensorBoardLogger writes a fit and a test for Python's tensorboard to read back", "[.tensorboard_write]") {
  const auto dir = env_dir("VOLT_TB_DIR");
  fs::remove_all(dir);
  ManyValues m;
  auto [x, y] = vt::regression_data(40);
  auto train = make_loader(x, y, 8), val = make_loader(x, y, 16);
  volt::TensorBoardLogger::Options tb{.hparams = {{"lr", 0.05}, {"optimizer", "sgd"}, {"nesterov", false}, {"batch_size", 8}},
                                      .hparam_metrics = {"val_loss"}};
  tb.max_queue = 3;
  auto t = volt::make_trainer({.max_epochs = 3, .log_every_n_steps = 2, .default_root_dir = dir.string()},
                              volt::TensorBoardLogger(tb), LogRecorder{}, volt::CSVLogger{});
  t.fit(m, train, val);
  t.test(m, val);
  // What the loggers received, for the Python side to compare with what it reads.
  std::ofstream expected(dir / "expected.tsv");
  expected.precision(17);
  for (const auto& [tag, step, value] : t.callback<LogRecorder>().rows) expected << tag << "\t" << step << "\t" << value << "\n";
  // The parameters, counted by hand: Linear(4, 1) holds a 1x4 weight and a bias.
  std::ofstream(dir / "expected_params.txt") << 4 * 1 + 1 << "\n";
  REQUIRE(t.callback<volt::TensorBoardLogger>().log_dir() == t.callback<volt::CSVLogger>().log_dir());
  REQUIRE(t.callback<LogRecorder>().rows.size() > 40);

  // A fit stopped by SIGTERM at step 5, with room for 1000 events in memory: what was logged reaches the file through
  // the stop's flush.
  struct Raises : ManyValues {
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      if (ctx.global_step() == 5) std::raise(SIGTERM);
      return ManyValues::training_step(b, ctx);
    }
  } stopped;
  auto ts = volt::make_trainer({.max_epochs = 3, .log_every_n_steps = 1, .default_root_dir = (dir / "signal").string(),
                                .signals = {.exit_process = false}},
                               volt::TensorBoardLogger({.max_queue = 1000}), LogRecorder{});
  CHECK_THROWS_AS(ts.fit(stopped, train, val), volt::Interrupted);
  std::ofstream expected_stopped(dir / "signal" / "expected.tsv");
  expected_stopped.precision(17);
  for (const auto& [tag, step, value] : ts.callback<LogRecorder>().rows) {
    expected_stopped << tag << "\t" << step << "\t" << value << "\n";
  }
  REQUIRE(ts.callback<LogRecorder>().rows.size() > 20);
}

TEST_CASE("Loggers of one Trainer share a version folder; each new run takes the next", "[callbacks]") {
  const auto dir = vt::scratch("logger_versions");
  auto [x, y] = vt::regression_data(16);
  auto loader = make_loader(x, y, 8);
  auto run_csv_first = [&] {
    vt::RegressorImpl m;
    auto t = volt::make_trainer({.max_epochs = 1, .default_root_dir = dir.string()}, volt::CSVLogger{},
                                volt::TensorBoardLogger{});
    t.fit(m, loader);
    CHECK(t.callback<volt::CSVLogger>().log_dir() == t.callback<volt::TensorBoardLogger>().log_dir());
    return t.callback<volt::TensorBoardLogger>().log_dir();
  };
  auto run_tb_first = [&] {
    vt::RegressorImpl m;
    auto t = volt::make_trainer({.max_epochs = 1, .log_every_n_steps = 1, .default_root_dir = dir.string()}, volt::TensorBoardLogger{},
                                volt::CSVLogger{});
    t.fit(m, loader);
    CHECK(t.callback<volt::CSVLogger>().log_dir() == t.callback<volt::TensorBoardLogger>().log_dir());
    CHECK(fs::exists(t.callback<volt::TensorBoardLogger>().event_file()));
    CHECK(fs::exists(t.callback<volt::CSVLogger>().metrics_file()));
    return t.callback<volt::TensorBoardLogger>().log_dir();
  };
  CHECK(run_csv_first() == dir / "volt_logs" / "version_0");
  CHECK(run_tb_first() == dir / "volt_logs" / "version_1");
  CHECK(run_csv_first() == dir / "volt_logs" / "version_2");
  SECTION("an explicit version, and another name, keep apart") {
    vt::RegressorImpl m;
    auto t = volt::make_trainer({.max_epochs = 1, .default_root_dir = dir.string()},
                                volt::CSVLogger({.name = "csv_only"}), volt::TensorBoardLogger({.version = 7}));
    t.fit(m, loader);
    CHECK(t.callback<volt::CSVLogger>().log_dir() == dir / "csv_only" / "version_0");
    CHECK(t.callback<volt::TensorBoardLogger>().log_dir() == dir / "volt_logs" / "version_7");
  }
  SECTION("fast_dev_run writes nothing") {
    vt::RegressorImpl m;
    auto t = volt::make_trainer({.fast_dev_run = 1, .default_root_dir = dir.string()}, volt::TensorBoardLogger{});
    t.fit(m, loader);
    CHECK(t.callback<volt::TensorBoardLogger>().event_file().empty());
    CHECK_FALSE(fs::exists(dir / "volt_logs" / "version_3"));
  }
  CHECK_THROWS_WITH(volt::TensorBoardLogger({.max_queue = 0}), Contains("max_queue=0") && Contains(">= 1"));
  {  // metric columns without hyper-parameters (neither the logger's nor the Trainer's): refused when the fit starts
    vt::RegressorImpl m;
    auto t = volt::make_trainer({.max_epochs = 1, .default_root_dir = (dir / "no_hparams").string()},
                                volt::TensorBoardLogger({.hparam_metrics = {"val_loss"}}));
    CHECK_THROWS_WITH(t.fit(m, loader), Contains("without hparams"));
  }
}

namespace {
/// Every call of a logger's own hooks, in order, with the hyper-parameters it was given.
struct HookLog {
  static constexpr bool is_logger = true;
  std::vector<std::string> calls;
  std::vector<volt::Json> params;
  void log_hyperparams(const volt::Json& p) {
    calls.push_back("log_hyperparams");
    params.push_back(p);
  }
  void log_metrics(const std::map<std::string, double>&, int64_t) { calls.push_back("log_metrics"); }
  void flush() { calls.push_back("flush"); }
  void finalize(volt::RunStatus s) { calls.push_back(std::string("finalize ") + volt::to_string(s)); }
};
/// A regressor whose training step fails (or raises SIGTERM) at one batch.
struct FailsAt : vt::RegressorImpl {
  int64_t at = -1;
  bool sigterm = false;
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    if (ctx.batch_idx() == at && sigterm) std::raise(SIGTERM);
    if (ctx.batch_idx() == at && !sigterm) throw std::runtime_error("batch 1 fails");
    return vt::RegressorImpl::training_step(b, ctx);
  }
};
}  // namespace

TEST_CASE("a logger hears each run's hyper-parameters first, every logging event, and how the run ended last",
          "[callbacks]") {
  const auto dir = vt::scratch("logger_hooks");
  auto [x, y] = vt::regression_data(32);
  auto loader = make_loader(x, y, 8);
  const volt::Json given = volt::Json::parse(R"({"run": {"lr": 0.1, "name": "a"}})");
  auto trainer = [&](const std::string& name) {
    auto t = volt::make_trainer({.max_epochs = 2, .log_every_n_steps = 1, .default_root_dir = (dir / name).string(),
                                 .signals = {.exit_process = false}},
                                HookLog{}, volt::CSVLogger{});
    t.save_hyperparameters(given);
    return t;
  };
  const auto between = [](const std::vector<std::string>& calls, const std::string& what) {
    return std::count(calls.begin(), calls.end(), what);
  };
  SECTION("a fit, then a test: each a run of its own") {
    FailsAt m;
    auto t = trainer("ok");
    t.fit(m, loader);
    auto calls = t.callback<HookLog>().calls;
    REQUIRE(calls.size() >= 4);
    CHECK(calls.front() == "log_hyperparams");
    CHECK(t.callback<HookLog>().params.at(0) == given);
    CHECK(calls[calls.size() - 2] == "flush");
    CHECK(calls.back() == "finalize success");
    CHECK(between(calls, "finalize success") == 1);
    // As many logging events as rows the CSV logger beside it wrote (its header aside).
    std::ifstream csv(t.callback<volt::CSVLogger>().metrics_file());
    const auto rows = std::count(std::istreambuf_iterator<char>(csv), std::istreambuf_iterator<char>(), '\n') - 1;
    CHECK(between(calls, "log_metrics") == rows);
    CHECK(rows == 2 * 4);  // 4 batches an epoch, each logged (train_loss on the step only)
    t.test(m, loader);
    calls = t.callback<HookLog>().calls;
    CHECK(between(calls, "log_hyperparams") == 2);
    CHECK(between(calls, "finalize success") == 2);
    CHECK(calls.back() == "finalize success");
  }
  SECTION("a failing fit ends failed, after a last flush") {
    FailsAt m;
    m.at = 1;
    auto t = trainer("failed");
    CHECK_THROWS_WITH(t.fit(m, loader), Contains("batch 1 fails"));
    const auto& calls = t.callback<HookLog>().calls;
    REQUIRE(calls.size() >= 3);
    CHECK(calls[calls.size() - 2] == "flush");
    CHECK(calls.back() == "finalize failed");
    CHECK(between(calls, "finalize failed") == 1);
  }
  SECTION("a fit stopped by SIGTERM ends interrupted") {
    FailsAt m;
    m.at = 1;
    m.sigterm = true;
    auto t = trainer("stopped");
    CHECK_THROWS_AS(t.fit(m, loader), volt::Interrupted);
    CHECK(t.callback<HookLog>().calls.back() == "finalize interrupted");
  }
}

namespace {
/// Parameters counted by hand below: enc 4*8+8 + 8*8+8 = 112, head 8*3+3 = 27 (frozen, in eval mode), bn 8+8 = 16
/// (its running statistics are buffers, not parameters), scale 5 (on the model itself: in the totals, in no row).
struct Summarized : torch::nn::Module {
  torch::nn::Sequential enc{torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8)};
  torch::nn::Linear head{8, 3};
  torch::nn::BatchNorm1d bn{8};
  torch::Tensor scale;
  Summarized() {
    register_module("enc", enc);
    register_module("head", head);
    register_module("bn", bn);
    scale = register_parameter("scale", torch::ones({5}));
    for (auto& p : head->parameters()) p.requires_grad_(false);
    head->eval();
  }
};
}  // namespace

TEST_CASE("ModelSummary counts parameters as a hand count does, and prints them as Lightning", "[callbacks][unit]") {
  Summarized m;
  const auto s = volt::summarize(m);
  REQUIRE(s.rows.size() == 3);
  CHECK(s.rows[0].name == "enc");
  CHECK(s.rows[0].type == "Sequential");
  CHECK(s.rows[0].params == 4 * 8 + 8 + 8 * 8 + 8);
  CHECK(s.rows[1].name == "head");
  CHECK(s.rows[1].type == "Linear");
  CHECK(s.rows[1].params == 8 * 3 + 3);
  CHECK_FALSE(s.rows[1].training);
  CHECK(s.rows[2].type == "BatchNorm1d");
  CHECK(s.rows[2].params == 8 + 8);
  CHECK(s.trainable_params == 112 + 16 + 5);
  CHECK(s.non_trainable_params == 27);
  CHECK(s.total_params() == 160);
  int64_t hand = 0;  // and the whole model's numel(), summed by hand
  for (const auto& p : m.parameters()) hand += p.numel();
  CHECK(s.total_params() == hand);
  CHECK(s.total_size_mb == Approx(160 * 4 / 1e6));
  CHECK(s.modules_in_train_mode == 6);  // the model, enc and its 3 layers, bn
  CHECK(s.modules_in_eval_mode == 1);   // head

  const auto deep = volt::summarize(m, 2);
  REQUIRE(deep.rows.size() == 6);
  CHECK(deep.rows[1].name == "enc.0");
  CHECK(deep.rows[1].params == 4 * 8 + 8);
  CHECK(deep.rows[2].type == "ReLU");
  CHECK(deep.rows[2].params == 0);
  CHECK(volt::summarize(m, 0).rows.empty());
  CHECK_THROWS_WITH(volt::summarize(m, -2), Contains("max_depth=-2"));

  // Lightning's own examples of get_human_readable_count.
  CHECK(volt::human_readable_count(123) == "123");
  CHECK(volt::human_readable_count(1234) == "1.2 K");
  CHECK(volt::human_readable_count(2000000) == "2.0 M");
  CHECK(volt::human_readable_count(3000000000) == "3.0 B");
  CHECK(volt::human_readable_count(400000000000000) == "400 T");
  CHECK(volt::human_readable_count(5000000000000000) == "5,000 T");
  CHECK(volt::human_readable_count(0) == "0");

  const std::string text = s.to_string();
  CHECK_THAT(text, Contains("0 | enc  | Sequential  | 112    | train"));
  CHECK_THAT(text, Contains("1 | head | Linear      | 27     | eval"));
  CHECK_THAT(text, Contains("133       Trainable params"));
  CHECK_THAT(text, Contains("27        Non-trainable params"));
  CHECK_THAT(text, Contains("160       Total params"));
  CHECK_THAT(text, Contains("0.001     Total estimated model params size (MB)"));

  SECTION("the callback prints it when a fit starts, on rank zero") {
    std::ostringstream out;
    vt::RegressorImpl r;
    auto [x, y] = vt::regression_data(16);
    auto loader = make_loader(x, y, 8);
    auto t = volt::make_trainer({.max_epochs = 1}, volt::ModelSummary({}, &out));
    t.fit(r, loader);
    CHECK_THAT(out.str(), Contains("0 | lin  | Linear | 5      | train") && Contains("5         Total params"));
    CHECK(t.callback<volt::ModelSummary>().summary().total_params() == 5);
  }
}

namespace {
/// Training steps of about 20 ms, validation steps of 50 ms: a throughput that counted validation would be far off
/// (a validation is 100 ms inside a 60 ms window), and a few milliseconds of another process's time between the two
/// clocks' readings stay within the 5% the checks allow.
struct Timed : vt::RegressorImpl {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return vt::RegressorImpl::training_step(b, ctx);
  }
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    vt::RegressorImpl::validation_step(b, ctx);
  }
};

/// The test's own clock: when each training batch ended (just before ThroughputMonitor reads its clock), its size,
/// when validations ran (not the sanity check), and what loggers received.
struct Stopwatch {
  using Clock = std::chrono::steady_clock;
  std::vector<std::pair<double, int64_t>> batch_ends;  // seconds since the start, samples
  std::vector<std::pair<double, double>> validations;
  std::vector<std::pair<int64_t, std::map<std::string, double>>> logged;
  Clock::time_point start;
  double now() const { return std::chrono::duration<double>(Clock::now() - start).count(); }
  void on_train_start(auto&, auto&) { start = Clock::now(); }
  void on_train_batch_end(auto&, auto&, const auto&, const torch::data::Example<>& b, int64_t) {
    batch_ends.emplace_back(now(), b.data.size(0));
  }
  void on_validation_start(auto& t, auto&) {
    if (!t.sanity_checking()) validations.emplace_back(now(), 0.0);
  }
  void on_validation_end(auto& t, auto&) {
    if (!t.sanity_checking()) validations.back().second = now();
  }
  void log_metrics(const std::map<std::string, double>& metrics, int64_t step) {
    if (metrics.count("train/batches")) logged.emplace_back(step, metrics);
  }
  /// Seconds of training between two batch ends: the wall time less the validations in between.
  double training_time(double from, double to) const {
    double t = to - from;
    for (const auto& [a, b] : validations) {
      if (a >= from && b <= to) t -= b - a;
    }
    return t;
  }
};
}  // namespace

TEST_CASE("ThroughputMonitor's rates equal the batch sizes over the training time the test measures", "[callbacks]") {
  Timed m;
  auto [x, y] = vt::regression_data(50);
  auto loader = make_loader(x, y, 8);  // 7 batches: six of 8 samples, one of 2
  constexpr int64_t window = 4;
  constexpr double flops = 1e6;
  auto t = volt::make_trainer({.max_epochs = 3, .log_every_n_steps = 3}, Stopwatch{},
                              volt::ThroughputMonitor({.flops_per_batch = flops, .window_size = window}));
  t.fit(m, loader, make_loader(x, y, 25));
  const auto& sw = t.callback<Stopwatch>();
  REQUIRE(sw.batch_ends.size() == 21);
  REQUIRE(sw.validations.size() == 3);
  REQUIRE(sw.logged.size() == 7);  // steps 3, 6, ..., 21
  int straddling = 0;
  for (const auto& [step, values] : sw.logged) {
    const auto n = static_cast<std::size_t>(step + 1);  // batches so far (logged at global_step - 1)
    INFO("batch " << n);
    int64_t samples = 0;
    for (std::size_t i = 0; i < n; ++i) samples += sw.batch_ends[i].second;
    CHECK(values.at("train/batches") == static_cast<double>(n));
    CHECK(values.at("train/samples") == static_cast<double>(samples));
    const std::size_t first = n - std::min<std::size_t>(window, n);  // the window: the last 4 batch ends
    int64_t window_samples = 0;
    for (std::size_t i = first + 1; i < n; ++i) window_samples += sw.batch_ends[i].second;
    const double seconds = sw.training_time(sw.batch_ends[first].first, sw.batch_ends[n - 1].first);
    if (seconds < sw.batch_ends[n - 1].first - sw.batch_ends[first].first) ++straddling;
    CHECK(values.at("train/device/samples_per_sec") == Approx(window_samples / seconds).epsilon(0.05));
    CHECK(values.at("train/device/batches_per_sec") == Approx(static_cast<double>(n - 1 - first) / seconds).epsilon(0.05));
    CHECK(values.at("train/samples_per_sec") == values.at("train/device/samples_per_sec"));  // world size 1
    CHECK(values.at("train/device/flops_per_sec") == Approx(values.at("train/device/batches_per_sec") * flops));
    CHECK(values.at("train/time") == Approx(sw.training_time(0.0, sw.batch_ends[n - 1].first)).epsilon(0.05));
  }
  CHECK(straddling >= 2);  // windows with a validation inside them were checked
  CHECK_THROWS_WITH(volt::ThroughputMonitor({.window_size = 1}), Contains("window_size=1") && Contains(">= 2"));
}

namespace {
/// What loggers get from DeviceStatsMonitor, and the same quantities read independently right after.
struct Reader {
  std::vector<std::map<std::string, double>> logged;
  std::vector<double> rss_mb, cpu_s;
  void log_metrics(const std::map<std::string, double>& metrics, int64_t) {
    if (!metrics.count("device_stats/cpu_rss_mb")) return;
    logged.push_back(metrics);
    // Read independently right after: resident pages from /proc/self/statm, CPU time from std::clock.
    long long pages = 0, resident = 0;
    std::ifstream("/proc/self/statm") >> pages >> resident;
    rss_mb.push_back(static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1e6);
    cpu_s.push_back(static_cast<double>(std::clock()) / CLOCKS_PER_SEC);
  }
};
}  // namespace

TEST_CASE("DeviceStatsMonitor records the process's memory and CPU time at each logging step", "[callbacks]") {
  vt::RegressorImpl m;
  auto [x, y] = vt::regression_data(64);
  auto loader = make_loader(x, y, 8);
  auto t = volt::make_trainer({.max_epochs = 2, .log_every_n_steps = 4}, volt::DeviceStatsMonitor{}, Reader{});
  t.fit(m, loader);
  const auto& r = t.callback<Reader>();
  REQUIRE(r.logged.size() == 4);  // 16 steps / 4
  for (std::size_t i = 0; i < r.logged.size(); ++i) {
    const auto& v = r.logged[i];
    CHECK(v.at("device_stats/cpu_rss_mb") == Approx(r.rss_mb[i]).margin(8.0));
    CHECK(v.at("device_stats/cpu_peak_rss_mb") >= v.at("device_stats/cpu_rss_mb") - 0.01);
    const double cpu = v.at("device_stats/cpu_user_time_s") + v.at("device_stats/cpu_system_time_s");
    CHECK(cpu <= r.cpu_s[i] + 0.02);
    CHECK(cpu == Approx(r.cpu_s[i]).margin(0.05));
    CHECK_FALSE(v.count("device_stats/allocated_bytes.all.current_mb"));  // no CUDA device here
  }
}

namespace {
/// A regressor that declares hyper-parameters of its own, as a Lightning module's save_hyperparameters keeps its
/// arguments.
struct WithHyperParameters : vt::RegressorImpl {
  volt::Json hyper_parameters() const { return volt::Json::parse(R"({"lr": 0.05, "hidden": [4, 1], "note": null})"); }
};
struct RunSection {
  double lr = 0.05;
  std::string name = "first run";
  std::vector<int64_t> milestones{2, 3};
};
constexpr auto volt_fields(const RunSection*) {
  return volt::fields({{"lr", "SGD's rate"}, {"name", "the run's name"}, {"milestones", "epochs where it drops"}});
}
}  // namespace

// Run by the ctest `hparams.python` (test/processes.cmake), which then reads the checkpoints with Python's torch
// (weights_only) and the loggers' files with PyYAML and tensorboard (test/hparams_check.py).
TEST_CASE("a fit keeps its configuration and the module's hyper-parameters in checkpoints and beside the logs",
          "[.hparams_export]") {
  const auto dir = env_dir("VOLT_HPARAMS_DIR");
  fs::remove_all(dir);
  fs::create_directories(dir);
  volt::TrainerOptions options{.max_epochs = 2, .log_every_n_steps = 1, .default_root_dir = dir.string()};
  RunSection run;
  volt::Config config("hparams");
  config.add("trainer", options).add("run", run);
  const char* argv[] = {"hparams", "--trainer.max_epochs=3", "--run.lr=0.125", "--run.milestones=1, 2",
                        "--trainer.gradient_clip_val=1e-05", "--print_config"};
  std::ostringstream printed;  // the configuration that runs, as --print_config prints it
  REQUIRE_FALSE(config.parse(6, argv, printed));
  std::ofstream(dir / "printed_config.json") << printed.str();
  std::ofstream(dir / "module_hparams.json") << R"({"lr": 0.05, "hidden": [4, 1], "note": null})";

  WithHyperParameters m;
  auto [x, y] = vt::regression_data(32);
  auto train = make_loader(x, y, 8), val = make_loader(x, y, 16);
  auto t = volt::make_trainer(options, volt::ModelCheckpoint({.dirpath = (dir / "checkpoints").string(),
                                                              .save_last = true}),
                              volt::CSVLogger{}, volt::TensorBoardLogger{});
  CHECK_THROWS_WITH(t.save_hyperparameters(volt::Json::array({1, 2})),
                    "volt: save_hyperparameters takes a JSON object of names and values (Config::json()); got [1,2] "
                    "(a list).");
  t.save_hyperparameters(config.json());
  t.fit(m, train, val);
  t.save_checkpoint((dir / "checkpoints" / "weights_only.ckpt").string(), /*weights_only=*/true);
  REQUIRE(fs::exists(t.callback<volt::CSVLogger>().log_dir() / "hparams.yaml"));

  // A name both in the module's and in what save_hyperparameters was given: refused when the run starts.
  struct Clashing : vt::RegressorImpl {
    volt::Json hyper_parameters() const { return volt::Json::parse(R"({"run": 1})"); }
  } clashing;
  auto t2 = volt::make_trainer({.max_epochs = 1, .default_root_dir = (dir / "clash").string()});
  t2.save_hyperparameters(config.json());
  CHECK_THROWS_WITH(t2.fit(clashing, train),
                    "volt: the hyper-parameter \"run\" is both in the module's hyper_parameters() and in what "
                    "save_hyperparameters was given; rename one of them.");
}
