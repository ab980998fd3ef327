// Checkpoint files and exact resume within one process. (Loader positions: test/data.cpp; ModelCheckpoint:
// test/callbacks.cpp; the loss scaler's state: test/precision.cpp.)
// (Resuming in new processes, after SIGKILL, across rank counts and from Python: test/resume.cpp.)

#include "common.hpp"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <csignal>
#include <unistd.h>
#include <algorithm>
#include <barrier>
#include <cstring>
#include <functional>
#include <thread>

// ---- checkpoint files ----------------------------------------------------------------------------------

namespace {

/// Trains a regressor for one epoch and writes a full checkpoint of it to `path`.
void write_regressor_checkpoint(const fs::path& path, vt::Regressor& model) {
  auto [x, y] = vt::regression_data(32);
  volt::Trainer<> trainer({.max_epochs = 1});
  trainer.fit(model, volt::data::TensorLoader(x, y, {.batch_size = 8}));
  trainer.save_checkpoint(path.string());
}

void write_bytes(const fs::path& p, const std::vector<char>& b) {
  std::ofstream(p, std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
}

/// Reading the checkpoint at `p` throws a CheckpointError that names it and says `what`.
void expect_error(const fs::path& p, const std::string& what) {
  INFO(p);
  try {
    volt::checkpoint::read(p.string());
    FAIL("no error for " << p);
  } catch (const volt::CheckpointError& e) {
    CHECK_THAT(e.what(), Contains(p.string()) && Contains(what));
  }
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

  const auto bytes = vt::read_bytes(good);
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

namespace {

/// A small net with a buffer, and AdamW over two groups of different learning rates stepped 3 times: a sharded
/// checkpoint of it (a world of one, through the format's own calls) and the full file of the same state.
struct ShardedCase {
  torch::nn::Sequential net{torch::nn::Linear(3, 5), torch::nn::BatchNorm1d(5), torch::nn::Linear(5, 2)};
  std::vector<std::vector<at::Tensor>> groups;
  std::unique_ptr<torch::optim::AdamW> adam;
  ShardedCase() {
    torch::manual_seed(3);
    const auto p = net->parameters();
    groups = {{p[0], p[1]}, {p[2], p[3], p[4], p[5]}};
    std::vector<torch::optim::OptimizerParamGroup> pg;
    pg.emplace_back(groups[0], std::make_unique<torch::optim::AdamWOptions>(0.01));
    pg.emplace_back(groups[1], std::make_unique<torch::optim::AdamWOptions>(0.003));
    adam = std::make_unique<torch::optim::AdamW>(std::move(pg));
    for (int i = 0; i < 3; ++i) {
      adam->zero_grad();
      net->forward(torch::randn({4, 3})).pow(2).mean().backward();
      adam->step();
    }
  }
  void save_full(const std::string& path) {
    auto d = volt::checkpoint::make_dict();
    d.insert("state_dict", volt::checkpoint::module_state(*net));
    c10::impl::GenericList o(c10::TensorType::get());
    o.push_back(volt::checkpoint::optimizer_state(*adam));
    d.insert("optimizer_states", o);
    volt::checkpoint::save(path, d);
  }
  void save_sharded(const std::string& path) {
    volt::checkpoint::ShardedSave s;
    const auto params = net->parameters();
    for (const auto& p : net->named_parameters()) {
      s.names.push_back(p.key());
      s.shapes.push_back(p.value().sizes().vec());
    }
    s.slices = volt::checkpoint::replicated_slices(params, 0, 1);
    s.optimizers.push_back({adam.get(), {{0, 1}, {2, 3, 4, 5}}});
    s.meta.insert("state_dict", volt::checkpoint::buffer_state(*net));
    c10::impl::GenericList o(c10::TensorType::get());
    o.push_back(volt::checkpoint::optimizer_skeleton(*adam, groups));
    s.meta.insert("optimizer_states", o);
    s.all_gather = [](const std::string& b) { return std::vector<std::string>{b}; };
    volt::checkpoint::save_sharded({path}, s);
  }
};

/// The AdamW state and the groups' learning rates an archive gives a fresh optimizer over a net's parameters.
std::pair<std::vector<at::Tensor>, std::vector<double>> adamw_of(const at::Tensor& archive) {
  ShardedCase fresh;  // its own state is replaced
  volt::checkpoint::load_optimizer_state(*fresh.adam, archive, "test");
  std::vector<at::Tensor> state;
  std::vector<double> lrs;
  for (const auto& g : fresh.adam->param_groups()) {
    lrs.push_back(g.options().get_lr());
    for (const auto& p : g.params()) {
      const auto* st = volt::detail::find_state(*fresh.adam, p);
      REQUIRE(st != nullptr);
      const auto& a = static_cast<const torch::optim::AdamWParamState&>(*st);
      state.push_back(torch::tensor({static_cast<double>(a.step())}));
      state.push_back(a.exp_avg().flatten().to(torch::kDouble));
      state.push_back(a.exp_avg_sq().flatten().to(torch::kDouble));
    }
  }
  return {state, lrs};
}

}  // namespace

TEST_CASE("sharded checkpoints: the full file's contents, a folder swapped in atomically, and clear errors for damaged "
          "folders", "[checkpoint]") {
  const fs::path dir = scratch("sharded");
  ShardedCase c;
  const std::string full = (dir / "full.ckpt").string(), sharded = (dir / "sharded.ckpt").string();
  c.save_full(full);
  std::ofstream(sharded) << "an older file at the same path";  // replaced by the folder in one step
  c.save_sharded(sharded);
  REQUIRE(volt::checkpoint::is_sharded(sharded));
  for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename().string().find(".tmp.") == std::string::npos);

  const auto a = volt::checkpoint::read(full), b = volt::checkpoint::read(sharded);
  const auto wa = a.at("state_dict").toGenericDict(), wb = b.at("state_dict").toGenericDict();
  CHECK(wa.size() == wb.size());
  for (const auto& e : wa) {
    INFO(e.key().toStringRef());
    REQUIRE(wb.contains(e.key()));
    CHECK(torch::equal(e.value().toTensor(), wb.at(e.key()).toTensor()));
  }
  const auto [sa, la] = adamw_of(a.at("optimizer_states").toListRef()[0].toTensor());
  const auto [sb, lb] = adamw_of(b.at("optimizer_states").toListRef()[0].toTensor());
  CHECK(la == std::vector<double>{0.01, 0.003});
  CHECK(lb == la);
  CHECK(torch::equal(torch::cat(sa), torch::cat(sb)));
  CHECK(torch::cat(sa)[0].item<double>() == 3);  // steps

  auto copy = [&](const std::string& name) {
    fs::remove_all(dir / name);
    fs::copy(sharded, dir / name);
    return dir / name;
  };
  const std::string rank_file = "rank-00000-of-00001.safetensors";
  {
    const fs::path p = copy("flipped.ckpt");
    auto bytes = vt::read_bytes(p / rank_file);
    bytes[bytes.size() - 3] ^= 0x10;  // a byte of the last tensor
    write_bytes(p / rank_file, bytes);
    expect_error(p, "has a damaged " + rank_file);
  }
  {
    const fs::path p = copy("missing.ckpt");
    fs::remove(p / rank_file);
    expect_error(p, "is missing " + rank_file);
  }
  auto rewrite_index = [&](const fs::path& p, const std::function<void(nlohmann::json&)>& change, bool sum) {
    std::ifstream in(p / "index.json");
    nlohmann::json index = nlohmann::json::parse(in);
    change(index);
    if (sum) {
      index.erase("checksum");
      index["checksum"] = volt::checkpoint::detail::crc(0, index.dump());
    }
    std::ofstream(p / "index.json") << index.dump(1);
  };
  {
    const fs::path p = copy("edited.ckpt");
    rewrite_index(p, [](nlohmann::json& i) { i["world_size"] = 2; }, false);
    expect_error(p, "does not match its checksum");
  }
  {  // a piece short: its tensor is not covered
    const fs::path p = copy("gap.ckpt");
    rewrite_index(p, [](nlohmann::json& i) { i["tensors"]["state_dict.0.weight"]["pieces"][0]["sizes"][0] = 14; }, true);
    expect_error(p, "holds 14 of the 15 elements of state_dict.0.weight");
  }
  fs::create_directories(dir / "plain_folder.ckpt");
  expect_error(dir / "plain_folder.ckpt", "is a folder and not a sharded checkpoint");

  c.save_full(sharded);  // a file again, in place of the folder, in one step
  CHECK(fs::is_regular_file(sharded));
  const auto again = volt::checkpoint::read(sharded).at("state_dict").toGenericDict();
  CHECK(torch::equal(again.at("0.weight").toTensor(), wa.at("0.weight").toTensor()));
}

namespace {

/// A job of `world` ranks in this process, one thread each: `body(rank, all_gather)`, where `all_gather` hands every
/// rank's bytes to every rank, as a strategy's `host_all_gather` does. A rank that throws leaves the job's barrier so
/// the others end too; the first exception is rethrown.
void run_ranks(int world, const std::function<void(int, std::function<std::vector<std::string>(const std::string&)>)>& body) {
  std::vector<std::string> slots(static_cast<std::size_t>(world));
  std::barrier sync(world);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      auto gather = [&](const std::string& bytes) {
        slots[static_cast<std::size_t>(r)] = bytes;
        sync.arrive_and_wait();
        std::vector<std::string> all = slots;
        sync.arrive_and_wait();
        return all;
      };
      try {
        body(r, gather);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        sync.arrive_and_drop();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

/// Box `b` of `whole`, by ATen's view and narrow: the reference the reader's copies are checked against.
at::Tensor box_of(const at::Tensor& whole, const volt::checkpoint::Box& b) {
  at::Tensor t = whole.reshape(b.view);
  for (std::size_t d = 0; d < b.view.size(); ++d) t = t.narrow(static_cast<int64_t>(d), b.offsets[d], b.sizes[d]);
  return t.contiguous();
}

using Layout = std::vector<volt::checkpoint::Box>;  // one box a rank

/// The cuts PyTorch's resharding tests make of a [4, 4] tensor, and two of volt's own: along dimension 0, along 1,
/// along both (4 ranks), flat ranges that do not divide it (as FSDP's buckets cut a parameter), and along dimension
/// 1 of its [2, 8] view (as a fused weight is cut).
std::map<std::string, Layout> cuts_of_4x4() {
  using volt::checkpoint::Box;
  return {{"rows", {Box{{4, 4}, {0, 0}, {2, 4}}, Box{{4, 4}, {2, 0}, {2, 4}}}},
          {"columns", {Box{{4, 4}, {0, 0}, {4, 2}}, Box{{4, 4}, {0, 2}, {4, 2}}}},
          {"both", {Box{{4, 4}, {0, 0}, {2, 2}}, Box{{4, 4}, {0, 2}, {2, 2}}, Box{{4, 4}, {2, 0}, {2, 2}},
                    Box{{4, 4}, {2, 2}, {2, 2}}}},
          {"flat", {Box::flat(16, 0, 6), Box::flat(16, 6, 6), Box::flat(16, 12, 4)}},
          {"view", {Box{{2, 8}, {0, 0}, {2, 4}}, Box{{2, 8}, {0, 4}, {2, 4}}}}};
}

/// The bytes a reader of box `want` must read from a folder written under `saved` (its files' header sizes in
/// `headers`): the index, then the header and the piece of every rank whose box shares an element with `want`
/// (found by ATen: the flat indices each box holds, intersected).
uint64_t bytes_to_read(const Layout& saved, const volt::checkpoint::Box& want, uint64_t index,
                       const std::vector<uint64_t>& headers) {
  const at::Tensor indices = torch::arange(16, torch::kLong).view({4, 4});
  const at::Tensor wanted = box_of(indices, want).flatten();
  uint64_t bytes = index;
  for (std::size_t r = 0; r < saved.size(); ++r) {
    const at::Tensor held = box_of(indices, saved[r]).flatten();
    if (torch::isin(held, wanted).any().item<bool>()) bytes += headers[r] + static_cast<uint64_t>(held.numel()) * 4;
  }
  return bytes;
}

}  // namespace

TEST_CASE("sharded checkpoints: n-dimensional pieces, each cut of a tensor read under every other, only the pieces "
          "a box overlaps read", "[checkpoint]") {
  using volt::checkpoint::Box;
  const fs::path dir = scratch("boxes");
  const at::Tensor whole = torch::arange(16, torch::kFloat).view({4, 4});
  const auto cuts = cuts_of_4x4();
  for (const auto& [saved_as, layout] : cuts) {
    const std::string path = (dir / (saved_as + ".ckpt")).string();
    run_ranks(static_cast<int>(layout.size()), [&](int rank, auto gather) {
      volt::checkpoint::ShardedSave s;
      s.names = {"w"};
      s.shapes = {{4, 4}};
      const Box& b = layout[static_cast<std::size_t>(rank)];
      const at::Tensor mine = box_of(whole, b).flatten();  // as a strategy hands it: any shape of the box's elements
      s.slices.push_back({0, b, mine, mine, 0});
      s.meta.insert("state_dict", volt::checkpoint::make_dict());
      s.rank = rank;
      s.world = static_cast<int>(layout.size());
      s.all_gather = gather;
      volt::checkpoint::save_sharded({path}, s);
    });
    INFO("saved cut along " << saved_as);
    CHECK(torch::equal(volt::checkpoint::read(path).at("state_dict").toGenericDict().at("w").toTensor(), whole));
    std::vector<uint64_t> headers;
    for (std::size_t r = 0; r < layout.size(); ++r) {
      const auto bytes = vt::read_bytes(fs::path(path) / volt::checkpoint::detail::rank_file_name(static_cast<int>(r),
                                                                                                static_cast<int>(layout.size())));
      uint64_t n = 0;
      std::memcpy(&n, bytes.data(), 8);
      headers.push_back(8 + n);
    }
    const uint64_t index = fs::file_size(fs::path(path) / "index.json");
    for (const auto& [read_as, wants] : cuts) {
      for (const Box& want : wants) {
        INFO("read as " << read_as << ", box at " << nlohmann::json(want.offsets).dump() << " of view "
                        << nlohmann::json(want.view).dump());
        volt::checkpoint::ShardedReader reader(path);
        const at::Tensor got = reader.read("state_dict.w", want);
        CHECK(got.sizes().vec() == want.sizes);
        CHECK(torch::equal(got, box_of(whole, want)));
        CHECK(reader.bytes_read() == bytes_to_read(layout, want, index, headers));
      }
    }
    volt::checkpoint::ShardedReader reader(path);
    CHECK_THROWS_WITH(reader.read("state_dict.w", Box{{4, 4}, {3, 0}, {2, 4}}),
                      Contains("gives state_dict.w (shape [4,4]) a box that is not inside it"));
    CHECK_THROWS_WITH(reader.read("state_dict.w", Box{{3, 5}, {0, 0}, {1, 1}}), Contains("a box that is not inside it"));
    CHECK_THROWS_WITH(reader.read("state_dict.v", Box::whole({4, 4})), Contains("holds no tensor state_dict.v"));
  }
  {  // a piece's bytes changed: the reader of a box over it refuses, the reader of a box elsewhere reads on
    const fs::path p = dir / "rows.ckpt";
    auto bytes = vt::read_bytes(p / "rank-00001-of-00002.safetensors");
    bytes[bytes.size() - 1] ^= 0x01;
    write_bytes(p / "rank-00001-of-00002.safetensors", bytes);
    CHECK(torch::equal(volt::checkpoint::ShardedReader(p.string()).read("state_dict.w", Box{{4, 4}, {0, 0}, {2, 4}}),
                       box_of(whole, Box{{4, 4}, {0, 0}, {2, 4}})));
    volt::checkpoint::ShardedReader reader(p.string());
    CHECK_THROWS_WITH(reader.read("state_dict.w", Box{{4, 4}, {1, 0}, {2, 4}}),
                      Contains("has a damaged rank-00001-of-00002.safetensors (the bytes of state_dict.w do not match"));
    expect_error(p, "has a damaged rank-00001-of-00002.safetensors");
  }
  // An index edited (its checksum stamped again) into what volt does not write is refused in a sentence, not a crash.
  const auto edited = [&](const std::string& name, const std::function<void(nlohmann::json&)>& change) {
    const fs::path p = dir / name;
    fs::remove_all(p);
    fs::copy(dir / "columns.ckpt", p);
    std::ifstream in(p / "index.json");
    nlohmann::json index = nlohmann::json::parse(in);
    in.close();
    change(index);
    index.erase("checksum");
    index["checksum"] = volt::checkpoint::detail::crc(0, index.dump());
    std::ofstream(p / "index.json") << index.dump(1);
    return p;
  };
  expect_error(edited("float.ckpt", [](nlohmann::json& i) { i["tensors"]["state_dict.w"]["pieces"][0]["sizes"][1] = 2.5; }),
               "gives state_dict.w [4,2.5] where a list of integers belongs");
  expect_error(edited("elsewhere.ckpt", [](nlohmann::json& i) { i["files"][0]["file"] = "../other.safetensors"; }),
               "lists rank file 0 as");
  expect_error(edited("no_crc.ckpt", [](nlohmann::json& i) { i["tensors"]["state_dict.w"]["pieces"][1].erase("crc32"); }),
               "gives a piece of state_dict.w no CRC-32");
}

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
                    Contains(path) && Contains("2 of the module's names missing (extra.bias, extra.weight)") && Contains("lin.weight (file [1, 4], module [2, 4])") &&
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

// volt's rule (docs/reference.md, a departure from Lightning, whose fit loop closes the epoch there): max_steps reached
// inside an epoch leaves it open, so a fit resumed from a save at the fit's end (ModelCheckpoint's last.ckpt) or after
// it (trainer.save_checkpoint) with a larger max_steps goes on with the epoch's next batch, as one uninterrupted fit.
// The epoch-interval StepLR would step at a closed epoch; the loader's shuffled order and dropout's generator must
// carry on too.
TEST_CASE("max_steps inside an epoch leaves it open: saved at the fit's end or after it, a fit resumed with a larger "
          "max_steps ends bit-identical to the uninterrupted fit", "[checkpoint][resume]") {
  auto [x, y] = vt::regression_data(40);  // 10 batches an epoch
  auto train = [&] { return volt::data::TensorLoader(x, y, {.batch_size = 4, .shuffle = true, .seed = 5}); };
  Mlp reference(1);
  torch::manual_seed(123);
  auto whole = volt::make_trainer({.max_steps = 27});
  whole.fit(reference, train());
  CHECK(whole.current_epoch() == 2);
  const double final_lr = whole.optimizer()->param_groups()[0].options().get_lr();
  // two epochs closed: StepLR stepped twice (LibTorch's count: its first step is step 0, docs/reference.md)
  REQUIRE(final_lr == Approx(1e-2 * 0.7));

  const fs::path dir = scratch("max_steps_open");
  Mlp first(1);
  torch::manual_seed(123);
  auto a = volt::make_trainer({.max_steps = 7}, volt::ModelCheckpoint({.dirpath = dir.string(), .save_last = true}));
  a.fit(first, train());
  CHECK(a.current_epoch() == 0);
  CHECK(a.optimizer()->param_groups()[0].options().get_lr() == 1e-2);  // StepLR not stepped: the epoch is open
  a.save_checkpoint((dir / "after.ckpt").string());
  for (const char* name : {"last.ckpt", "after.ckpt"}) {
    INFO(name);
    const auto saved = volt::checkpoint::read((dir / name).string());
    const auto loops = saved.at("loops").toGenericDict();
    CHECK(loops.at("epoch").toInt() == 0);
    CHECK(loops.at("batch_in_epoch").toInt() == 7);
    CHECK(!loops.at("epoch_finished").toBool());
    Mlp resumed(99);
    torch::manual_seed(456);
    auto r = volt::make_trainer({.max_steps = 27});
    r.fit(resumed, train(), volt::NoLoader{}, (dir / name).string());
    CHECK(r.global_step() == 27);
    CHECK(r.current_epoch() == 2);
    CHECK(r.optimizer()->param_groups()[0].options().get_lr() == final_lr);
    CHECK(same_weights(*reference, *resumed));
  }
  fs::remove_all(dir);
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

// fit(..., "last") as Lightning looks for it (among last*.ckpt; volt adds a stop signal's interrupted*.ckpt), by the step
// each file records, not by which was written last: a job killed while it wrote or deleted a checkpoint leaves a newest
// entry that may be torn, and the requeued job must resume by itself. The files are made by hand with known steps.
TEST_CASE("\"last\" takes the furthest last*.ckpt or interrupted*.ckpt that reads whole, other files only where none "
          "does; a save deletes what killed saves left", "[checkpoint]") {
  const fs::path dir = scratch("find_last");
  const auto put = [&](const std::string& name, int64_t step, int64_t batches) {
    auto loops = volt::checkpoint::make_dict();
    loops.insert("total_batch_idx", batches);
    auto d = volt::checkpoint::make_dict();
    d.insert("global_step", step);
    d.insert("loops", loops);
    volt::checkpoint::save((dir / name).string(), d);
  };
  put("epoch=3-step=90.ckpt", 90, 90);  // further than every last*: taken only where none of those reads
  put("last.ckpt", 60, 60);
  put("interrupted.ckpt", 60, 61);  // the same step, one batch further (a stop signal's, inside a window)
  put("last-v1.ckpt", 50, 50);
  put("last-v2.ckpt", 70, 70);  // torn below: written last, the newest file
  fs::resize_file(dir / "last-v2.ckpt", fs::file_size(dir / "last-v2.ckpt") / 2);
  fs::create_directories(dir / "last-v3.ckpt");  // a sharded folder a killed deletion left half gone
  std::ofstream(dir / "last-v3.ckpt" / "index.json") << "{\"format\": \"volt.sharded_checkpoint\"";
  volt::Trainer<> t;
  volt::ModelCheckpoint mc({.dirpath = dir.string()});
  const auto last = [&] { return mc.find_last_checkpoint(t); };
  {
    CaptureCerr err;
    CHECK(last() == (dir / "interrupted.ckpt").string());
    CHECK_THAT(err.str(), Contains("\"last\" passes over " + (dir / "last-v2.ckpt").string() + ", which does not read") &&
                              Contains("\"last\" passes over " + (dir / "last-v3.ckpt").string()));
  }
  CaptureCerr quiet;
  fs::remove(dir / "interrupted.ckpt");
  CHECK(last() == (dir / "last.ckpt").string());
  fs::remove(dir / "last.ckpt");
  CHECK(last() == (dir / "last-v1.ckpt").string());
  fs::remove(dir / "last-v1.ckpt");
  CHECK(last() == (dir / "epoch=3-step=90.ckpt").string());  // no last*.ckpt reads: the others
  fs::remove(dir / "epoch=3-step=90.ckpt");
  CHECK(last().empty());

  // What killed saves and deletions left (temporaries of processes that no longer run): gone after the next save;
  // this process's own would not be touched.
  const fs::path kept = dir / ("step=7.ckpt.tmp." + std::to_string(::getpid()));
  std::ofstream(dir / "last.ckpt.tmp.999999999") << "torn";
  fs::create_directories(dir / "step=2.ckpt.tmp.999999998");
  std::ofstream(dir / "step=2.ckpt.tmp.999999998" / "rank-00000-of-00002.safetensors") << "torn";
  std::ofstream(kept) << "mine";
  vt::Regressor model;
  auto [x, y] = vt::regression_data(8);
  auto saving = volt::make_trainer({.max_steps = 1}, volt::ModelCheckpoint({.dirpath = dir.string(), .save_last = true}));
  saving.fit(model, volt::data::TensorLoader(x, y, {.batch_size = 8}));
  CHECK(!fs::exists(dir / "last.ckpt.tmp.999999999"));
  CHECK(!fs::exists(dir / "step=2.ckpt.tmp.999999998"));
  CHECK(fs::exists(kept));
  CHECK(volt::checkpoint::read((dir / "last.ckpt").string()).at("global_step").toInt() == 1);
  fs::remove_all(dir);
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

// ---- asynchronous saves -----------------------------------------------------------------------------------

namespace {

/// A regressor with a 4 MiB weight: an asynchronous write of it takes long enough for training to go on meanwhile.
struct WideNetImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  WideNetImpl() { lin = register_module("lin", torch::nn::Linear(1024, 1024)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    return vt::mse(lin(b.data), b.target);
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.5)); }
};
TORCH_MODULE(WideNet);


}  // namespace

TEST_CASE("asynchronous saves: the state at the save point, the bytes of a synchronous save, errors at the next wait",
          "[checkpoint][async]") {
  const fs::path dir = scratch("async");
  torch::manual_seed(2);
  auto x = torch::randn({48, 1024}), y = torch::randn({48, 1024});
  std::map<int64_t, torch::Tensor> weights;
  WideNet net;
  auto trainer = volt::make_trainer(
      {.max_epochs = 2}, vt::WeightLog{&weights},
      volt::ModelCheckpoint({.dirpath = (dir / "steps").string(), .filename = "{step}", .save_top_k = -1,
                             .every_n_train_steps = 1, .async_save = true}));
  trainer.fit(net, make_loader(x, y, 8));
  REQUIRE(weights.size() == 12);
  // Every step's file is complete when fit returns, and holds that step's weights, not a later step's (the optimizer
  // changed the weight in place while the write went on).
  for (const auto& [step, w] : weights) {
    INFO("step " << step);
    const auto d = volt::checkpoint::read((dir / "steps" / ("step=" + std::to_string(step) + ".ckpt")).string());
    CHECK(d.at("loops").toGenericDict().at("global_step").toInt() == step);
    CHECK(torch::equal(d.at("state_dict").toGenericDict().at("lin.weight").toTensor(), w));
  }
  // The same state saved both ways (after the fit, so nothing moves): the same bytes.
  trainer.save_checkpoint((dir / "sync.ckpt").string());
  trainer.save_checkpoint(std::vector<std::string>{(dir / "async.ckpt").string(), (dir / "async2.ckpt").string()},
                          {.async_save = true});
  trainer.wait_for_checkpoint();
  CHECK(vt::read_bytes(dir / "sync.ckpt") == vt::read_bytes(dir / "async.ckpt"));
  CHECK(vt::read_bytes(dir / "sync.ckpt") == vt::read_bytes(dir / "async2.ckpt"));
  // A write that fails on the writer's thread is thrown by the next wait, naming the file; the training thread goes on.
  trainer.save_checkpoint(std::vector<std::string>{"/proc/volt-cannot/x.ckpt"}, {.async_save = true});
  CHECK_THROWS_WITH(trainer.wait_for_checkpoint(), Contains("/proc/volt-cannot") && Contains("folder"));
  trainer.wait_for_checkpoint();  // the error was taken: nothing is in flight
}

TEST_CASE("asynchronous saves: top k, last.ckpt, and a stop signal that waits for the save in flight",
          "[checkpoint][async]") {
  const fs::path dir = scratch("async_topk");
  auto [x, y] = vt::regression_data(64);
  Signalled run;
  run->at = 5;
  auto t = volt::make_trainer({.max_epochs = 3, .default_root_dir = dir.string(),
                               .signals = {.exit_process = false}},
                              volt::ModelCheckpoint({.save_top_k = 1, .save_last = true, .every_n_train_steps = 1,
                                                     .async_save = true}));
  CHECK_THROWS_AS(t.fit(run, make_loader(x, y, 8)), volt::Interrupted);
  // The save of step 6 (the signalled batch's) was in flight or done when the signal's checkpoint was written after
  // it: the folder holds last.ckpt and the latest step's file (its predecessor deleted once it was in place), and
  // interrupted.ckpt, all complete and of step 6.
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "checkpoints")) names.insert(e.path().filename().string());
  CHECK(names == std::set<std::string>{"epoch=0-step=6.ckpt", "interrupted.ckpt", "last.ckpt"});
  for (const auto& n : names) {
    INFO(n);
    CHECK(volt::checkpoint::read((dir / "checkpoints" / n).string()).at("loops").toGenericDict().at("global_step").toInt() == 6);
  }
}

// ---- weights that travel: safetensors, loading into part of a model, freezing ----------------------------

namespace {

/// A safetensors file's bytes from its header text and data, with the 8-byte little-endian length before them.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

/// A tensor of `dtype` whose values Python's check computes the same way: arange(6) as [2, 3], converted (bool:
/// odd elements; complex: arange plus -arange·i).
torch::Tensor pattern(torch::ScalarType dtype) {
  auto a = torch::arange(6, torch::kLong).reshape({2, 3});
  if (dtype == torch::kBool) return (a % 2).to(torch::kBool);
  if (dtype == torch::kComplexFloat) return torch::complex(a.to(torch::kFloat), -a.to(torch::kFloat));
  return a.to(dtype);
}

/// A backbone (linear, batch norm, ReLU) and a head; `Net(classes)` makes heads of other widths.
struct TunedNetImpl : torch::nn::Module {
  torch::nn::Sequential backbone{nullptr};
  torch::nn::Linear head{nullptr};
  explicit TunedNetImpl(int64_t classes = 3) {
    backbone = register_module("backbone", torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8),
                                                                 torch::nn::ReLU()));
    head = register_module("head", torch::nn::Linear(8, classes));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(backbone->forward(x)); }
};
TORCH_MODULE(TunedNet);

bool same_tensor(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         (a.numel() == 0 || std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                                        static_cast<std::size_t>(a.numel() * a.element_size())) == 0);
}

}  // namespace

