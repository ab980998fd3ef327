// A libFuzzer target on what reads checkpoints and weights files, built by scripts/fuzz.sh with clang,
// AddressSanitizer and UndefinedBehaviorSanitizer (test/fuzz/CMakeLists.txt). Three modes (VOLT_FUZZ_MODE):
//
//   bytes   the input is a checkpoint file's bytes: checkpoint::decode (what `read` does with a file), then every
//           check a resume makes and the loads that follow them.
//   fields  the input is a recipe of edits to the entries of a real checkpoint (a seed, read at start): values
//           removed or replaced by other kinds, sizes and numbers, the checksum stamped again so the edits reach
//           the checks behind it; then the same resume path, including the training loader's state decoder and
//           the loader resuming from it.
//   safetensors  the input is a safetensors file's bytes: safetensors::decode, then the tensors loaded into the
//           module below (not strict: matching names, shapes checked, dtypes converted).
//
// The oracle, besides the sanitizers: every bad input must end in a volt::CheckpointError (a sentence naming the
// file and the fault). Any other exception escaping, or a crash, is a finding; the input that shows it is kept in
// test/fuzz/regressions/ and replayed by scripts/fuzz.sh before fuzzing.
//
// VOLT_FUZZ_WRITE_SEEDS=<dir>: writes the seed corpus (real checkpoints of the module below, trained by a
// Trainer: mid-epoch, mid-window with accumulated gradients, epoch end, weights only, as *.ckpt; its weights and a
// file of several dtypes with metadata as *.safetensors) and exits.
// VOLT_FUZZ_SEEDS=<dir>: where the fields mode reads its seeds.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using volt::checkpoint::Dict;

/// The module and loader every seed was written by, and every input is checked against.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  NetImpl() {
    torch::manual_seed(1);
    a = register_module("a", torch::nn::Linear(4, 3));
    b = register_module("b", torch::nn::Linear(3, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto loss = (b(torch::tanh(a(batch.data))) - batch.target).pow(2).mean();
    ctx.log("loss", loss, {.on_step = true, .on_epoch = true});
    return loss;
  }
  void validation_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    ctx.log("val_loss", (b(torch::tanh(a(batch.data))) - batch.target).pow(2).mean());
  }
  volt::OptimizerConfig configure_optimizers() {
    auto opt = std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-2));
    return {opt, std::make_shared<torch::optim::StepLR>(*opt, 1, 0.5)};
  }
};
TORCH_MODULE(Net);

std::pair<torch::Tensor, torch::Tensor> data() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto x = torch::randn({32, 4}, gen);
  return {x, x.sum(1, true)};
}
volt::data::TensorLoader loader() {
  auto [x, y] = data();
  return volt::data::TensorLoader(x, y, {.batch_size = 8, .shuffle = true, .seed = 3});
}

void write_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  Net net;
  // Saves after every optimizer step, and after validations that fall inside a gradient-accumulation window
  // (validation every 2 batches, a step every 3), whose checkpoints carry the gradients accumulated so far.
  auto trainer = volt::make_trainer(
      {.max_epochs = 2, .val_check_interval = 2, .num_sanity_val_steps = 0, .accumulate_grad_batches = 3},
      volt::ModelCheckpoint({.dirpath = (dir / "steps").string(), .filename = "{step}", .save_top_k = -1,
                             .every_n_train_steps = 1}),
      volt::ModelCheckpoint({.dirpath = (dir / "val").string(), .filename = "val-{step}", .save_top_k = -1}));
  trainer.fit(net, loader(), loader());
  trainer.save_checkpoint((dir / "weights_only.ckpt").string(), /*weights_only=*/true);
  volt::save_safetensors(*net, (dir / "net.safetensors").string());
  volt::safetensors::write((dir / "dtypes.safetensors").string(),
                           {.tensors = {{"b", torch::tensor({true, false})}, {"h", torch::ones({2, 2}, torch::kHalf)},
                                        {"l", torch::arange(3)}, {"s", torch::tensor(1.5)}, {"e", torch::ones({0})}},
                            .metadata = {{"format", "pt"}, {"note", "seed"}}});
  int n = 1;
  for (const char* sub : {"steps", "val"}) {
    for (const auto& e : fs::directory_iterator(dir / sub)) {
      fs::rename(e.path(), dir / e.path().filename().replace_extension(".ckpt"));
      ++n;
    }
    fs::remove_all(dir / sub);
  }
  std::cout << "wrote " << n << " seed checkpoints to " << dir << std::endl;
}

