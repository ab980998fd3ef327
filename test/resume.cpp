// Resuming in new processes. Each driver mode starts real processes (this program again, or mpirun) and
// checks their results against a reference run:
//   resume sigkill <dir> [rounds]             a run killed with SIGKILL at a random step and resumed from its
//                                             last checkpoint ends bit-identical to an uninterrupted run
//   resume kill-mid-write <dir> [rounds]      a writer killed at random moments always leaves a whole file
//   resume ddp-exact <dir> -- <mpirun...>     2 DDP ranks saved mid-epoch and resumed on 2: bit-identical
//   resume spawn-exact <dir>                  the same with DDP<Spawn> workers
//   resume n-to-m <from> <to> <dir> -- <mpirun...>
//                                             saved on `from` ranks, resumed on `to`: every sample once
//   resume export <dir>                       the quick-start net's checkpoint, an input and its output, for
//                                             test/torch_load_check.py
// and the worker modes they start: train, writer, ddp-fit, spawn-fit, index-fit.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "../examples/quickstart_net.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

std::string self_exe() { return fs::read_symlink("/proc/self/exe").string(); }

/// A started command: its pid and, when piped, its standard output.
struct Child {
  pid_t pid;
  FILE* out;
};

Child start(const std::vector<std::string>& cmd, bool piped) {
  int fds[2] = {-1, -1};
  if (piped && ::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (piped) {
      ::dup2(fds[1], STDOUT_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
    }
    std::vector<char*> argv;
    for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::perror("exec");
    std::_Exit(127);
  }
  if (!piped) return {pid, nullptr};
  ::close(fds[1]);
  return {pid, ::fdopen(fds[0], "r")};
}

/// Waits for a child; its exit status, or -signal when a signal ended it.
int wait_for(const Child& c) {
  if (c.out != nullptr) std::fclose(c.out);
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

/// Runs a command to its end; returns its exit status (-signal when killed).
int run(const std::vector<std::string>& cmd) {
  std::cout << "$";
  for (const auto& a : cmd) std::cout << " " << a;
  std::cout << std::endl;
  return wait_for(start(cmd, false));
}

/// Starts a command with its stdout on a pipe; `on_line` sees each line and returns true to kill the
/// process with SIGKILL there. Returns the status as run() does.
template <class F>
int run_until(const std::vector<std::string>& cmd, F&& on_line) {
  const Child c = start(cmd, true);
  FILE* in = c.out;
  char line[512];
  while (std::fgets(line, sizeof line, in) != nullptr) {
    if (on_line(std::string(line))) {
      ::kill(c.pid, SIGKILL);
      break;
    }
  }
  return wait_for(c);
}

[[noreturn]] void fail(const std::string& what) {
  std::cout << "MISMATCH: " << what << std::endl;
  std::exit(1);
}

/// Whether two weights-only checkpoints hold bit-identical tensors under the same names.
bool identical(const std::string& a, const std::string& b, std::string* why) {
  const auto da = volt::checkpoint::read(a).at("state_dict").toGenericDict();
  const auto db = volt::checkpoint::read(b).at("state_dict").toGenericDict();
  if (da.size() != db.size()) {
    *why = "different tensor counts";
    return false;
  }
  for (const auto& e : da) {
    const auto& k = e.key().toStringRef();
    if (!db.contains(k) || !torch::equal(e.value().toTensor(), db.at(k).toTensor())) {
      *why = k + " differs (max abs diff " +
             (db.contains(k) ? std::to_string((e.value().toTensor() - db.at(k).toTensor()).abs().max().item<double>())
                             : std::string("missing")) +
             ")";
      return false;
    }
  }
  return true;
}

// ---- the model of the exact-resume runs ------------------------------------------------------------------

/// An MLP with dropout (each rank's generator matters), Adam and a per-epoch step schedule.
struct TinyImpl : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::nn::Dropout drop{nullptr};
  TinyImpl() {
    l1 = register_module("l1", torch::nn::Linear(6, 32));
    drop = register_module("drop", torch::nn::Dropout(0.25));
    l2 = register_module("l2", torch::nn::Linear(32, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto loss = (l2(drop(torch::tanh(l1(b.data)))) - b.target).pow(2).mean();
    ctx.log("train_loss", loss, {.on_step = true, .on_epoch = true});
    return loss;
  }
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("val_loss", (l2(torch::tanh(l1(b.data))) - b.target).pow(2).mean(), {.sync_dist = true});
  }
  volt::OptimizerConfig configure_optimizers() {
    auto opt = std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(5e-3));
    return {opt, std::make_shared<torch::optim::StepLR>(*opt, 1, 0.8)};
  }
};
TORCH_MODULE(Tiny);

volt::data::TensorLoader tiny_data() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto x = torch::randn({96, 6}, gen);
  auto y = x.sum(1, true).sin() + 0.05 * torch::randn({96, 1}, gen);
  return volt::data::TensorLoader(x, y, {.batch_size = 8, .shuffle = true, .seed = 3});
}

