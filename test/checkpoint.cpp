// Checkpoint files and exact resume within one process. (Loader positions: test/data.cpp; ModelCheckpoint:
// test/callbacks.cpp; the loss scaler's state: test/precision.cpp.)
// (Resuming in new processes, after SIGKILL, across rank counts and from Python: test/resume.cpp.)

#include "common.hpp"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <csignal>
#include <algorithm>

// ---- checkpoint files ----------------------------------------------------------------------------------

namespace {

/// Trains a regressor for one epoch and writes a full checkpoint of it to `path`.
void write_regressor_checkpoint(const fs::path& path, vt::Regressor& model) {
  auto [x, y] = vt::regression_data(32);
  volt::Trainer<> trainer({.max_epochs = 1});
  trainer.fit(model, volt::data::TensorLoader(x, y, {.batch_size = 8}));
  trainer.save_checkpoint(path.string());
}

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const fs::path& p, const std::vector<char>& b) {
  std::ofstream(p, std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
}

}  // namespace

TEST_CASE("checkpoint files: round trip, and clear errors for missing, empty, cut, corrupt and foreign files",
          "[checkpoint]") {
  const fs::path dir = scratch("files");
  const fs::path good = dir / "good.ckpt";
  vt::Regressor model;
  volt::Trainer<> t({.max_epochs = 1});
  auto [x, y] = vt::regression_data(8);
  t.fit(model, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{});
  {
    torch::NoGradGuard g;
    model->lin->weight.fill_(1234.5f);
  }
  t.save_checkpoint(good.string());

  const auto d = volt::checkpoint::read(good.string());
  CHECK(d.at("format").toStringRef() == "volt.checkpoint");
  CHECK(d.at("volt_version").toStringRef() == volt::version_string);
  CHECK(torch::equal(d.at("state_dict").toGenericDict().at("lin.weight").toTensor(), torch::full({1, 4}, 1234.5f)));
  CHECK(d.at("loops").toGenericDict().at("global_step").toInt() == 1);
  CHECK(fs::directory_iterator(dir) != fs::directory_iterator());
  for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename().string().find(".tmp.") == std::string::npos);

  const auto bytes = read_bytes(good);
  auto expect_error = [&](const fs::path& p, const std::string& what) {
    INFO(p);
    try {
      volt::checkpoint::read(p.string());
      FAIL("no error for " << p);
    } catch (const volt::CheckpointError& e) {
      CHECK_THAT(e.what(), Contains(p.string()) && Contains(what));
    }
  };
  expect_error(dir / "missing.ckpt", "no checkpoint at");
  write_bytes(dir / "empty.ckpt", {});
  expect_error(dir / "empty.ckpt", "is empty");
  write_bytes(dir / "cut.ckpt", std::vector<char>(bytes.begin(), bytes.begin() + bytes.size() / 2));
  expect_error(dir / "cut.ckpt", "cut short");
  write_bytes(dir / "cut_tail.ckpt", std::vector<char>(bytes.begin(), bytes.end() - 10));
  expect_error(dir / "cut_tail.ckpt", "cut short");
  write_bytes(dir / "garbage.ckpt", std::vector<char>(5000, 'x'));
  expect_error(dir / "garbage.ckpt", "not a torch.save archive");
  {  // one byte of a weight flipped: only the checksum can tell
    const float v = 1234.5f;
    const char* pat = reinterpret_cast<const char*>(&v);
    auto flipped = bytes;
    auto it = std::search(flipped.begin(), flipped.end(), pat, pat + sizeof v);
    REQUIRE(it != flipped.end());
    it[1] ^= 0x10;
    write_bytes(dir / "flipped.ckpt", flipped);
    expect_error(dir / "flipped.ckpt", "do not match its checksum");
  }
  {  // a torch.save file that is not ours
    c10::impl::GenericDict foreign(c10::StringType::get(), c10::AnyType::get());
    foreign.insert("state_dict", torch::ones({2}));
    auto b = torch::pickle_save(foreign);
    write_bytes(dir / "foreign.pt", b);
    expect_error(dir / "foreign.pt", "not a volt checkpoint");
    auto list = torch::pickle_save(c10::List<int64_t>({1, 2}));
    write_bytes(dir / "list.pt", list);
    expect_error(dir / "list.pt", "not a volt checkpoint");
  }
  {  // LibTorch's own module archive
    torch::save(model, (dir / "libtorch.pt").string());
    expect_error(dir / "libtorch.pt", "not a ");
  }

  SECTION("a failed resume changes nothing") {
    vt::Regressor fresh(0.05, 77);
    vt::Regressor before(0.05, 77);
    for (const char* name : {"cut.ckpt", "flipped.ckpt", "foreign.pt", "garbage.ckpt"}) {
      volt::Trainer<> again({.max_epochs = 2});
      CHECK_THROWS_AS(again.fit(fresh, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{},
                                (dir / name).string()),
                      volt::CheckpointError);
      CHECK(same_weights(*fresh, *before));
    }
  }
}