/// A finding: anything but a CheckpointError escaping.
[[noreturn]] void finding(const std::string& what) {
  std::cerr << "FINDING: " << what << std::endl;
  std::abort();
}

/// Everything a resume does with a decoded checkpoint, against the module and loader above.
void resume_from(const Dict& file) {
  Net net;
  auto train = loader();
  auto params = net->parameters();
  auto config = net->configure_optimizers();
  volt::checkpoint::ResumeState r = volt::checkpoint::resume_state_of(
      volt::checkpoint::View(file, "input"), *net, train,
      volt::checkpoint::FitShape{params.size(), {/*has_scheduler=*/true}}, 0);
  volt::checkpoint::load_optimizer_state(*config.optimizer, r.optimizers.at(0), "input");
  volt::checkpoint::load_scheduler_step_count(*config.scheduler, r.scheduler_step_counts.at(0));
  volt::checkpoint::load_module_state(*net, r.weights);
  if (r.train_loader) {
    train.load_state_dict(*r.train_loader);
    int64_t batches = 0;
    for (const auto& batch : train) batches += batch.data.size(0) > 0;
    (void)batches;
  }
  volt::checkpoint::set_rng_states(r.point.rng);
}

/// Runs `f`; a CheckpointError is the expected end of a bad input, anything else is a finding.
template <class F>
void expect_checkpoint_error(const char* stage, F&& f) {
  try {
    f();
  } catch (const volt::CheckpointError&) {
  } catch (const std::exception& e) {
    finding(std::string(stage) + ": an exception other than volt::CheckpointError: " + e.what());
  } catch (...) {
    finding(std::string(stage) + ": a non-standard exception");
  }
}

// ---- the fields target's edits ----------------------------------------------------------------------------

/// Reads the recipe's bytes.
struct Recipe {
  const uint8_t* p;
  std::size_t n;
  bool empty() const { return n == 0; }
  uint64_t take(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes && n > 0; ++i, ++p, --n) v = (v << 8) | *p;
    return v;
  }
  int64_t number() {
    static const int64_t special[] = {0, 1, -1, 2, 3, 7, 8, 32, 1LL << 31, -(1LL << 31), INT64_MAX, INT64_MIN};
    const uint64_t k = take(1);
    if (k < 2 * std::size(special)) return special[k % std::size(special)];
    return static_cast<int64_t>(take(8));
  }
};

/// One place in the checkpoint's tree: a dict entry or a list element.
struct Slot {
  c10::IValue container;  // a GenericDict or a List
  c10::IValue key;        // the dict key
  std::size_t index = 0;  // the list index
};

void collect(const c10::IValue& v, std::vector<Slot>& out, int depth) {
  if (depth > 6) return;
  if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      out.push_back({v, e.key(), 0});
      collect(e.value(), out, depth + 1);
    }
  } else if (v.isList()) {
    const auto list = v.toList();
    for (std::size_t i = 0; i < list.size(); ++i) {
      out.push_back({v, c10::IValue(), i});
      collect(list.get(i), out, depth + 1);
    }
  }
}

at::Tensor make_tensor(Recipe& r, const at::Tensor& like) {
  static const c10::ScalarType types[] = {at::kFloat, at::kDouble, at::kLong, at::kByte, at::kBool, at::kInt};
  const auto kind = r.take(1);
  if (like.defined() && kind % 2 == 0) {  // the same shape, another type or other values
    return (torch::rand(like.sizes()) * static_cast<double>(r.number() % 1000)).to(types[r.take(1) % 6]);
  }
  std::vector<int64_t> sizes(r.take(1) % 4);
  for (auto& s : sizes) s = static_cast<int64_t>(r.take(1) % 6);
  return torch::zeros(sizes).to(types[kind % 6]);
}