TEST_CASE("safetensors: the bytes the format's rules give, by hand, and a round trip of every dtype", "[weights]") {
  const fs::path dir = scratch("safetensors_bytes");
  // Two tensors given in the "wrong" order: the format writes the widest dtype first (I64 before F32), then by name.
  volt::TensorFile f;
  f.tensors = {{"b", torch::tensor({1.0f, 2.0f})}, {"a", torch::tensor({int64_t{7}})}};
  f.metadata = {{"format", "pt"}};
  volt::safetensors::write((dir / "two.safetensors").string(), f);
  std::string header = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  header.resize((header.size() + 7) / 8 * 8, ' ');  // padded to a multiple of 8 with spaces
  std::string data(16, '\0');
  const int64_t seven = 7;
  const float one_two[2] = {1.0f, 2.0f};
  std::memcpy(data.data(), &seven, 8);
  std::memcpy(data.data() + 8, one_two, 8);
  const auto written = vt::read_bytes(dir / "two.safetensors");
  CHECK(std::string(written.begin(), written.end()) == safetensors_bytes(header, data));

  volt::TensorFile all;
  for (const auto& d : volt::safetensors::detail::dtypes()) all.tensors.emplace_back(d.name, pattern(d.type));
  all.tensors.emplace_back("scalar", torch::tensor(3.5, torch::kDouble).reshape({}));
  all.tensors.emplace_back("empty", torch::zeros({0, 4}, torch::kHalf));
  all.tensors.emplace_back("strided", torch::arange(12, torch::kFloat).reshape({3, 4}).t());  // not contiguous
  volt::safetensors::write((dir / "all.safetensors").string(), all);
  const volt::TensorFile back = volt::safetensors::read((dir / "all.safetensors").string());
  REQUIRE(back.tensors.size() == all.tensors.size());
  std::map<std::string, torch::Tensor> by_name(back.tensors.begin(), back.tensors.end());
  for (const auto& [name, t] : all.tensors) {
    INFO(name);
    REQUIRE(by_name.count(name));
    CHECK(same_tensor(by_name[name], t.contiguous()));
  }
  const auto bytes = vt::read_bytes(dir / "all.safetensors");
  const volt::TensorFile decoded = volt::safetensors::decode(bytes.data(), bytes.size(), "memory");
  REQUIRE(decoded.tensors.size() == back.tensors.size());
  for (std::size_t i = 0; i < decoded.tensors.size(); ++i) CHECK(same_tensor(decoded.tensors[i].second, back.tensors[i].second));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);  // the data starts 8-aligned, and each tensor on a multiple of its element size:
  for (const auto& e : volt::safetensors::parse_header(std::string_view(bytes.data() + 8, n), bytes.size() - 8 - n,
                                                       "x").entries) {
    CHECK(e.begin % c10::elementSize(e.dtype) == 0);
  }

  CHECK_THROWS_WITH(volt::safetensors::write((dir / "x.safetensors").string(),
                                             {.tensors = {{"a", torch::ones(2)}, {"a", torch::ones(2)}}, .metadata = {}}),
                    Contains("\"a\" is given twice"));
  CHECK_THROWS_WITH(volt::safetensors::write((dir / "x.safetensors").string(),
                                             {.tensors = {{"q", torch::ones(2).to_sparse()}}, .metadata = {}}),
                    Contains("\"q\"") && Contains("which safetensors cannot hold"));
  CHECK_FALSE(fs::exists(dir / "x.safetensors"));
}