/// Prints "step N" after each optimizer step (after the checkpoint callback has written it).
struct StepPrinter {
  int64_t last = -1;
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (trainer.global_step() != last && trainer.is_global_zero()) {
      last = trainer.global_step();
      std::cout << "step " << last << std::endl;
    }
  }
};

// resume train <dir> <weights-out> [--resume]: one process, a checkpoint (last.ckpt) after every step.
int train(const std::string& dir, const std::string& out, bool resume) {
  torch::manual_seed(1);  // LibTorch seeds its generator differently in every process: the same initial weights
  Tiny model;
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      {.max_epochs = 4, .deterministic = true, .seed = 7},
      volt::ModelCheckpoint({.dirpath = dir, .save_top_k = 0, .save_last = true, .every_n_train_steps = 1}),
      StepPrinter{});
  trainer.fit(model, tiny_data(), volt::NoLoader{}, resume ? "last" : "");
  trainer.save_checkpoint(out, /*weights_only=*/true);
  return 0;
}

// resume sigkill <dir> [rounds]
int sigkill(const std::string& dir, int rounds) {
  fs::remove_all(dir);
  const std::string ref = dir + "/reference.ckpt";
  if (run({self_exe(), "train", dir + "/ref_run", ref}) != 0) fail("the reference run failed");
  std::random_device rd;
  const unsigned seed = rd();
  std::mt19937 rng(seed);
  std::cout << "random seed " << seed << std::endl;
  for (int r = 0; r < rounds; ++r) {
    const int64_t kill_at = std::uniform_int_distribution<int64_t>(1, 46)(rng);  // of 48 steps
    const std::string run_dir = dir + "/run" + std::to_string(r), out = dir + "/out" + std::to_string(r) + ".ckpt";
    const auto lag = std::chrono::microseconds(std::uniform_int_distribution<int>(0, 4000)(rng));
    const int status = run_until({self_exe(), "train", run_dir, out}, [&](const std::string& line) {
      if (line != "step " + std::to_string(kill_at) + "\n") return false;
      std::this_thread::sleep_for(lag);  // the kill lands anywhere in the next step or its checkpoint write
      return true;
    });
    if (status != -SIGKILL) fail("the run to kill ended with status " + std::to_string(status));
    const int64_t saved = volt::checkpoint::read(run_dir + "/last.ckpt").at("loops").toGenericDict().at("global_step").toInt();
    std::cout << "round " << r << ": killed after step " << kill_at << "; its last checkpoint holds step " << saved << std::endl;
    if (run({self_exe(), "train", run_dir, out, "--resume"}) != 0) fail("the resumed run failed");
    std::string why;
    if (!identical(ref, out, &why)) fail("round " + std::to_string(r) + ": " + why);
    std::cout << "round " << r << ": resumed from step " << saved << ", weights bit-identical  match" << std::endl;
  }
  return 0;
}

// ---- killed while writing ---------------------------------------------------------------------------------