namespace {
struct WideImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  torch::nn::Linear extra{nullptr};
  WideImpl() {
    lin = register_module("lin", torch::nn::Linear(4, 2));
    extra = register_module("extra", torch::nn::Linear(2, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return vt::mse(extra(lin(b.data)), b.target);
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.1); }
};
TORCH_MODULE(Wide);
/// The Regressor with Adam instead of SGD.
struct AdamRegressorImpl : vt::RegressorImpl {
  torch::optim::Adam configure_optimizers() { return torch::optim::Adam(parameters()); }
};
TORCH_MODULE(AdamRegressor);
}  // namespace

TEST_CASE("every input the checkpoint fuzzer kept is refused with a CheckpointError", "[checkpoint][fuzz]") {
  // test/fuzz/regressions/bytes: files that once made the reader fault (scripts/fuzz.sh replays them under
  // libFuzzer too; here they also run in every lane, and under the sanitizer lane's AddressSanitizer).
  const fs::path kept = fs::path(__FILE__).parent_path() / "fuzz" / "regressions" / "bytes";
  REQUIRE(fs::is_directory(kept));
  int n = 0;
  for (const auto& e : fs::directory_iterator(kept)) {
    INFO(e.path());
    CHECK_THROWS_AS(volt::checkpoint::read(e.path().string()), volt::CheckpointError);
    ++n;
  }
  CHECK(n > 0);
}

TEST_CASE("resuming checks the module, the loader and the optimizer before loading anything", "[checkpoint]") {
  const fs::path dir = scratch("mismatch");
  vt::Regressor model;
  write_regressor_checkpoint(dir / "r.ckpt", model);
  auto [x, y] = vt::regression_data(32);
  const std::string path = (dir / "r.ckpt").string();

  Wide wide;
  auto wide_before = wide->lin->weight.clone();
  volt::Trainer<> t1({.max_epochs = 2});
  CHECK_THROWS_WITH(t1.fit(wide, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, path),
                    Contains(path) && Contains("missing extra.bias extra.weight") && Contains("lin.weight (file [1, 4], module [2, 4])") &&
                        Contains("nothing was loaded"));
  CHECK(torch::equal(wide->lin->weight, wide_before));

  vt::Regressor other(0.05, 5);
  vt::Regressor other_before(0.05, 5);
  volt::Trainer<> t2({.max_epochs = 2});
  CHECK_THROWS_WITH(t2.fit(other, volt::data::TensorLoader(x, y, {.batch_size = 6}), volt::NoLoader{}, path),
                    Contains("training loader cannot resume") && Contains("batch_size 8 in the state vs 6 here"));
  CHECK(same_weights(*other, *other_before));

  SECTION("a checkpoint of one optimizer cannot resume another, in either direction") {
    AdamRegressor adam;
    volt::Trainer<> t3({.max_epochs = 1});
    t3.fit(adam, volt::data::TensorLoader(x, y, {.batch_size = 8}));
    t3.save_checkpoint((dir / "adam.ckpt").string());
    vt::Regressor sgd;
    volt::Trainer<> t4({.max_epochs = 2});
    CHECK_THROWS_WITH(t4.fit(sgd, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{},
                             (dir / "adam.ckpt").string()),
                      StartsWith("volt: " + (dir / "adam.ckpt").string() + " holds the state of a torch::optim::Adam, "
                                 "and a checkpoint of torch::optim::Adam cannot resume torch::optim::SGD: return a "
                                 "torch::optim::Adam from configure_optimizers"));
    AdamRegressor adam2;
    const auto adam2_before = adam2->parameters()[0].clone();
    volt::Trainer<> t5({.max_epochs = 2});
    CHECK_THROWS_WITH(t5.fit(adam2, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, path),
                      Contains("a checkpoint of torch::optim::SGD cannot resume torch::optim::Adam"));
    CHECK(torch::equal(adam2->parameters()[0], adam2_before));  // nothing loaded
  }
  SECTION("weights-only checkpoints load into a module and cannot resume a fit") {
    volt::Trainer<> t3({.max_epochs = 1});
    vt::Regressor m(0.05, 3);
    t3.fit(m, volt::data::TensorLoader(x, y, {.batch_size = 8}));
    t3.save_checkpoint((dir / "w.ckpt").string(), /*weights_only=*/true);
    vt::Regressor n(0.05, 4);
    volt::load_weights(*n, (dir / "w.ckpt").string());
    CHECK(same_weights(*m, *n));
    volt::Trainer<> t4({.max_epochs = 2});
    CHECK_THROWS_WITH(t4.fit(n, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, (dir / "w.ckpt").string()),
                      Contains("weights only"));
    CHECK_THROWS_WITH(volt::Trainer<>().save_checkpoint((dir / "x.ckpt").string()), Contains("no fit has run in this process"));
  }
}