TEST_CASE("safetensors: malformed files are refused with what is wrong, and nothing is loaded", "[weights]") {
  const fs::path dir = scratch("safetensors_bad");
  const std::string f32x2 = R"("dtype":"F32","shape":[2])";
  const std::string good_data(16, '\x01');
  auto entry = [&](const std::string& name, int b, int e) {
    return "\"" + name + "\":{" + f32x2 + R"(,"data_offsets":[)" + std::to_string(b) + "," + std::to_string(e) + "]}";
  };
  const std::string good = safetensors_bytes("{" + entry("w", 0, 8) + "," + entry("v", 8, 16) + "}", good_data);
  std::string huge(8, '\0');
  const uint64_t big = 100'000'001;
  std::memcpy(huge.data(), &big, 8);
  std::string past_end = good;
  const uint64_t longer = good.size();  // the header's length says more than the file holds
  std::memcpy(past_end.data(), &longer, 8);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {good.substr(0, good.size() - 3), "bytes of data after the header"},   // truncated in the data
      {good.substr(0, 5), "fewer than the 8"},                                // truncated in the length
      {good.substr(0, 30), "only 22 follow"},                                 // truncated in the header
      {past_end, "and only"},
      {huge, "more than the limit of 100000000"},
      {safetensors_bytes("{" + entry("w", 0, 8) + "," + entry("v", 4, 12) + "}", good_data.substr(0, 12)),
       "\"v\" (4 to 12) overlap those of \"w\""},
      {safetensors_bytes("{" + entry("w", 0, 8) + "," + entry("v", 12, 20) + "}", std::string(20, '\1')),
       "the bytes 8 to 12 belong to no tensor"},
      {safetensors_bytes(R"({"w":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", good_data.substr(0, 8)),
       "the dtype \"F31\"; known dtypes: BOOL, U8"},
      {safetensors_bytes("{" + entry("w", 0, 8) + "," + entry("w", 8, 16) + "}", good_data), "names \"w\" twice"},
      {safetensors_bytes("{" + entry("w", 0, 12) + "}", std::string(12, '\1')),
       "\"w\" has 12 bytes, and its shape [2] of Float needs 8"},
      {safetensors_bytes("{" + entry("w", 0, 8) + "}", good_data), "end at 8 and the file has 16 bytes"},
      {safetensors_bytes("[1,2]   ", ""), "does not start with '{'"},
      {safetensors_bytes(R"({"w": nope})", ""), "its header is not JSON"},
      {safetensors_bytes(R"({"w":{"dtype":"F32","shape":[2]}})", ""), "the entry of \"w\" has no \"data_offsets\""},
      {safetensors_bytes(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,0]}})", ""), "not a non-negative integer"},
      {safetensors_bytes(R"({"__metadata__":{"n":1}})", ""), "gives \"n\" the value 1, not a string"},
      {safetensors_bytes(R"({"b":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "\x01\x02"),
       "neither 0 nor 1"},
      {safetensors_bytes(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", good_data.substr(0, 8)),
       "more elements than 64 bits count"},
      {safetensors_bytes(R"({"w":{"a":{"b":{"c":[1]}}}})", ""), "nested 4 levels deep"},
  };
  TunedNet net;
  const auto before = net->head->weight.clone();
  for (const auto& [bytes, message] : cases) {
    INFO(message);
    CHECK_THROWS_WITH(volt::safetensors::decode(bytes.data(), bytes.size(), "memory"), Contains(message));
    write_bytes(dir / "bad.safetensors", std::vector<char>(bytes.begin(), bytes.end()));
    CHECK_THROWS_WITH(volt::load_weights(*net, (dir / "bad.safetensors").string(), {.strict = false}),
                      Contains(message) && Contains((dir / "bad.safetensors").string()));
  }
  CHECK(torch::equal(net->head->weight, before));
  const auto ok = volt::safetensors::decode(good.data(), good.size(), "memory");
  CHECK(ok.tensors.size() == 2);  // the well-formed file the cases were cut from is read
  CHECK_THROWS_WITH(volt::safetensors::read((dir / "none.safetensors").string()), Contains("cannot open"));
}

