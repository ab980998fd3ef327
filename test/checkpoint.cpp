// Stateful loaders, checkpoint files, ModelCheckpoint and exact resume within one process.
// (Resuming in new processes, after SIGKILL, across rank counts and from Python: test/resume.cpp.)

#include "common.hpp"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

/// A fresh, empty folder under the system's temporary folder.
fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("volt_ckpt_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

/// The sample indices (targets) of up to `batches` batches (-1: to the end) of a pass of `loader`.
template <class L>
std::vector<int64_t> take(L& loader, int64_t batches = -1) {
  std::vector<int64_t> out;
  for (auto it = loader.begin(); it != loader.end() && batches != 0; ++it, --batches) {
    auto b = *it;
    const torch::Tensor t = b.target.flatten();
    for (int64_t i = 0; i < t.size(0); ++i) out.push_back(t[i].template item<int64_t>());
  }
  return out;
}

std::vector<int64_t> cat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

volt::data::TensorLoader index_loader(int64_t n, volt::data::LoaderOptions o) {
  return volt::data::TensorLoader(torch::arange(n, torch::kFloat32).unsqueeze(1), torch::arange(n), o);
}

auto index_dataset_loader(int64_t n, volt::data::LoaderOptions o) {
  return volt::data::DatasetLoader(vt::IndexDataset(n).map(torch::data::transforms::Stack<>()), o);
}

bool same_weights(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (const auto& p : pa) {
    if (!torch::equal(p.value(), pb[p.key()])) return false;
  }
  auto ba = a.named_buffers(), bb = b.named_buffers();
  for (const auto& p : ba) {
    if (!torch::equal(p.value(), bb[p.key()])) return false;
  }
  return true;
}

}  // namespace

// ---- loaders ------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("a loader interrupted after 0, 1 and k batches resumes with the rest of the epoch",
                   "[checkpoint][data]", volt::data::TensorLoader, decltype(index_dataset_loader(1, {}))) {
  auto make = [](int64_t n, volt::data::LoaderOptions o) {
    if constexpr (std::is_same_v<TestType, volt::data::TensorLoader>) {
      return index_loader(n, o);
    } else {
      return index_dataset_loader(n, o);
    }
  };
  for (const bool shuffle : {false, true}) {
    for (const bool drop_last : {false, true}) {
      const volt::data::LoaderOptions o{.batch_size = 3, .shuffle = shuffle, .drop_last = drop_last, .seed = 11};
      for (const int64_t epoch : {0, 2}) {
        auto whole = make(10, o);
        whole.set_epoch(epoch);
        const auto full = take(whole);
        for (int64_t k = 0; k < whole.size(); ++k) {
          INFO("shuffle " << shuffle << " drop_last " << drop_last << " epoch " << epoch << " k " << k);
          auto first = make(10, o);
          first.set_epoch(epoch);
          const auto head = take(first, k);
          const volt::data::LoaderState state = first.state_dict();
          CHECK(state.epoch == epoch);
          CHECK(state.consumed == 3 * k);
          auto second = make(10, o);  // a new loader, as in a new process
          second.load_state_dict(state);
          CHECK(second.batches_done() == k);
          CHECK(cat(head, take(second)) == full);
        }
        // taken after the last batch: the next epoch
        auto done = make(10, o);
        done.set_epoch(epoch);
        take(done);
        const auto end_state = done.state_dict();
        CHECK(end_state.consumed == 10);
        auto next = make(10, o);
        next.load_state_dict(end_state);
        auto reference = make(10, o);
        reference.set_epoch(epoch + 1);
        CHECK(take(next) == take(reference));
        CHECK(next.epoch() == epoch + 1);
      }
    }
  }
}

TEST_CASE("a multi-epoch run resumed mid-epoch continues its per-epoch permutations", "[checkpoint][data]") {
  const volt::data::LoaderOptions o{.batch_size = 4, .shuffle = true, .seed = 3};
  auto ref = index_loader(22, o);
  std::vector<int64_t> expected;
  for (int64_t e = 0; e < 3; ++e) {
    ref.set_epoch(e);
    expected = cat(expected, take(ref));
  }
  // The Trainer's calls: set_epoch before each epoch, a state mid-epoch 1, a new loader, the same calls.
  auto a = index_loader(22, o);
  a.set_epoch(0);
  auto seen = take(a);
  a.set_epoch(1);
  seen = cat(seen, take(a, 2));
  const auto state = a.state_dict();
  auto b = index_loader(22, o);
  b.load_state_dict(state);
  b.set_epoch(1);  // the loaded epoch: the position stays
  seen = cat(seen, take(b));
  b.set_epoch(2);
  seen = cat(seen, take(b));
  CHECK(seen == expected);
  // Iterating a const loader reads the same batches and records nothing.
  auto c = index_loader(22, o);
  c.load_state_dict(state);
  const auto& cc = c;
  std::vector<int64_t> peek;
  for (const auto& batch : cc) peek.push_back(batch.target[0].item<int64_t>());
  CHECK(c.state_dict() == state);
  CHECK(peek.size() == static_cast<std::size_t>(c.size() - 2));
}