// ---- exact resume in one process ------------------------------------------------------------------------

namespace {
/// A small MLP with dropout (the generators matter), Adam and a step scheduler, logging epoch means.
struct MlpImpl : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::nn::Dropout drop{nullptr};
  explicit MlpImpl(uint64_t seed) {
    torch::manual_seed(seed);
    l1 = register_module("l1", torch::nn::Linear(4, 16));
    drop = register_module("drop", torch::nn::Dropout(0.2));
    l2 = register_module("l2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return l2(drop(torch::tanh(l1(x)))); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto loss = vt::mse(forward(b.data), b.target);
    ctx.log("train_loss", loss, {.on_step = true, .on_epoch = true});
    return loss;
  }
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("val_loss", vt::mse(forward(b.data), b.target));
  }
  volt::OptimizerConfig configure_optimizers() {
    auto opt = std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-2));
    return {opt, std::make_shared<torch::optim::StepLR>(*opt, 1, 0.7)};
  }
};
TORCH_MODULE(Mlp);

auto resume_trainer(const fs::path& base) {
  using volt::ModelCheckpoint;
  return volt::make_trainer(
      {.max_epochs = 3, .val_check_interval = 0.5, .num_sanity_val_steps = 1, .accumulate_grad_batches = 2},
      // after every optimizer step (mid-epoch; some before a pending validation)
      ModelCheckpoint({.dirpath = (base / "steps").string(), .filename = "{step}", .save_top_k = -1,
                       .every_n_train_steps = 1}),
      // after validation runs (mid-epoch and at epoch ends), the best two by val_loss and last.ckpt
      ModelCheckpoint({.dirpath = (base / "val").string(), .monitor = "val_loss", .save_top_k = 2, .save_last = true}),
      // from the epoch's end hooks
      ModelCheckpoint({.dirpath = (base / "epochs").string(), .filename = "end-{epoch}", .save_top_k = -1,
                       .every_n_epochs = 1, .save_on_train_epoch_end = true}));
}
}  // namespace