TEST_CASE("load_weights: into part of a model, by prefix or skipping, strict or not, shapes checked, dtypes converted",
          "[weights]") {
  const fs::path dir = scratch("load_weights");
  torch::manual_seed(3);
  TunedNet trained(3);
  volt::save_safetensors(*trained, (dir / "net.safetensors").string());
  const auto file = volt::safetensors::read((dir / "net.safetensors").string());
  CHECK(file.metadata.at("format") == "pt");
  CHECK(file.tensors.size() == 9);  // 2 linear layers' weight and bias, batch norm's 2 parameters and 3 buffers (hand count)

  SECTION("strict (the default): a model of another head width is refused, naming the shapes, and kept") {
    TunedNet other(5);
    const auto w = other->head->weight.clone();
    CHECK_THROWS_WITH(volt::load_weights(*other, (dir / "net.safetensors").string()),
                      Contains("other shapes") && Contains("head.weight (file [3, 8], module [5, 8])") &&
                          Contains("nothing was loaded"));
    CHECK(torch::equal(other->head->weight, w));
    CHECK_THROWS_WITH(volt::load_weights(*other, (dir / "net.safetensors").string(), {.strict = false}),
                      Contains("head.bias (file [3], module [5])"));  // shapes are checked even when not strict
  }
  SECTION("a model of another width everywhere: how many shapes differ and the first three, not every one") {
    const auto stack = [](int64_t width) {
      torch::nn::Sequential s;
      for (int i = 0; i < 6; ++i) s->push_back(torch::nn::Linear(width, width));
      return s;
    };
    volt::save_safetensors(*stack(4), (dir / "stack.safetensors").string());
    auto wider = stack(5);
    std::string said;
    try {
      volt::load_weights(*wider, (dir / "stack.safetensors").string());
    } catch (const volt::CheckpointError& e) {
      said = e.what();
    }
    INFO(said);
    CHECK_THAT(said, Contains("12 tensors of other shapes (") && Contains("0.weight (file [4, 4], module [5, 5])") &&
                         Contains("), ...);"));
    CHECK(said.find("5.weight") == std::string::npos);
    CHECK(said.size() < 400);
  }
  SECTION("skipping the head loads the backbone and names the new head as missing") {
    TunedNet fresh(5);
    const auto head = fresh->head->weight.clone();
    const auto r = volt::load_weights(*fresh, (dir / "net.safetensors").string(), {.skip = {"head."}, .strict = false});
    CHECK(r.missing == std::vector<std::string>{"head.bias", "head.weight"});
    CHECK(r.unexpected.empty());
    CHECK(r.loaded.size() == 7);
    for (const auto& [k, t] : file.tensors) {
      if (k.rfind("backbone.", 0) == 0) CHECK(torch::equal(fresh->named_parameters().contains(k) ? fresh->named_parameters()[k] : fresh->named_buffers()[k], t));
    }
    CHECK(torch::equal(fresh->head->weight, head));
    CHECK_THROWS_WITH(volt::load_weights(*fresh, (dir / "net.safetensors").string(), {.skip = {"head."}}),
                      Contains("2 of the module's names missing (head.bias, head.weight)") && !Contains("not in the module"));
  }
  SECTION("a sub-module takes its part through a rename; unexpected names are named") {
    TunedNet fresh(3);
    auto& backbone = *fresh->backbone;
    const auto r = volt::load_weights(backbone, (dir / "net.safetensors").string(),
                                      {.rename = {{"backbone.", ""}}, .strict = false});
    CHECK(r.unexpected == std::vector<std::string>{"head.bias", "head.weight"});
    CHECK(r.missing.empty());
    CHECK(torch::equal(fresh->backbone[0]->as<torch::nn::Linear>()->weight, trained->backbone[0]->as<torch::nn::Linear>()->weight));
    CHECK_THROWS_WITH(volt::load_weights(backbone, (dir / "net.safetensors").string(), {.rename = {{"backbone.", ""}}}),
                      Contains("2 of the file's not in the module (head.bias, head.weight)"));
    CHECK_THROWS_WITH(volt::load_weights(backbone, (dir / "net.safetensors").string(),
                                         {.rename = {{"backbone.0.", ""}, {"head.", ""}}, .strict = false}),
                      Contains("gives two tensors the name bias"));
  }
  SECTION("names that do not match: one short line with the first few and the rename that would match them") {
    struct Wrapped : torch::nn::Module {
      TunedNet net{register_module("net", TunedNet(3))};
    } wrapped;
    const std::string file_path = (dir / "net.safetensors").string();
    std::string strict_error, loose_error;
    try {
      volt::load_weights(wrapped, file_path);
    } catch (const volt::CheckpointError& e) {
      strict_error = e.what();
    }
    CHECK_THAT(strict_error, Contains("9 of the module's names missing (net.backbone.") &&
                                 Contains("9 of the file's not in the module (backbone.") &&
                                 EndsWith("Renaming \"\" to \"net.\" would match 9 of them: "
                                          "LoadWeightsOptions{.rename = {{\"\", \"net.\"}}}."));
    CHECK(strict_error.size() < 500);
    CHECK(strict_error.find('\n') == std::string::npos);
    // Not strict, but not one tensor has a place: refused too, where it used to load nothing and say nothing.
    try {
      volt::load_weights(wrapped, file_path, {.strict = false});
    } catch (const volt::CheckpointError& e) {
      loose_error = e.what();
    }
    CHECK_THAT(loose_error, Contains("Renaming \"\" to \"net.\"") && Contains("non-strict load refused too"));
    const auto r = volt::load_weights(wrapped, file_path, {.rename = {{"", "net."}}});
    CHECK(r.loaded.size() == 9);
  }
  SECTION("a file of doubles loads into a float model (converted), and a volt checkpoint's weights load alike") {
    volt::TensorFile doubles = volt::module_weights(*trained);
    for (auto& [k, t] : doubles.tensors) {
      if (t.is_floating_point()) t = t.to(torch::kDouble) + 0.25;  // exact in float: the values are floats + 1/4
    }
    volt::safetensors::write((dir / "doubles.safetensors").string(), doubles);
    TunedNet fresh(3);
    volt::load_weights(*fresh, (dir / "doubles.safetensors").string());
    CHECK(fresh->head->weight.scalar_type() == torch::kFloat);
    CHECK(torch::equal(fresh->head->weight, (trained->head->weight.to(torch::kDouble) + 0.25).to(torch::kFloat)));
  }
}