// resume writer <path>: rewrites one checkpoint (16 MiB) forever, printing "saved N" after each.
int writer(const std::string& path) {
  auto d = volt::checkpoint::make_dict();
  torch::Tensor big = torch::empty({4 << 20});
  for (int64_t i = 0;; ++i) {
    big.fill_(static_cast<float>(i));
    d.insert_or_assign("counter", i);
    d.insert_or_assign("big", big);
    volt::checkpoint::save(path, d);
    std::cout << "saved " << i << std::endl;
  }
}

// resume kill-mid-write <dir> [rounds]: the writer is killed after its first complete write, at a random
// moment within the next write (even rounds) or while the next write's temporary file is being filled (odd).
int kill_mid_write(const std::string& dir, int rounds) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = dir + "/c.ckpt";
  std::mt19937 rng(std::random_device{}());
  int interrupted = 0;
  std::chrono::microseconds write_time{0};
  for (int r = 0; r < rounds; ++r) {
    const Child child = start({self_exe(), "writer", path}, true);
    const pid_t pid = child.pid;
    FILE* in = child.out;
    char line[128];
    if (std::fgets(line, sizeof line, in) == nullptr) fail("the writer wrote nothing");
    const auto first = std::chrono::steady_clock::now();
    if (write_time.count() == 0) {  // learn how long one write takes
      if (std::fgets(line, sizeof line, in) == nullptr) fail("the writer stopped");
      write_time = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - first);
      std::cout << "one write takes " << write_time.count() / 1000 << " ms" << std::endl;
    }
    if (r % 2 == 0) {  // anywhere in the next write
      std::this_thread::sleep_for(std::chrono::microseconds(
          std::uniform_int_distribution<int64_t>(0, write_time.count())(rng)));
    } else {  // once the next write has opened its temporary file, a little later
      const std::string temp = path + ".tmp." + std::to_string(pid);
      while (!fs::exists(temp) && std::chrono::steady_clock::now() - first < 20 * write_time) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      // within a millisecond: the temporary file lives for the write and its fsync only, which under a loaded
      // machine (ctest -j2 beside compiler runs) can be shorter than the 20 ms this once allowed
      std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 1000)(rng)));
    }
    ::kill(pid, SIGKILL);
    int64_t last_saved = -1;
    while (std::fgets(line, sizeof line, in) != nullptr) last_saved = std::stoll(std::string(line).substr(6));
    wait_for(child);
    bool temp_left = false;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().filename().string().find(".tmp.") != std::string::npos) {
        temp_left = true;
        fs::remove(e.path());
      }
    }
    interrupted += temp_left;
    const auto d = volt::checkpoint::read(path);  // throws on a torn file
    const int64_t counter = d.at("counter").toInt();
    const torch::Tensor big = d.at("big").toTensor();
    if (counter < last_saved || !big.eq(static_cast<float>(counter)).all().item<bool>()) {
      fail("round " + std::to_string(r) + ": the file holds counter " + std::to_string(counter) + ", last reported " +
           std::to_string(last_saved));
    }
    std::cout << "round " << r << ": killed " << (temp_left ? "during a write" : "between writes")
              << ", the checkpoint reads whole (counter " << counter << ")" << std::endl;
  }
  if (interrupted == 0) fail("no kill landed during a write, so nothing was shown");
  std::cout << interrupted << " of " << rounds << " kills landed during a write  match" << std::endl;
  return 0;
}

// ---- several ranks ------------------------------------------------------------------------------------------