TEST_CASE("a loader state that does not fit is refused, naming each difference", "[checkpoint][data]") {
  auto a = index_loader(10, {.batch_size = 3, .shuffle = true, .seed = 11});
  a.set_epoch(1);
  take(a, 2);
  const auto state = a.state_dict();
  auto other_size = index_loader(12, {.batch_size = 3, .shuffle = true, .seed = 11});
  CHECK_THROWS_WITH(other_size.load_state_dict(state), Contains("dataset size 10 in the state vs 12 here"));
  auto other_batch = index_loader(10, {.batch_size = 4, .shuffle = true, .seed = 11});
  CHECK_THROWS_WITH(other_batch.load_state_dict(state), Contains("batch_size 3 in the state vs 4 here"));
  auto other_seed = index_loader(10, {.batch_size = 3, .shuffle = true, .seed = 12});
  CHECK_THROWS_WITH(other_seed.load_state_dict(state), Contains("seed 11 in the state vs 12 here"));
  auto all = index_loader(9, {.batch_size = 2, .shuffle = false, .seed = 1});
  CHECK_THROWS_WITH(all.load_state_dict(state), Contains("dataset size") && Contains("batch_size") &&
                                                    Contains("seed") && Contains("shuffle"));
  // a refused state changes nothing
  all.set_epoch(0);
  CHECK(take(all) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8});
  auto bad = state;
  bad.consumed = 11;
  CHECK_THROWS_WITH(index_loader(10, {.batch_size = 3, .shuffle = true, .seed = 11}).load_state_dict(bad),
                    Contains("consumed=11"));
}

TEST_CASE("a state saved on N ranks resumes on M ranks: every remaining sample once", "[checkpoint][data]") {
  const volt::data::LoaderOptions o{.batch_size = 2, .shuffle = true, .seed = 9};
  for (const auto& [n, saved_on, resumed_on, k] : std::vector<std::tuple<int64_t, int, int, int64_t>>{
           {24, 2, 1, 3}, {24, 2, 3, 3}, {24, 1, 2, 5}, {24, 4, 2, 1}, {30, 3, 2, 2}}) {
    INFO("n " << n << " saved on " << saved_on << " resumed on " << resumed_on << " after " << k << " batches");
    auto whole = index_loader(n, o);
    whole.set_epoch(1);
    std::multiset<int64_t> seen;
    std::optional<volt::data::LoaderState> state;
    for (int r = 0; r < saved_on; ++r) {
      auto shard = whole.shard(r, saved_on);
      for (int64_t i : take(shard, k)) seen.insert(i);
      if (state) CHECK(shard.state_dict().consumed == state->consumed);  // every rank agrees
      state = shard.state_dict();
    }
    CHECK(state->consumed == k * o.batch_size * saved_on);
    for (int r = 0; r < resumed_on; ++r) {
      auto shard = index_loader(n, o).shard(r, resumed_on);
      shard.load_state_dict(*state);
      for (int64_t i : take(shard)) seen.insert(i);
    }
    for (int64_t i = 0; i < n; ++i) CHECK(seen.count(i) == 1);
    CHECK(static_cast<int64_t>(seen.size()) == n);
  }
  SECTION("the same number of ranks reproduces every rank's batches, padding included") {
    const volt::data::LoaderOptions p{.batch_size = 4, .shuffle = true, .seed = 2};
    for (int r = 0; r < 2; ++r) {
      auto ref = index_loader(47, p).shard(r, 2);
      ref.set_epoch(3);
      const auto full = take(ref);
      auto first = index_loader(47, p).shard(r, 2);
      first.set_epoch(3);
      const auto head = take(first, 2);
      auto second = index_loader(47, p).shard(r, 2);
      second.load_state_dict(first.state_dict());
      CHECK(cat(head, take(second)) == full);
    }
  }
}

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
}  // namespace

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
  b.load_state_dict(volt::checkpoint::to_map(back.at("precision").toGenericDict(), "s.ckpt"));
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
    r.fit(resumed, train(), val(), ckpt.string());
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