TEST_CASE("freeze and unfreeze: gradients and batch norms as Lightning's BaseFinetuning", "[weights]") {
  TunedNet net;
  auto bn = net->backbone[1]->as<torch::nn::BatchNorm1d>();
  volt::freeze(*net->backbone);  // train_bn = true, as Lightning's default: the batch norm stays trainable
  CHECK_FALSE(net->backbone[0]->as<torch::nn::Linear>()->weight.requires_grad());
  CHECK(bn->weight.requires_grad());
  CHECK(net->head->weight.requires_grad());
  auto x = torch::randn({6, 4});
  net->forward(x).sum().backward();
  CHECK_FALSE(net->backbone[0]->as<torch::nn::Linear>()->weight.grad().defined());
  CHECK(net->head->weight.grad().defined());

  volt::freeze(*net->backbone, {.train_bn = false});
  CHECK_FALSE(bn->weight.requires_grad());
  const auto mean = bn->running_mean.clone();
  net->train();
  const auto shifted = torch::randn({6, 4}) + 5;
  auto h = net->backbone[0]->as<torch::nn::Linear>()->forward(shifted);
  const auto by_batch = torch::batch_norm(h, bn->weight, bn->bias, {}, {}, /*training=*/true, 0.1, 1e-5, false);
  CHECK(torch::allclose(bn->forward(h), by_batch));
  CHECK(torch::equal(bn->running_mean, mean));  // normalized by the batch's statistics; the running ones kept
  net->eval();
  CHECK(torch::allclose(bn->forward(h), (h - mean) / torch::sqrt(bn->running_var + 1e-5) * bn->weight + bn->bias));
  net->train();

  volt::unfreeze(*net->backbone);
  CHECK(net->backbone[0]->as<torch::nn::Linear>()->weight.requires_grad());
  CHECK(bn->weight.requires_grad());
  net->forward(torch::randn({6, 4}) + 5);
  CHECK_FALSE(torch::equal(bn->running_mean, mean));  // tracking again
}