TEST_CASE("a fit resumed from any of its checkpoints ends bit-identical to the uninterrupted fit",
          "[checkpoint][resume]") {
  auto [x, y] = vt::regression_data(40);
  auto [vx, vy] = vt::regression_data(12, 3);
  auto train = [&] { return volt::data::TensorLoader(x, y, {.batch_size = 4, .shuffle = true, .seed = 5}); };
  auto val = [&] { return volt::data::TensorLoader(vx, vy, {.batch_size = 6}); };

  const fs::path a = scratch("exact_a");
  Mlp reference(1);
  auto t = resume_trainer(a);
  torch::manual_seed(123);
  t.fit(reference, train(), val());
  REQUIRE(t.global_step() == 15);
  const double final_lr = t.optimizer()->param_groups()[0].options().get_lr();
  const auto final_metrics = t.callback_metric_values();

  std::vector<fs::path> checkpoints;
  const fs::path kept = scratch("exact_kept");
  for (const char* sub : {"steps", "val", "epochs"}) {
    for (const auto& e : fs::directory_iterator(a / sub)) {
      const fs::path copy = kept / (std::string(sub) + "_" + e.path().filename().string());
      fs::copy_file(e.path(), copy);
      checkpoints.push_back(copy);
    }
  }
  REQUIRE(checkpoints.size() == 15 + 3 + 3);
  std::sort(checkpoints.begin(), checkpoints.end());
  int mid_epoch = 0, pending_val = 0, epoch_end = 0, mid_window = 0;
  for (const auto& ckpt : checkpoints) {
    INFO(ckpt);
    const auto loops = volt::checkpoint::read(ckpt.string()).at("loops").toGenericDict();
    mid_epoch += !loops.at("epoch_finished").toBool() && loops.at("batch_in_epoch").toInt() % 10 != 0;
    pending_val += loops.at("val_pending").toBool();
    epoch_end += loops.at("epoch_finished").toBool();
    mid_window += !volt::checkpoint::read(ckpt.string()).at("accumulated_grads").toListRef().empty();
    Mlp resumed(99);  // other initial weights: all must come from the checkpoint
    auto r = resume_trainer(scratch("exact_b"));
    torch::manual_seed(456);  // another generator state: it must come from the checkpoint too
    CaptureCerr err;
    r.fit(resumed, train(), val(), ckpt.string());
    // Rank zero says where it goes on. Known from the settings: 10 batches an epoch, a step every 2 batches, so
    // step=N was saved after batch 2((N-1) mod 5)+1 of epoch (N-1)/5, and end-E at the end of epoch E.
    const std::string name = ckpt.filename().string();
    if (name.rfind("steps_step=", 0) == 0) {
      const int n = std::stoi(name.substr(11));
      CHECK_THAT(err.str(), Contains("volt: resuming from " + ckpt.string() + ": epoch " + std::to_string((n - 1) / 5) +
                                     ", global step " + std::to_string(n) + ", after batch " +
                                     std::to_string(2 * ((n - 1) % 5) + 1) + " of the epoch"));
    } else if (name.rfind("epochs_end-epoch=", 0) == 0) {
      const int e = std::stoi(name.substr(17));
      CHECK_THAT(err.str(), Contains("volt: resuming from " + ckpt.string() + ": epoch " + std::to_string(e) +
                                     ", global step " + std::to_string(5 * (e + 1)) + ", at the end of the epoch."));
    }
    CHECK(r.global_step() == 15);
    CHECK(same_weights(*reference, *resumed));
    CHECK(r.optimizer()->param_groups()[0].options().get_lr() == final_lr);
    // Metrics come from what runs after the resume: the last epoch's end (sums restored), its validation.
    const bool fit_was_over = loops.at("epoch_finished").toBool() && loops.at("epoch").toInt() == 2;
    const bool validation_left = loops.at("global_step").toInt() < 15 || loops.at("val_pending").toBool();
    if (!fit_was_over) CHECK(r.callback_metric_values().at("train_loss_epoch") == final_metrics.at("train_loss_epoch"));
    if (validation_left) CHECK(r.callback_metric_values().at("val_loss") == final_metrics.at("val_loss"));
  }
  CHECK(mid_epoch > 5);
  CHECK(pending_val > 0);
  CHECK(epoch_end == 3);
  CHECK(mid_window > 0);  // saved after a validation between two micro-batches of one optimizer step
}