// resume ddp-fit | spawn-fit <dir> <weights-out> [ckpt]: DDP on 2 ranks (under mpirun, or 2 Spawn workers),
// gradients accumulated over 2 batches, validation twice an epoch; checkpoints after every optimizer step
// (<dir>/step=N.ckpt) and after every validation (<dir>/val/..., some in the middle of an accumulation
// window); the final weights go to <weights-out> (from the calling process under Spawn).
template <class Launcher>
int two_rank_fit(const std::string& dir, const std::string& out, const std::string& ckpt) {
  torch::manual_seed(1);
  Tiny model;
  auto trainer = volt::make_trainer<volt::DDP<Launcher, volt::Mpi>, volt::Fp32, volt::CPU>(
      {.devices = 2, .max_epochs = 3, .val_check_interval = 0.5, .accumulate_grad_batches = 2, .deterministic = true,
       .seed = 7},
      volt::ModelCheckpoint({.dirpath = dir, .filename = "{step}", .save_top_k = -1, .every_n_train_steps = 1}),
      volt::ModelCheckpoint({.dirpath = dir + "/val", .save_top_k = -1}));
  auto val = tiny_data();
  trainer.fit(model, tiny_data(), val, ckpt);
  if constexpr (std::is_same_v<Launcher, volt::Spawn>) {  // fit brought rank 0's weights back here
    auto d = volt::checkpoint::make_dict();
    d.insert("state_dict", volt::checkpoint::module_state(*model));
    volt::checkpoint::save(out, d);
  } else {
    trainer.save_checkpoint(out, /*weights_only=*/true);
  }
  return 0;
}

// resume ddp-exact <dir> -- <mpirun...>
int ddp_exact(const std::string& dir, const std::vector<std::string>& mpirun) {
  fs::remove_all(dir);
  auto job = [&](std::vector<std::string> args) {
    std::vector<std::string> cmd = mpirun;
    cmd.push_back(self_exe());
    cmd.insert(cmd.end(), args.begin(), args.end());
    return run(cmd);
  };
  const std::string ref = dir + "/reference.ckpt";
  if (job({"ddp-fit", dir + "/a", ref}) != 0) fail("the uninterrupted 2-rank run failed");
  // 6 batches a rank and 3 steps an epoch: step 4 ends epoch 1's second batch; its validation after the third
  // batch is saved with that batch's gradients waiting for the fourth.
  const std::string mid_window = dir + "/a/val/epoch=1-step=4.ckpt";
  if (volt::checkpoint::read(mid_window).at("accumulated_grads").toListRef().empty()) {
    fail(mid_window + " holds no accumulated gradients; it was meant to be saved inside an accumulation window");
  }
  int n = 0;
  for (const std::string& from : {dir + "/a/step=2.ckpt", dir + "/a/step=4.ckpt", mid_window}) {
    const std::string out = dir + "/out" + std::to_string(n) + ".ckpt";
    if (job({"ddp-fit", dir + "/b" + std::to_string(n++), out, from}) != 0) fail("the resumed 2-rank run failed");
    std::string why;
    if (!identical(ref, out, &why)) fail("resumed from " + from + ": " + why);
    std::cout << "2 ranks resumed from " << from << " (mid-epoch) on 2 ranks: weights bit-identical  match" << std::endl;
  }
  return 0;
}

// resume spawn-exact <dir>: the same as ddp-exact with workers started by Spawn.
int spawn_exact(const std::string& dir) {
  fs::remove_all(dir);
  const std::string ref = dir + "/reference.ckpt", out = dir + "/out.ckpt";
  if (run({self_exe(), "spawn-fit", dir + "/a", ref}) != 0) fail("the uninterrupted Spawn run failed");
  if (run({self_exe(), "spawn-fit", dir + "/b", out, dir + "/a/step=5.ckpt"}) != 0) fail("the resumed Spawn run failed");
  std::string why;
  if (!identical(ref, out, &why)) fail("Spawn resumed from step 5: " + why);
  std::cout << "Spawn: 2 workers resumed from step 5 (mid-epoch): weights bit-identical  match" << std::endl;
  return 0;
}

/// Records which samples each rank trains on, per epoch.
struct IndexModelImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  std::vector<std::pair<int64_t, int64_t>> seen;  // (epoch, sample)
  IndexModelImpl() { lin = register_module("lin", torch::nn::Linear(2, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    for (int64_t i = 0; i < b.target.size(0); ++i) seen.emplace_back(ctx.current_epoch(), b.target[i].item<int64_t>());
    return lin(b.data / 48.0).pow(2).mean();
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), 0.01); }
};
TORCH_MODULE(IndexModel);

struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  torch::data::Example<> get(size_t i) override {
    return {torch::full({2}, static_cast<float>(i)), torch::tensor(static_cast<int64_t>(i))};
  }
  c10::optional<size_t> size() const override { return 48; }
};

template <class Trainer>
int index_fit_with(Trainer& trainer, const std::string& record, const std::string& ckpt) {
  IndexModel model;
  volt::data::DatasetLoader loader(IndexDataset{}.map(torch::data::transforms::Stack<>()),
                                   {.batch_size = 4, .shuffle = true, .seed = 5});
  trainer.fit(model, loader, volt::NoLoader{}, ckpt);
  std::ofstream out(record + ".rank" + std::to_string(trainer.strategy().global_rank()));
  for (const auto& [epoch, i] : model->seen) out << epoch << " " << i << "\n";
  return 0;
}

// resume index-fit <ranks> <dir> <record> <max_steps> [ckpt]
int index_fit(int ranks, const std::string& dir, const std::string& record, int64_t max_steps, const std::string& ckpt) {
  const volt::TrainerOptions o{.devices = ranks, .max_epochs = 2, .max_steps = max_steps};
  volt::ModelCheckpoint every_step({.dirpath = dir, .save_top_k = 0, .save_last = true, .every_n_train_steps = 1});
  if (ranks == 1) {
    auto t = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(o, every_step);
    return index_fit_with(t, record, ckpt);
  }
  auto t = volt::make_trainer<volt::DDP<volt::Script, volt::Mpi>, volt::Fp32, volt::CPU>(o, every_step);
  return index_fit_with(t, record, ckpt);
}

std::map<std::pair<int64_t, int64_t>, int> read_records(const std::string& prefix, int ranks) {
  std::map<std::pair<int64_t, int64_t>, int> count;
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(prefix + ".rank" + std::to_string(r));
    if (!in) fail("no record " + prefix + ".rank" + std::to_string(r));
    int64_t e = 0, i = 0;
    while (in >> e >> i) ++count[{e, i}];
  }
  return count;
}

// resume n-to-m <from> <to> <dir> -- <mpirun...>
int n_to_m(int from, int to, const std::string& dir, std::vector<std::string> mpirun) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto job = [&](int ranks, std::vector<std::string> args) {
    std::vector<std::string> cmd;
    if (ranks > 1) cmd = mpirun;
    cmd.push_back(self_exe());
    cmd.insert(cmd.end(), args.begin(), args.end());
    return run(cmd);
  };
  const int64_t per_epoch = 48 / (4 * from);
  const int64_t stop = per_epoch + 2;  // epoch 1, two batches in
  if (job(from, {"index-fit", std::to_string(from), dir + "/ckpt", dir + "/part1", std::to_string(stop)}) != 0) {
    fail("the first part failed");
  }
  if (job(to, {"index-fit", std::to_string(to), dir + "/ckpt", dir + "/part2", "-1", "last"}) != 0) {
    fail("the resumed part failed");
  }
  auto count = read_records(dir + "/part1", from);
  for (const auto& [k, n] : read_records(dir + "/part2", to)) count[k] += n;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    for (int64_t i = 0; i < 48; ++i) {
      const int n = count[{epoch, i}];
      if (n != 1) fail("epoch " + std::to_string(epoch) + ": sample " + std::to_string(i) + " seen " + std::to_string(n) + " times");
    }
  }
  if (count.size() != 96) fail("samples outside the data set were recorded");
  std::cout << "saved on " << from << " rank(s) in epoch 1, resumed on " << to
            << ": every sample of both epochs seen exactly once  match" << std::endl;
  return 0;
}

// ---- Python ---------------------------------------------------------------------------------------------