TEST_CASE("ModelCheckpoint's safetensors beside each checkpoint: its weights, EMA's average, deleted with it",
          "[weights]") {
  auto [x, y] = vt::regression_data(64);
  for (const bool async : {false, true}) {
    INFO("async_save " << async);
    const fs::path dir = scratch(async ? "beside_async" : "beside_sync");
    std::map<int64_t, torch::Tensor> weights;
    vt::Regressor m;
    auto t = volt::make_trainer(
        {.max_epochs = 3, .log_every_n_steps = 1, .default_root_dir = dir.string()}, vt::WeightLog{&weights},
        volt::EMAWeightAveraging({.decay = 0.7}),
        volt::ModelCheckpoint({.filename = "{step}", .monitor = "train_loss", .save_top_k = 2, .save_last = true,
                               .every_n_train_steps = 3, .async_save = async, .save_safetensors = true}));
    t.fit(m, make_loader(x, y, 8));  // 24 steps, a save every 3: 8 ranked, 2 kept, and last
    REQUIRE(weights.size() == 24);
    // By hand: the average after each step (decay 0.7, from the first step), in float64.
    std::map<int64_t, torch::Tensor> average;
    torch::Tensor avg = weights.at(1).to(torch::kDouble);
    for (const auto& [step, w] : weights) {
      average[step] = avg = step == 1 ? avg : 0.7 * avg + 0.3 * w.to(torch::kDouble);
    }
    std::set<std::string> ckpts, beside;
    for (const auto& e : fs::directory_iterator(dir / "checkpoints")) {
      (e.path().extension() == ".ckpt" ? ckpts : beside).insert(e.path().stem().string());
    }
    CHECK(ckpts.size() == 3);
    CHECK(ckpts.count("last") == 1);
    CHECK(ckpts == beside);  // every checkpoint has its weights file; those that left the top k took theirs along
    for (const auto& stem : ckpts) {
      INFO(stem);
      const auto ckpt = volt::checkpoint::read((dir / "checkpoints" / (stem + ".ckpt")).string());
      const auto file = volt::safetensors::read((dir / "checkpoints" / (stem + ".safetensors")).string());
      CHECK(file.metadata == std::map<std::string, std::string>{{"format", "pt"}});
      const auto state = ckpt.at("state_dict").toGenericDict();
      REQUIRE(file.tensors.size() == state.size());
      for (const auto& [name, tensor] : file.tensors) {
        INFO(name);
        REQUIRE(state.contains(name));
        CHECK(same_tensor(tensor, state.at(name).toTensor()));
      }
      const int64_t step = ckpt.at("loops").toGenericDict().at("global_step").toInt();
      const auto lin = std::find_if(file.tensors.begin(), file.tensors.end(),
                                    [](const auto& e) { return e.first == "lin.weight"; });
      REQUIRE(lin != file.tensors.end());
      CHECK(torch::allclose(lin->second.to(torch::kDouble), average.at(step), 1e-6, 1e-7));  // the average, ...
      CHECK_FALSE(torch::allclose(lin->second, weights.at(step), 1e-4, 1e-5));  // not that step's weights
    }
  }
}