TEST_CASE("a loader without a position (a vector of batches) resumes by skipping what was trained on",
          "[checkpoint][resume]") {
  auto [x, y] = vt::regression_data(48);
  std::vector<torch::data::Example<>> batches;
  for (int64_t i = 0; i < 48; i += 8) batches.push_back({x.narrow(0, i, 8), y.narrow(0, i, 8)});
  const fs::path a = scratch("vector_a");
  auto make = [](const fs::path& dir) {
    return volt::make_trainer({.max_epochs = 2},
                              volt::ModelCheckpoint({.dirpath = dir.string(), .filename = "{step}", .save_top_k = -1,
                                                     .every_n_train_steps = 1}));
  };
  vt::Regressor reference;
  auto t = make(a);
  t.fit(reference, batches);
  REQUIRE(t.global_step() == 12);
  for (const int step : {3, 6, 8}) {
    vt::Regressor resumed(0.05, 42);
    auto r = make(scratch("vector_b"));
    r.fit(resumed, batches, volt::NoLoader{}, (a / ("step=" + std::to_string(step) + ".ckpt")).string());
    CHECK(r.global_step() == 12);
    CHECK(same_weights(*reference, *resumed));
  }
}

namespace {
/// Keeps a count of its own in checkpoints through the module hooks.
struct CountingImpl : vt::RegressorImpl {
  using vt::RegressorImpl::RegressorImpl;
  int64_t batches = 0;
  bool refuse = false;
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ++batches;
    return vt::RegressorImpl::training_step(b, ctx);
  }
  void on_save_checkpoint(volt::checkpoint::Dict& c) { c.insert("counting_batches", batches); }
  void on_load_checkpoint(const volt::checkpoint::Dict& c) {
    if (refuse) throw std::runtime_error("this module refuses the checkpoint");
    batches = c.at("counting_batches").toInt();
  }
};
TORCH_MODULE(Counting);
}  // namespace

TEST_CASE("modules keep state of their own in checkpoints through on_save/on_load_checkpoint", "[checkpoint]") {
  const fs::path dir = scratch("module_hooks");
  auto [x, y] = vt::regression_data(32);
  Counting a;
  volt::Trainer<> t({.max_epochs = 1});
  t.fit(a, volt::data::TensorLoader(x, y, {.batch_size = 8}));
  t.save_checkpoint((dir / "c.ckpt").string());
  CHECK(volt::checkpoint::read((dir / "c.ckpt").string()).at("counting_batches").toInt() == 4);
  Counting b;
  volt::Trainer<> t2({.max_epochs = 2});
  t2.fit(b, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, (dir / "c.ckpt").string());
  CHECK(b->batches == 8);  // 4 restored, 4 trained
  Counting c(0.05, 9), c_before(0.05, 9);
  c->refuse = true;
  volt::Trainer<> t3({.max_epochs = 2});
  CHECK_THROWS_WITH(t3.fit(c, volt::data::TensorLoader(x, y, {.batch_size = 8}), volt::NoLoader{}, (dir / "c.ckpt").string()),
                    Contains("refuses the checkpoint") && Contains("nothing was changed"));
  CHECK(same_weights(*c, *c_before));
}

// ---- stop signals ---------------------------------------------------------------------------------------

namespace {
/// Raises `signal` in this process from inside its training step at optimizer step `at` (-1: never).
struct SignalledImpl : vt::RegressorImpl {
  int64_t at = -1;
  int signal = SIGTERM;
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    if (ctx.global_step() == at && ctx.stage() == volt::Stage::train) {
      ::raise(signal);
      at = -1;
    }
    return vt::RegressorImpl::training_step(b, ctx);
  }
};
TORCH_MODULE(Signalled);

/// The installed handler of `sig`.
void (*handler_of(int sig))(int) {
  struct sigaction now {};
  ::sigaction(sig, nullptr, &now);
  return now.sa_handler;
}
/// Records whether SIGTERM is ignored during a training batch.
struct HandlerProbe {
  bool* seen;
  template <class T, class M, class B>
  void on_train_batch_end(T&, M&, const torch::Tensor&, const B&, int64_t) {
    *seen = handler_of(SIGTERM) == SIG_IGN;
  }
};
}  // namespace