// resume export <dir>: trains the quick-start net briefly, writes its checkpoint, an input and its output.
int export_for_python(const std::string& dir) {
  fs::create_directories(dir);
  torch::manual_seed(3);
  auto x = torch::randn({64, 1, 28, 28});
  auto y = torch::randint(0, 10, {64});
  Net net(1);
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>({.max_epochs = 1});
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = 16}));
  trainer.save_checkpoint(dir + "/model.ckpt");
  net->eval();
  torch::NoGradGuard no_grad;
  const auto input = torch::randn({5, 1, 28, 28});
  auto io = volt::checkpoint::make_dict();
  io.insert("input", input);
  io.insert("output", net->forward(input));
  const auto bytes = torch::pickle_save(io);
  std::ofstream(dir + "/io.pt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::cout << "wrote " << dir << "/model.ckpt and " << dir << "/io.pt" << std::endl;
  return 0;
}

std::vector<std::string> after_dashes(int argc, char** argv) {
  std::vector<std::string> out;
  bool seen = false;
  for (int i = 1; i < argc; ++i) {
    if (seen) out.emplace_back(argv[i]);
    if (std::string(argv[i]) == "--") seen = true;
  }
  if (out.empty()) fail("give the mpirun command after --");
  return out;
}

}  // namespace

namespace {

/// The modes, by the name the command line (and so each CTest entry, `resume.<mode>`) gives: the driver modes
/// CTest runs, then the worker modes they start. `min_args` counts the words after the program's name.
struct Mode {
  const char* name;
  std::size_t min_args;
  const char* arguments;
  int (*run)(const std::vector<std::string>& a, int argc, char** argv);  // a[0] is the program
};
const Mode kModes[] = {
    {"sigkill", 2, "<dir> [rounds]", [](const std::vector<std::string>& a, int, char**) {
       return sigkill(a[2], a.size() > 3 ? std::stoi(a[3]) : 3);
     }},
    {"kill-mid-write", 2, "<dir> [rounds]", [](const std::vector<std::string>& a, int, char**) {
       return kill_mid_write(a[2], a.size() > 3 ? std::stoi(a[3]) : 8);
     }},
    {"ddp-exact", 2, "<dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return ddp_exact(a[2], after_dashes(argc, argv));
     }},
    {"spawn-exact", 2, "<dir>", [](const std::vector<std::string>& a, int, char**) { return spawn_exact(a[2]); }},
    {"n-to-m", 4, "<from> <to> <dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return n_to_m(std::stoi(a[2]), std::stoi(a[3]), a[4], after_dashes(argc, argv));
     }},
    {"export", 2, "<dir>", [](const std::vector<std::string>& a, int, char**) { return export_for_python(a[2]); }},
    // workers
    {"train", 3, "<dir> <out> [--resume]", [](const std::vector<std::string>& a, int, char**) {
       return train(a[2], a[3], a.size() > 4 && a[4] == "--resume");
     }},
    {"writer", 2, "<path>", [](const std::vector<std::string>& a, int, char**) { return writer(a[2]); }},
    {"ddp-fit", 3, "<dir> <out> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       return two_rank_fit<volt::Script>(a[2], a[3], a.size() > 4 ? a[4] : "");
     }},
    {"spawn-fit", 3, "<dir> <out> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       return two_rank_fit<volt::Spawn>(a[2], a[3], a.size() > 4 ? a[4] : "");
     }},
    {"index-fit", 5, "<ranks> <dir> <record> <max_steps> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       return index_fit(std::stoi(a[2]), a[3], a[4], std::stoll(a[5]), a.size() > 6 ? a[6] : "");
     }},
};

}  // namespace

int main(int argc, char** argv) try {
  const std::vector<std::string> a(argv, argv + argc);
  const std::string mode = a.size() > 1 ? a[1] : "";
  for (const Mode& m : kModes) {
    if (mode == m.name && a.size() >= m.min_args + 1) return m.run(a, argc, argv);
  }
  std::cerr << "resume: " << (mode.empty() ? std::string("no mode given") : "mode \"" + mode + "\" with these arguments")
            << " is not one of:\n";
  for (const Mode& m : kModes) std::cerr << "  resume " << m.name << " " << m.arguments << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "resume: " << e.what() << "\n";
  return 1;
}