TEST_CASE("a weights file never stands beside a checkpoint of another step, whichever run wrote it", "[checkpoint]") {
  auto [x, y] = vt::regression_data(32);
  const fs::path dir = scratch("beside_resumed");
  const std::string folder = (dir / "checkpoints").string();
  {  // a run that writes weights files: step 4's top-1 and last
    vt::Regressor m;
    auto t = volt::make_trainer({.max_epochs = 1, .default_root_dir = dir.string()},
                                volt::ModelCheckpoint({.save_last = true, .save_safetensors = true}));
    t.fit(m, make_loader(x, y, 8));
    REQUIRE(fs::exists(dir / "checkpoints" / "last.safetensors"));
  }
  // Resumed without them: last.ckpt moves on to step 12, and step 4's checkpoint leaves the top 1.
  vt::Regressor m;
  auto t = volt::make_trainer({.max_epochs = 3, .default_root_dir = dir.string()},
                              volt::ModelCheckpoint({.save_last = true}));
  t.fit(m, make_loader(x, y, 8), "last");
  std::set<std::string> ckpts, beside;
  for (const auto& e : fs::directory_iterator(dir / "checkpoints")) {
    (e.path().extension() == ".ckpt" ? ckpts : beside).insert(e.path().filename().string());
  }
  CHECK(ckpts == std::set<std::string>{"epoch=2-step=12.ckpt", "last.ckpt"});
  CHECK(beside.empty());  // before: last.safetensors of step 4 beside last.ckpt of step 12, and epoch=0-step=4's
}

TEST_CASE("safetensors files for Python to read", "[.safetensors_export]") {
  const char* dir_env = std::getenv("VOLT_EXPORT_DIR");
  REQUIRE(dir_env != nullptr);
  const fs::path dir(dir_env);
  fs::create_directories(dir);
  volt::TensorFile all;
  for (const auto& d : volt::safetensors::detail::dtypes()) all.tensors.emplace_back(d.name, pattern(d.type));
  all.tensors.emplace_back("scalar", torch::tensor(3.5, torch::kDouble).reshape({}));
  all.tensors.emplace_back("empty", torch::zeros({0, 4}, torch::kHalf));
  all.tensors.emplace_back("strided", torch::arange(12, torch::kFloat).reshape({3, 4}).t());
  all.metadata = {{"format", "pt"}};
  volt::safetensors::write((dir / "all.safetensors").string(), all);
  torch::manual_seed(5);
  TunedNet net;
  net->train();
  net->forward(torch::randn({16, 4}) * 2 - 1);  // running statistics that are not the initial ones
  net->eval();
  volt::save_safetensors(*net, (dir / "net.safetensors").string());
  volt::save_weights(*net, (dir / "net_sharded").string(), {.max_shard_bytes = 100});
  const auto x = torch::randn({5, 4});
  volt::safetensors::write((dir / "io.safetensors").string(),
                           {.tensors = {{"input", x}, {"output", net->forward(x).detach()}}, .metadata = {}});
  // ModelCheckpoint's files: checkpoints with their weights as safetensors beside them, the later averaged by EMA.
  auto [rx, ry] = vt::regression_data(32);
  vt::Regressor r;
  fs::remove_all(dir / "ckpt");
  auto t = volt::make_trainer({.max_epochs = 2},
                              volt::EMAWeightAveraging({.decay = 0.5, .update_starting_at_step = 3}),
                              volt::ModelCheckpoint({.dirpath = (dir / "ckpt").string(), .save_top_k = -1,
                                                     .save_last = true, .every_n_train_steps = 2,
                                                     .save_safetensors = true}));
  t.fit(r, make_loader(rx, ry, 8));
}

TEST_CASE("safetensors files Python wrote", "[.safetensors_import]") {
  const char* dir_env = std::getenv("VOLT_EXPORT_DIR");
  REQUIRE(dir_env != nullptr);
  const fs::path dir(dir_env);
  const auto file = volt::safetensors::read((dir / "from_python.safetensors").string());
  CHECK(file.metadata.at("written_by") == "python");
  std::set<std::string> python_has;
  std::istringstream names(file.metadata.at("dtypes"));
  for (std::string n; names >> n;) python_has.insert(n);
  for (const auto& d : volt::safetensors::detail::dtypes()) {
    INFO(d.name);
    CHECK(python_has.count(d.name) == 1);  // both sides know the same dtypes
  }
  for (const auto& [name, t] : file.tensors) {
    INFO(name);
    const auto* d = volt::safetensors::detail::find(name);
    REQUIRE(d != nullptr);
    CHECK(same_tensor(t, pattern(d->type)));
  }
  TunedNet net;
  volt::load_weights(*net, (dir / "py_net.safetensors").string());
  net->eval();
  const auto io = volt::safetensors::read((dir / "py_io.safetensors").string());
  std::map<std::string, torch::Tensor> m(io.tensors.begin(), io.tensors.end());
  CHECK(torch::allclose(net->forward(m.at("input")), m.at("output"), 1e-5, 1e-6));
  TunedNet from_shards;  // the same weights as a folder of three shards and their index
  volt::load_weights(*from_shards, (dir / "py_net_sharded").string());
  from_shards->eval();
  CHECK(torch::allclose(from_shards->forward(m.at("input")), m.at("output"), 1e-5, 1e-6));
}

namespace {
/// The process's anonymous resident memory in bytes (RssAnon in /proc/self/status): what it allocated, not the file
/// pages it maps.
int64_t anonymous_resident() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  }
  return -1;
}
}  // namespace