c10::IValue make_value(Recipe& r, const c10::IValue& old) {
  switch (r.take(1) % 8) {
    case 0: return c10::IValue(r.number());
    case 1: {
      const double d[] = {0.0, -1.0, 1e300, std::nan(""), std::numeric_limits<double>::infinity()};
      return c10::IValue(d[r.take(1) % 5]);
    }
    case 2: return c10::IValue(static_cast<bool>(r.take(1) & 1));
    case 3: return c10::IValue(std::string("x") + std::to_string(r.number()));
    case 4: return c10::IValue(make_tensor(r, old.isTensor() ? old.toTensor() : at::Tensor()));
    case 5: return c10::IValue(volt::checkpoint::make_dict());
    case 6: return c10::IValue(c10::impl::GenericList(c10::AnyType::get()));
    default: return old.isInt() ? c10::IValue(old.toInt() + r.number() % 5 - 2) : c10::IValue(r.number());
  }
}

/// Whether `v` may go into `container` (typed containers keep their element type).
bool fits(const c10::IValue& container, const c10::IValue& v) {
  const c10::TypePtr t = container.isGenericDict() ? container.toGenericDict().valueType()
                                                   : container.toList().elementType();
  return t->kind() == c10::AnyType::Kind || v.type()->isSubtypeOf(*t);
}

void edit(Dict& root, Recipe& r) {
  std::vector<Slot> slots;
  collect(c10::IValue(root), slots, 0);
  if (slots.empty()) return;
  Slot& s = slots[r.take(2) % slots.size()];
  const bool remove = r.take(1) % 4 == 0;
  if (s.container.isGenericDict()) {
    auto d = s.container.toGenericDict();
    if (remove) {
      (void)d.erase(s.key);
    } else {
      c10::IValue v = make_value(r, d.at(s.key));
      if (fits(s.container, v)) d.insert_or_assign(s.key, v);
    }
  } else {
    auto list = s.container.toList();
    if (remove) {
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(s.index));
    } else {
      c10::IValue v = make_value(r, list.get(s.index));
      if (fits(s.container, v)) list.set(s.index, v);
    }
  }
}

std::vector<Dict>& seeds() {
  static std::vector<Dict> s;
  return s;
}
enum class Mode { bytes, fields, safetensors };
Mode& mode() {
  static Mode m = Mode::bytes;
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("VOLT_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  const std::string name = std::getenv("VOLT_FUZZ_MODE") ? std::getenv("VOLT_FUZZ_MODE") : "";
  if (name != "bytes" && name != "fields" && name != "safetensors") {
    std::cerr << "fuzz_checkpoint: set VOLT_FUZZ_MODE to bytes, fields or safetensors." << std::endl;
    std::exit(2);
  }
  mode() = name == "fields" ? Mode::fields : name == "safetensors" ? Mode::safetensors : Mode::bytes;
  if (mode() != Mode::fields) return 0;
  const char* dir = std::getenv("VOLT_FUZZ_SEEDS");
  if (dir == nullptr) {
    std::cerr << "fuzz_checkpoint: the fields mode needs VOLT_FUZZ_SEEDS, a folder of seed checkpoints "
                 "(VOLT_FUZZ_WRITE_SEEDS=<dir> writes them)." << std::endl;
    std::exit(2);
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".ckpt") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  for (const auto& f : files) seeds().push_back(volt::checkpoint::read(f.string()));
  if (seeds().empty()) {
    std::cerr << "fuzz_checkpoint: no checkpoint in " << dir << std::endl;
    std::exit(2);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  std::vector<char> bytes;
  if (mode() == Mode::safetensors) {
    expect_checkpoint_error("safetensors decode and load", [&] {
      Net net;
      volt::load_weights(*net, volt::safetensors::decode(reinterpret_cast<const char*>(data), size, "input"),
                         {.strict = false}, "input");
    });
    return 0;
  }
  if (mode() == Mode::fields) {
    Recipe r{data, size};
    Dict d = c10::IValue(seeds()[r.take(1) % seeds().size()]).deepcopy().toGenericDict();
    for (int edits = 0; edits < 8 && !r.empty(); ++edits) edit(d, r);
    (void)d.erase("checksum");
    d.insert("checksum", static_cast<int64_t>(volt::checkpoint::detail::checksum(d, 0)));
    try {
      bytes = torch::pickle_save(c10::IValue(d));
    } catch (const std::exception&) {
      return 0;  // an edit torch cannot write (no file volt could be given)
    }
  } else {
    bytes.assign(data, data + size);
  }
  expect_checkpoint_error("decode and resume", [&] { resume_from(volt::checkpoint::decode(bytes, "input")); });
  return 0;
}