TEST_CASE("a stop signal in a fit: a full checkpoint where \"last\" finds it, every row logged, an exact resume",
          "[checkpoint][signals]") {
  // A signal raised inside the training step of step k stops the fit at that batch's end. Reference: the same fit
  // without a signal. (Other processes, mpirun, one rank and Spawn: test/resume.cpp's `signal` modes.)
  auto [x, y] = vt::regression_data(64);
  const volt::SignalOptions no_exit{.exit_process = false};
  const int sig = GENERATE(SIGTERM, SIGINT, SIGUSR1);
  const fs::path base = scratch("signal_" + std::to_string(sig));
  auto trainer_in = [&](const fs::path& dir) {
    return volt::make_trainer({.max_epochs = 3, .val_check_interval = 0.5, .log_every_n_steps = 1,
                               .default_root_dir = dir.string(), .signals = no_exit},
                              volt::ModelCheckpoint(), volt::CSVLogger({.name = "logs"}));
  };
  auto loader = [&] { return make_loader(x, y, 8, /*shuffle=*/true, 5); };  // 8 steps an epoch
  // (validation in a fixed order: a shuffled one sums its mean in another order after the resume)
  auto val = [&] { return make_loader(x, y, 8); };

  Signalled ref;
  auto tr = trainer_in(base / "ref");
  tr.fit(ref, loader(), val());
  REQUIRE(tr.global_step() == 24);

  void (*before)(int) = handler_of(sig);
  Signalled run;
  run->at = 10;  // epoch 1's third batch, between its validations
  run->signal = sig;
  auto t1 = trainer_in(base / "run");
  try {
    t1.fit(run, loader(), val());
    FAIL("fit returned although " << volt::cluster::signal_name(sig) << " was raised");
  } catch (const volt::Interrupted& stop) {
    CHECK(stop.signal() == sig);
    CHECK(stop.exit_status() == 128 + sig);
    CHECK(stop.checkpoint() == (base / "run" / "checkpoints" / "interrupted.ckpt").string());
  }
  CHECK(handler_of(sig) == before);  // the fit's handlers are gone with it
  const auto saved = volt::checkpoint::read((base / "run" / "checkpoints" / "interrupted.ckpt").string());
  CHECK(saved.at("loops").toGenericDict().at("global_step").toInt() == 11);  // the signalled batch ran to its end
  // every row of the stopped part is in the file already: the reference's rows up to its last step (step 10)
  const auto ref_rows = vt::csv_rows((base / "ref" / "logs" / "version_0" / "metrics.csv").string());
  std::vector<std::map<std::string, std::string>> ref_first;
  for (const auto& r : ref_rows) {
    if (std::stoll(r.at("step")) <= 10) ref_first.push_back(r);
  }
  CHECK(ref_first.size() >= 10);
  CHECK(vt::csv_rows((base / "run" / "logs" / "version_0" / "metrics.csv").string()) == ref_first);

  Signalled again;
  auto t2 = trainer_in(base / "run");
  t2.fit(again, loader(), val(), "last");
  CHECK(t2.ckpt_path() == (base / "run" / "checkpoints" / "interrupted.ckpt").string());
  CHECK(t2.global_step() == 24);
  CHECK(same_weights(*again, *ref));
  auto rows = vt::csv_rows((base / "run" / "logs" / "version_0" / "metrics.csv").string());
  for (auto& r : vt::csv_rows((base / "run" / "logs" / "version_1" / "metrics.csv").string())) rows.push_back(r);
  std::sort(rows.begin(), rows.end());
  CHECK(rows == ref_rows);
}

TEST_CASE("stop signals: options checked up front; disabled, the process keeps its own handlers", "[checkpoint][signals]") {
  CHECK_THROWS_WITH(volt::Trainer<>({.signals = {.requeue_signal = SIGKILL}}),
                    Contains("signals.requeue_signal=9") && Contains("SIGUSR1"));
  CHECK_THROWS_WITH(volt::Trainer<>({.signals = {.requeue_signal = SIGTERM}}), Contains("other than SIGTERM"));
  auto [x, y] = vt::regression_data(16);
  bool seen = false;
  auto* old = std::signal(SIGTERM, SIG_IGN);
  vt::Regressor m;
  volt::make_trainer({.max_epochs = 1, .signals = {.enabled = false}}, HandlerProbe{&seen}).fit(m, make_loader(x, y, 8));
  std::signal(SIGTERM, old);
  CHECK(seen);  // SIGTERM kept the program's own disposition while the fit ran
}