TEST_CASE("load_weights and save_weights: names with '*', per-tensor transforms, Hugging Face's sharded folders",
          "[weights]") {
  const fs::path dir = scratch("weights_layout");
  SECTION("a rename rule's '*' carries the text it matched; a transform changes the tensors it names (known answers)") {
    std::vector<std::string> stars;
    CHECK(volt::detail::renamed("transformer.h.11.attn.c_attn.weight", {{"transformer.h.*.attn.c_attn.", "net.blocks.*.attn.qkv."}}) ==
          "net.blocks.11.attn.qkv.weight");
    CHECK(volt::detail::renamed("transformer.h.1.ln_1.bias", {{"x.", "y."}, {"transformer.h.*.ln_*.", "b.*.ln*."}}) ==
          "b.1.ln1.bias");
    CHECK(volt::detail::renamed("transformer.wte.weight", {{"transformer.h.*.", "blocks.*."}}) == "transformer.wte.weight");
    CHECK_FALSE(volt::detail::matches("h.*.w", "h.1.2.w"));  // a '*' does not cross a '.'
    CHECK(volt::detail::matches("h.*.w", "h.12.w"));
    const auto six = torch::arange(6, torch::kFloat);  // 0 1 2 3 4 5
    const auto rotated = volt::transform::chain(volt::transform::reshape({2, 3}), volt::transform::transpose())(six);
    CHECK(torch::equal(rotated, torch::tensor({0.f, 3.f, 1.f, 4.f, 2.f, 5.f}).reshape({3, 2})));
    CHECK(volt::transform::permute({2, 0, 1})(torch::zeros({2, 3, 4})).sizes() == std::vector<int64_t>{4, 2, 3});
    CHECK(volt::transform::cast(torch::kBFloat16)(six).scalar_type() == torch::kBFloat16);
  }
  SECTION("GPT-2's Conv1D layout into Linear layers: renamed and transposed, the file's tensors as written by hand") {
    struct Block : torch::nn::Module {
      torch::nn::Linear fc{nullptr}, proj{nullptr};
      Block() {
        fc = register_module("fc", torch::nn::Linear(3, 5));
        proj = register_module("proj", torch::nn::Linear(5, 3));
      }
    } block;
    const auto fc_w = torch::randn({3, 5}), fc_b = torch::randn({5}), proj_w = torch::randn({5, 3}), proj_b = torch::randn({3});
    volt::safetensors::write((dir / "conv1d.safetensors").string(),
                             {.tensors = {{"h.0.mlp.c_fc.weight", fc_w}, {"h.0.mlp.c_fc.bias", fc_b},
                                          {"h.0.mlp.c_proj.weight", proj_w}, {"h.0.mlp.c_proj.bias", proj_b}},
                              .metadata = {}});
    const volt::LoadWeightsOptions from_gpt2{
        .rename = {{"h.*.mlp.c_fc.", "fc."}, {"h.*.mlp.c_proj.", "proj."}},
        .transforms = {{"h.*.mlp.c_*.weight", volt::transform::transpose(), "transpose"}}};
    volt::load_weights(block, (dir / "conv1d.safetensors").string(), from_gpt2);
    CHECK(torch::equal(block.fc->weight, fc_w.t()));
    CHECK(torch::equal(block.proj->weight, proj_w.t()));
    CHECK(torch::equal(block.fc->bias, fc_b));
    const auto x = torch::randn({2, 3});  // Conv1D's forward, x @ W + b, by hand
    CHECK(torch::allclose(block.fc->forward(x), x.matmul(fc_w) + fc_b));
    // And back: save_weights writes the Conv1D layout again, which reads back as the hand-written file.
    volt::save_weights(block, (dir / "back").string(),
                       {.rename = {{"fc.", "h.0.mlp.c_fc."}, {"proj.", "h.0.mlp.c_proj."}},
                        .transforms = {{"*.weight", volt::transform::transpose(), "transpose"}}});
    const auto back = volt::read_weights((dir / "back").string());
    std::map<std::string, torch::Tensor> m(back.tensors.begin(), back.tensors.end());
    CHECK(torch::equal(m.at("h.0.mlp.c_fc.weight"), fc_w));
    CHECK(torch::equal(m.at("h.0.mlp.c_proj.bias"), proj_b));
    CHECK(back.metadata.at("format") == "pt");
    CHECK_THROWS_WITH(volt::load_weights(block, (dir / "conv1d.safetensors").string(),
                                         {.rename = from_gpt2.rename,
                                          .transforms = {{"h.*.attn.c_attn.weight", volt::transform::transpose(), "transpose"}}}),
                      "volt: transpose for \"h.*.attn.c_attn.weight\" matches no tensor of " +
                          (dir / "conv1d.safetensors").string() + " (its names look like h.0.mlp.c_fc.bias, "  // the file's order: by name
                          "h.0.mlp.c_fc.weight, h.0.mlp.c_proj.bias); nothing was loaded.");
    CHECK_THROWS_WITH(volt::load_weights(block, (dir / "conv1d.safetensors").string(),
                                         {.transforms = {{"h.0.mlp.c_fc.bias", volt::transform::transpose(), "transpose"}}}),
                      StartsWith("volt: transpose for \"h.0.mlp.c_fc.bias\" failed on h.0.mlp.c_fc.bias [5] of "));
    CHECK_THROWS_WITH(volt::load_weights(block, (dir / "conv1d.safetensors").string(), {.rename = {{"h.", "*."}}}),
                      "volt: load_weights rename rule {\"h.\", \"*.\"} has more '*' in what it writes than in what it "
                      "matches; each '*' of the second takes the text of the same '*' of the first.");
  }
  SECTION("sharded: the index and its shards written, read back whole, and an earlier save's files removed") {
    torch::manual_seed(4);
    TunedNet net(3), fresh(3);
    volt::save_weights(*net, (dir / "sharded").string(), {.max_shard_bytes = 100});
    // 404 bytes in 9 tensors (the first linear's 4x8 floats, 128 bytes, more than a shard): shards of at most 100
    // bytes, or of one larger tensor, named k of N, with the index.
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(dir / "sharded")) files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    REQUIRE(files.size() >= 5);
    CHECK(files.back() == "model.safetensors.index.json");
    const std::string of = "-of-0000" + std::to_string(files.size() - 1) + ".safetensors";
    int64_t total = 0;
    for (std::size_t k = 0; k + 1 < files.size(); ++k) {
      CHECK(files[k] == "model-0000" + std::to_string(k + 1) + of);
      const auto shard = volt::safetensors::read((dir / "sharded" / files[k]).string());
      int64_t bytes = 0;
      for (const auto& [name, t] : shard.tensors) bytes += t.numel() * t.element_size();
      CHECK((bytes <= 100 || shard.tensors.size() == 1));
      total += bytes;
    }
    CHECK(total == 128 + 8 * 4 * 5 + 8 + 96 + 12);
    volt::load_weights(*fresh, (dir / "sharded").string());
    for (const auto& p : net->named_parameters()) CHECK(torch::equal(p.value(), fresh->named_parameters()[p.key()]));
    for (const auto& b : net->named_buffers()) CHECK(torch::equal(b.value(), fresh->named_buffers()[b.key()]));
    // A buffer the file leaves out (save_weights' skip) is kept in the module when load_weights is told to.
    volt::save_weights(*net, (dir / "no_statistics").string(), {.skip = {"backbone.*.running_"}});
    TunedNet third(3);
    const auto mean = third->named_buffers()["backbone.1.running_mean"].clone();
    CHECK_THROWS_WITH(volt::load_weights(*third, (dir / "no_statistics").string()), Contains("backbone.1.running_mean"));
    const auto r = volt::load_weights(*third, (dir / "no_statistics").string(), {.keep = {"backbone.1.running_"}});
    CHECK(r.loaded.size() == 7);  // 9 less the two statistics
    CHECK(torch::equal(third->named_buffers()["backbone.1.running_mean"], mean));
    CHECK(torch::equal(third->head->weight, net->head->weight));
    volt::save_weights(*net, (dir / "sharded").string());
    files.clear();
    for (const auto& e : fs::directory_iterator(dir / "sharded")) files.push_back(e.path().filename().string());
    CHECK(files == std::vector<std::string>{"model.safetensors"});
    // A broken folder: an index naming a missing shard, or a tensor its shard does not hold.
    fs::create_directories(dir / "broken");
    std::ofstream(dir / "broken" / "model.safetensors.index.json")
        << R"({"metadata": {}, "weight_map": {"head.weight": "model-00001-of-00002.safetensors"}})";
    CHECK_THROWS_WITH(volt::read_weights((dir / "broken").string()),
                      "volt: " + (dir / "broken" / "model.safetensors.index.json").string() +
                          " names the shard model-00001-of-00002.safetensors, which is not beside it.");
    fs::copy_file(dir / "sharded" / "model.safetensors", dir / "broken" / "model-00001-of-00002.safetensors");
    std::ofstream(dir / "broken" / "model.safetensors.index.json")
        << R"({"weight_map": {"head.weights": "model-00001-of-00002.safetensors"}})";
    CHECK_THROWS_WITH(volt::read_weights((dir / "broken").string()),
                      "volt: " + (dir / "broken" / "model.safetensors.index.json").string() +
                          " puts \"head.weights\" in model-00001-of-00002.safetensors, which has no such tensor.");
    CHECK_THROWS_WITH(volt::read_weights(dir.string()),
                      "volt: " + dir.string() + " holds neither model.safetensors nor model.safetensors.index.json: a "
                      "Hugging Face model folder has one of them.");
  }
  SECTION("a file is mapped, not read into memory: 64 MiB of weights cost no anonymous memory") {
    const int64_t n = int64_t{1} << 24;  // floats: 0 .. 2^24 - 1, each exact in a float
    volt::safetensors::write((dir / "big.safetensors").string(),
                             {.tensors = {{"big", torch::arange(n, torch::kFloat)}}, .metadata = {}});
    const int64_t before = anonymous_resident();
    REQUIRE(before > 0);
    const auto file = volt::read_weights((dir / "big.safetensors").string());
    const double sum = file.tensors.at(0).second.sum(torch::kDouble).item<double>();  // every page read
    const int64_t grown = anonymous_resident() - before;
    INFO("anonymous resident memory grew by " << grown / 1024 << " KiB reading a " << (n * 4 >> 20) << " MiB file");
    CHECK(sum == static_cast<double>(n) * static_cast<double>(n - 1) / 2);  // 0 + 1 + ... + (n - 1)
    if (!vt::sanitized) CHECK(grown < (int64_t{16} << 20));
    // The tensors may be written: the pages are this process's copies, the file stays as it was.
    file.tensors.at(0).second.fill_(1);
    CHECK(volt::safetensors::read((dir / "big.safetensors").string()).tensors.at(0).second[5].item<float>() == 5.f);
  }
}
