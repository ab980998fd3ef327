// Resuming in new processes. Each driver mode starts real processes (this program again, or mpirun) and
// checks their results against a reference run:
//   resume sigkill <dir> [rounds] [manual|workers|async|tokens]
//                                             a run killed with SIGKILL at a random step and resumed from its
//                                             last checkpoint ends bit-identical to an uninterrupted run (manual:
//                                             a module with manual optimization, two optimizers; workers: the
//                                             killed and resumed runs read with 3 loader workers, the
//                                             uninterrupted one without; tokens: nanoGPT's random windows of a
//                                             token file, drawn again alike after the resume)
//   resume kill-mid-write <dir> [rounds]      a writer killed at random moments always leaves a whole file
//   resume ddp-exact <dir> -- <mpirun...>     2 DDP ranks saved mid-epoch and resumed on 2: bit-identical
//   resume fsdp-exact <dir> -- <mpirun...>    the same under FSDP (inside a window: within 1e-6)
//   resume fsdp-sharded-exact <dir> -- <mpirun...>
//                                             the same with sharded checkpoints (folders of each rank's pieces)
//   resume sharded-kill <dir> [rounds] -- <mpirun...>
//                                             a rank SIGKILLed while a sharded checkpoint is written: every
//                                             checkpoint left reads, and the resume from last.ckpt is bit-identical
//   resume file-ops-kill <dir> -- <mpirun...>
//                                             rank zero SIGKILLed after each file operation of a save that writes
//                                             two sharded folders and deletes one, in turn: the job resumed from
//                                             "last" is bit-identical and leaves no temporary
//   resume spawn-exact <dir>                  the same with DDP<Spawn> workers
//   resume n-to-m <from> <to> <dir> -- <mpirun...>
//                                             saved on `from` ranks, resumed on `to`: every sample once, and
//                                             the epoch values logged with sync_dist those of every sample once
//   resume zero-resume <dir> -- <mpirun...>   a ZeRO checkpoint holds DDP's state at the same step; saved on 2
//                                             ranks it resumes on 1, on 4 and on 2, and a DDP one on 2 ZeRO ranks:
//                                             every sample once, the file's optimizer state, whole sync_dist values
//   resume fsdp-resume <dir> -- <mpirun...>   the same for FSDP saved on 4 ranks, resumed on 1, 2, 3 and 4 ranks
//                                             (4: the uninterrupted run's end, bit for bit); the same from the
//                                             same run's sharded checkpoint, and zero-resume's on 2 into FSDP on 3
//   resume signal <case> <dir> [-- <mpirun...>]
//                                             a run stopped by SIGTERM/SIGUSR1 (to the process, mpirun, one rank,
//                                             a Spawn main process) checkpoints, exits, and resumes bit-identical
//   resume export <dir>                       the quick-start net's checkpoint (full and weights-only), an input and
//                                             its output, and checkpoints of AdamW, Adam and SGD with the weights of
//                                             volt's next step, for test/torch_load_check.py
// and the worker modes they start: train, writer, ddp-fit, spawn-fit, index-fit, sig-fit.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "../examples/quickstart_net.hpp"
#include "support/models.hpp"
#include "support/proc.hpp"
#include "support/processes.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using vt::after_dashes;
using vt::Child;
using vt::capture;
using vt::fail;
using vt::identical;
using vt::run;
using vt::run_until;
using vt::self_exe;
using vt::start;
using vt::test_seed;
using vt::wait_for;

namespace {

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

/// Tiny with manual optimization: SGD steps `l1` every second batch, its gradients accumulated by hand over two
/// batches (so they are mid-sum in half the checkpoints), Adam steps `l2` on every batch; a scheduler each.
struct ManualTinyImpl : TinyImpl {
  static constexpr bool automatic_optimization = false;
  std::tuple<volt::OptimizerConfig, volt::OptimizerConfig> configure_optimizers() {
    auto first = std::make_shared<torch::optim::SGD>(l1->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto second = std::make_shared<torch::optim::Adam>(l2->parameters(), torch::optim::AdamOptions(5e-3));
    return {{first, std::make_shared<torch::optim::StepLR>(*first, 1, 0.9), volt::Interval::step, 2},
            {second, std::make_shared<torch::optim::StepLR>(*second, 1, 0.8)}};
  }
  void training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto opts = ctx.optimizers();
    auto loss = (l2(drop(torch::tanh(l1(b.data)))) - b.target).pow(2).mean();
    ctx.log("train_loss", loss, {.on_step = true, .on_epoch = true});
    if (ctx.batch_idx() % 2 == 0) opts[0].zero_grad();
    opts[1].zero_grad();
    ctx.manual_backward(loss);
    opts[1].step();
    if (ctx.batch_idx() % 2 == 1) opts[0].step();
  }
};
TORCH_MODULE(ManualTiny);

volt::data::TensorLoader tiny_data(bool shuffle = true, int workers = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto x = torch::randn({96, 6}, gen);
  auto y = x.sum(1, true).sin() + 0.05 * torch::randn({96, 1}, gen);
  return volt::data::TensorLoader(x, y, {.batch_size = 8, .shuffle = shuffle, .seed = 3, .num_workers = workers});
}

/// Tiny over windows of a token file: 6 ids in (scaled), the id after them out.
struct TokenTinyImpl : TinyImpl {
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    return TinyImpl::training_step({b.data.to(torch::kFloat32) / 500, b.target.slice(1, 5).to(torch::kFloat32) / 500},
                                   ctx);
  }
};
TORCH_MODULE(TokenTiny);

/// nanoGPT's random windows of 6 tokens from `file`, 96 an epoch: the generator of each window is (seed, epoch, window).
volt::data::TokenLoader token_data(const std::string& file, int workers = 0) {
  return volt::data::TokenLoader(volt::data::TokenFile(file),
                                 {.block_size = 6, .windows = volt::data::Windows::random, .windows_per_epoch = 96,
                                  .loader = {.batch_size = 8, .seed = 3, .num_workers = workers}});
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

// resume train <dir> <weights-out> [--resume] [--manual] [--workers] [--async]: one process, a checkpoint (last.ckpt)
// after every step; --workers: the loader reads with 3 worker threads; --async: ModelCheckpoint's asynchronous saves,
// of the latest step's file (the previous one deleted once the new one is in place) and last.ckpt.
template <class Model>
int train(const std::string& dir, const std::string& out, bool resume, int workers, bool async = false,
          const std::string& tokens = "") {
  torch::manual_seed(1);  // LibTorch seeds its generator differently in every process: the same initial weights
  Model model;
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>(
      {.max_epochs = 4, .deterministic = true, .seed = 7},
      volt::ModelCheckpoint({.dirpath = dir, .save_top_k = async ? 1 : 0, .save_last = true,
                             .every_n_train_steps = 1, .async_save = async}),
      StepPrinter{});
  if (tokens.empty()) {
    trainer.fit(model, tiny_data(true, workers), volt::NoLoader{}, resume ? "last" : "");
  } else {
    trainer.fit(model, token_data(tokens, workers), volt::NoLoader{}, resume ? "last" : "");
  }
  trainer.save_checkpoint(out, /*weights_only=*/true);
  return 0;
}

/// nanoGPT's kind of file: 3000 uint16 ids below 1000, from a fixed generator.
void write_tokens(const std::string& path) {
  fs::create_directories(fs::path(path).parent_path());
  std::mt19937 rng(5);
  std::vector<uint16_t> ids(3000);
  for (auto& id : ids) id = static_cast<uint16_t>(std::uniform_int_distribution<int>(0, 999)(rng));
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()),
                                               static_cast<std::streamsize>(ids.size() * sizeof(uint16_t)));
}

// resume sigkill <dir> [rounds] [manual|workers|async|tokens]: `tokens` trains on nanoGPT's random windows of a token
// file (volt::data::TokenLoader), so the resumed run must draw the windows the uninterrupted one drew; `manual` trains ManualTiny (72 optimizer steps) instead of Tiny
// (48); `workers` kills and resumes runs whose loader has 3 workers, against a reference without; `async` kills runs
// that save asynchronously (the kill lands in a write on the writer's thread as often as not): every checkpoint left
// in the folder reads, last.ckpt among them, and the resume from it ends bit-identical to a synchronous reference.
int sigkill(const std::string& dir, int rounds, const std::string& variant) {
  fs::remove_all(dir);
  const std::string ref = dir + "/reference.ckpt";
  const bool manual = variant == "manual";
  const std::vector<std::string> model = manual ? std::vector<std::string>{"--manual"} : std::vector<std::string>{};
  const std::string tokens = dir + "/tokens.bin";
  if (variant == "tokens") write_tokens(tokens);
  auto train_cmd = [&](std::vector<std::string> cmd) {
    cmd.insert(cmd.end(), model.begin(), model.end());
    if (variant == "tokens") cmd.insert(cmd.end(), {"--tokens", tokens});
    if (variant == "workers" && cmd[2] != dir + "/ref_run") cmd.push_back("--workers");
    if (variant == "async" && cmd[2] != dir + "/ref_run") cmd.push_back("--async");
    return cmd;
  };
  if (run(train_cmd({self_exe(), "train", dir + "/ref_run", ref})) != 0) fail("the reference run failed");
  std::mt19937 rng(test_seed("sigkill"));
  for (int r = 0; r < rounds; ++r) {
    const int64_t kill_at = std::uniform_int_distribution<int64_t>(1, manual ? 70 : 46)(rng);  // of 72 or 48 steps
    const std::string run_dir = dir + "/run" + std::to_string(r), out = dir + "/out" + std::to_string(r) + ".ckpt";
    const auto lag = std::chrono::microseconds(std::uniform_int_distribution<int>(0, 4000)(rng));
    int64_t printed = -1;  // the step whose "step N" line led to the kill
    const int status = run_until(train_cmd({self_exe(), "train", run_dir, out}), [&](const std::string& line) {
      // The first step at or past kill_at (manual optimization's two optimizers may step together, skipping a number).
      if (line.rfind("step ", 0) != 0 || std::stoll(line.substr(5)) < kill_at) return false;
      printed = std::stoll(line.substr(5));
      std::this_thread::sleep_for(lag);  // the kill lands anywhere in the next step or its checkpoint write
      return true;
    });
    if (status != -SIGKILL) fail("the run to kill ended with status " + std::to_string(status));
    // Every complete file reads (a temporary one may be left). A synchronous save is in place before "step N" is
    // printed (ModelCheckpoint's hook runs before StepPrinter's), so last.ckpt holds step N or later. An asynchronous
    // one may still be on the writer's thread when the kill lands: the files left hold earlier steps, or there is no
    // file at all when the first write had not finished (nothing written is nothing lost: "last" then starts from the
    // beginning). Either way the resume must end bit-identical to the reference.
    int files = 0;
    int64_t newest = 0;  // the highest step any checkpoint left holds (0: none)
    for (const auto& e : fs::directory_iterator(run_dir)) {
      if (e.path().extension() != ".ckpt") continue;
      const auto file = volt::checkpoint::read(e.path().string());
      newest = std::max(newest, file.at("loops").toGenericDict().at("global_step").toInt());
      ++files;
    }
    const bool has_last = fs::exists(run_dir + "/last.ckpt");
    if (variant != "async" && !has_last) {
      fail("round " + std::to_string(r) + ": no last.ckpt after a synchronous save of step " + std::to_string(printed));
    }
    const int64_t saved =
        has_last ? volt::checkpoint::read(run_dir + "/last.ckpt").at("loops").toGenericDict().at("global_step").toInt() : 0;
    if (variant != "async" && saved < printed) {
      fail("round " + std::to_string(r) + ": last.ckpt holds step " + std::to_string(saved) + ", but step " +
           std::to_string(printed) + " had been saved synchronously");
    }
    std::cout << "round " << r << ": killed after step " << printed << "; "
              << (files == 0 ? std::string("no checkpoint had been written yet (the resume starts from the beginning)")
                             : "its newest checkpoint holds step " + std::to_string(newest) +
                                   (has_last ? "" : " (no last.ckpt)"))
              << " (" << files << " checkpoint files, all read)" << std::endl;
    if (run(train_cmd({self_exe(), "train", run_dir, out, "--resume"})) != 0) fail("the resumed run failed");
    std::string why;
    if (!identical(ref, out, &why)) fail("round " + std::to_string(r) + ": " + why);
    std::cout << "round " << r << ": resumed with \"last\", weights bit-identical  match" << std::endl;
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
  std::mt19937 rng(test_seed("kill-mid-write"));
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

/// Writes a fit's final weights to `out`: from the calling process under Spawn (fit brought rank 0's weights back
/// here, and no rank is left to save with), else through the Trainer, on every rank.
template <bool spawned, class T>
void save_final_weights(T& trainer, torch::nn::Module& model, const std::string& out) {
  if constexpr (spawned) {
    auto d = volt::checkpoint::make_dict();
    d.insert("state_dict", volt::checkpoint::module_state(model));
    volt::checkpoint::save(out, d);
  } else {
    trainer.save_checkpoint(out, /*weights_only=*/true);
  }
}

// resume ddp-fit | spawn-fit <dir> <weights-out> [ckpt]: DDP on 2 ranks (under mpirun, or 2 Spawn workers),
// gradients accumulated over 2 batches, validation twice an epoch; checkpoints after every optimizer step
// (<dir>/step=N.ckpt) and after every validation (<dir>/val/..., some in the middle of an accumulation
// window); the final weights go to <weights-out> (from the calling process under Spawn).
// (fsdp-sharded-fit: FSDP writing sharded checkpoints, last.ckpt among them; each rank writes its pid to <dir>/pid.<rank>.)
// (fsdp-topk-fit: the same keeping the latest step=N.ckpt only, so that each save deletes the one before.)
template <class Launcher, class Strategy = volt::DDP<Launcher, volt::Mpi>>
int two_rank_fit(const std::string& dir, const std::string& out, const std::string& ckpt, bool sharded = false,
                 int64_t top_k = -1) {
  torch::manual_seed(1);
  Tiny model;
  auto trainer = volt::make_trainer<Strategy, volt::Fp32, volt::CPU>(
      {.devices = 2, .max_epochs = 3, .val_check_interval = 0.5, .accumulate_grad_batches = 2, .deterministic = true,
       .seed = 7},
      volt::ModelCheckpoint(
          {.dirpath = dir, .filename = "{step}", .save_top_k = top_k, .save_last = sharded, .every_n_train_steps = 1}),
      volt::ModelCheckpoint({.dirpath = dir + "/val", .save_top_k = top_k == 1 ? 0 : -1}));  // (top-k: none)
  if constexpr (requires { trainer.strategy().set_state_dict_type(volt::StateDictType::sharded); }) {
    if (sharded) {
      trainer.strategy().set_state_dict_type(volt::StateDictType::sharded);
      fs::create_directories(dir);
      const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
      std::ofstream(dir + "/pid." + std::string(rank ? rank : "0")) << ::getpid() << "\n";
    }
  }
  auto val = tiny_data();
  trainer.fit(model, tiny_data(), val, ckpt);
  save_final_weights<std::is_same_v<Launcher, volt::Spawn>>(trainer, *model, out);
  return 0;
}

// resume ddp-exact <dir> -- <mpirun...> (`worker` fsdp-fit: FSDP, whose windows' micro-batches are each
// reduce-scattered: a checkpoint inside a window holds their average, and the resumed ranks' sums associate otherwise
// than the uninterrupted run's, so that one ends within 1e-6 of it; the others bit-identical)
int ddp_exact(const std::string& dir, const std::vector<std::string>& mpirun, const std::string& worker = "ddp-fit") {
  fs::remove_all(dir);
  auto job = [&](std::vector<std::string> args) {
    std::vector<std::string> cmd = mpirun;
    cmd.push_back(self_exe());
    cmd.insert(cmd.end(), args.begin(), args.end());
    return run(cmd);
  };
  const std::string ref = dir + "/reference.ckpt";
  if (job({worker, dir + "/a", ref}) != 0) fail("the uninterrupted 2-rank run failed");
  // 6 batches a rank and 3 steps an epoch: step 4 ends epoch 1's second batch; its validation after the third
  // batch is saved with that batch's gradients waiting for the fourth.
  const std::string mid_window = dir + "/a/val/epoch=1-step=4.ckpt";
  if (volt::checkpoint::read(mid_window).at("accumulated_grads").toListRef().empty()) {
    fail(mid_window + " holds no accumulated gradients; it was meant to be saved inside an accumulation window");
  }
  int n = 0;
  for (const std::string& from : {dir + "/a/step=2.ckpt", dir + "/a/step=4.ckpt", mid_window}) {
    const std::string out = dir + "/out" + std::to_string(n) + ".ckpt";
    if (job({worker, dir + "/b" + std::to_string(n++), out, from}) != 0) fail("the resumed 2-rank run failed");
    std::string why;
    if (worker != "ddp-fit" && from == mid_window) {
      const auto a = volt::checkpoint::read(ref).at("state_dict").toGenericDict();
      const auto b = volt::checkpoint::read(out).at("state_dict").toGenericDict();
      double most = 0;
      for (const auto& e : a) {
        most = std::max(most, (e.value().toTensor() - b.at(e.key()).toTensor()).abs().max().item<double>());
      }
      if (!(most <= 1e-6)) fail("MISMATCH: resumed from " + from + ": max |weights - uninterrupted| " + std::to_string(most));
      std::cout << "resumed inside a window: max |weights - uninterrupted| = " << most << "  match" << std::endl;
      continue;
    }
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

/// Records which samples each rank trains on, per epoch, as it trains on them: a line "epoch sample step" in
/// `<record>.rank<R>` (flushed at once, so that a rank killed keeps what it saw); sleeps `delay_ms` after each batch.
struct IndexModelImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  std::string record;
  int delay_ms = 0;
  std::ofstream out;
  IndexModelImpl() { lin = register_module("lin", torch::nn::Linear(2, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    if (!record.empty() && !out.is_open()) out.open(record + ".rank" + std::to_string(ctx.global_rank()));
    for (int64_t i = 0; i < b.target.size(0); ++i) {
      if (out.is_open()) out << ctx.current_epoch() << " " << b.target[i].item<int64_t>() << " " << ctx.global_step() << "\n";
    }
    out.flush();
    // Epoch values across ranks: every sample once an epoch gives 48 samples, indices summing to 1128, at most 47, a
    // mean of 23.5 (weighted by batch size); a resume must not lose the sums other ranks held.
    const torch::Tensor idx = b.target.to(torch::kFloat64);
    const volt::LogOptions epoch{.on_step = false, .on_epoch = true, .reduce = volt::Reduce::sum, .sync_dist = true};
    ctx.log("seen", static_cast<double>(b.target.size(0)), epoch);
    ctx.log("index_sum", idx.sum(), epoch);
    ctx.log("index_max", idx.max(), {.on_step = false, .on_epoch = true, .reduce = volt::Reduce::max, .sync_dist = true});
    ctx.log("index_mean", idx.mean(), {.on_step = false, .on_epoch = true, .sync_dist = true});
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    return lin(b.data * torch::tensor({1.0f, -0.5f}) / 48.0).pow(2).mean();  // the two weights' gradients differ
  }
  torch::optim::Adam configure_optimizers() { return torch::optim::Adam(parameters(), torch::optim::AdamOptions(0.01)); }
};
TORCH_MODULE(IndexModel);

/// Saves a checkpoint as the training starts (after a resume has loaded everything): what the run made of the file.
struct SaveAtStart {
  std::string path;
  template <class T, class M>
  void on_train_start(T& trainer, M&) {
    if (!path.empty()) trainer.save_checkpoint(path);
  }
};

/// Rank zero appends each training epoch's values to `path`: "epoch seen index_sum index_max index_mean".
struct EpochValues {
  std::string path;
  template <class T, class M>
  void on_train_epoch_end(T& trainer, M&) {
    if (!trainer.is_global_zero()) return;
    const auto v = trainer.callback_metric_values();
    std::ofstream(path, std::ios::app) << trainer.current_epoch() << " " << v.at("seen") << " " << v.at("index_sum")
                                       << " " << v.at("index_max") << " " << v.at("index_mean") << "\n";
  }
};

/// Fails unless the epoch values `record` (EpochValues) holds for `epoch` are those of every sample seen once.
void check_epoch_values(const std::string& record, int64_t epoch, const std::string& what) {
  std::ifstream in(record);
  int64_t e = 0;
  double seen = 0, sum = 0, max = 0, mean = 0;
  while (in >> e >> seen >> sum >> max >> mean) {
    if (e != epoch) continue;
    if (seen != 48 || sum != 1128 || max != 47 || mean != 23.5) {
      std::ostringstream d;
      d << what << ": epoch " << epoch << " logged seen " << seen << ", index_sum " << sum
        << ", index_max " << max << ", index_mean " << mean << " (sync_dist; every sample once: 48, 1128, 47, 23.5)";
      fail(d.str());
    }
    std::cout << what << ": epoch " << epoch << "'s sync_dist values are every sample's once  match" << std::endl;
    return;
  }
  fail(what + ": " + record + " has no values of epoch " + std::to_string(epoch));
}

template <class Trainer>
int index_fit_with(Trainer& trainer, const std::string& record, const std::string& ckpt) {
  torch::manual_seed(7);  // the same first weights in every run (the strategies' runs are compared)
  IndexModel model;
  model->record = record;
  if (const char* delay = std::getenv("VOLT_TEST_DELAY_MS")) model->delay_ms = std::atoi(delay);
  volt::data::DatasetLoader loader(vt::IndexDataset(48).map(torch::data::transforms::Stack<>()),
                                   {.batch_size = 4, .shuffle = true, .seed = 5});
  trainer.fit(model, loader, volt::NoLoader{}, ckpt);
  return 0;
}

// resume index-fit <ddp|zero1|zero2|fsdp> <ranks> <dir> <record> <max_steps> [ckpt]: one rank runs SingleDevice; a resumed
// run saves <record>.start.ckpt as its training starts. The ranks span VOLT_TEST_NODES hosts where that is set.
int index_fit(const std::string& strategy, int ranks, const std::string& dir, const std::string& record,
              int64_t max_steps, const std::string& ckpt) {
  const int nodes = ranks > 1 && std::getenv("VOLT_TEST_NODES") ? std::atoi(std::getenv("VOLT_TEST_NODES")) : 1;
  const volt::TrainerOptions o{.devices = ranks / nodes, .num_nodes = nodes, .max_epochs = 2, .max_steps = max_steps};
  volt::ModelCheckpoint every_step({.dirpath = dir, .save_top_k = 0, .save_last = true, .every_n_train_steps = 1});
  const SaveAtStart start{ckpt.empty() ? std::string() : record + ".start.ckpt"};
  const bool sharded = strategy.ends_with("-sharded");  // its checkpoints in the sharded form
  auto with = [&]<class S>(S*) {
    auto t = volt::make_trainer<S, volt::Fp32, volt::CPU>(o, every_step, start, EpochValues{record + ".epochs"});
    if constexpr (requires { t.strategy().set_bucket_bytes(64, 64); }) t.strategy().set_bucket_bytes(8, 8);  // 2 buckets
    if constexpr (requires { t.strategy().set_state_dict_type(volt::StateDictType::sharded); }) {
      if (sharded) t.strategy().set_state_dict_type(volt::StateDictType::sharded);
    }
    return index_fit_with(t, record, ckpt);
  };
  if (ranks == 1) return with(static_cast<volt::SingleDevice*>(nullptr));
  if (strategy == "zero1") return with(static_cast<volt::ZeRO<1, volt::Script, volt::Mpi>*>(nullptr));
  if (strategy == "zero2") return with(static_cast<volt::ZeRO<2, volt::Script, volt::Mpi>*>(nullptr));
  if (strategy.starts_with("fsdp")) return with(static_cast<volt::FSDP<volt::Script, volt::Mpi>*>(nullptr));
  if (strategy == "zero2-sharded") return with(static_cast<volt::ZeRO<2, volt::Script, volt::Mpi>*>(nullptr));
  return with(static_cast<volt::DDP<volt::Script, volt::Mpi>*>(nullptr));
}

/// How often each (epoch, sample) was trained on by the `ranks` ranks whose records start with `prefix`, counting only
/// the batches before optimizer step `before` (all when -1).
std::map<std::pair<int64_t, int64_t>, int> read_records(const std::string& prefix, int ranks, int64_t before = -1) {
  std::map<std::pair<int64_t, int64_t>, int> count;
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(prefix + ".rank" + std::to_string(r));
    if (!in) fail("no record " + prefix + ".rank" + std::to_string(r));
    int64_t e = 0, i = 0, step = 0;
    while (in >> e >> i >> step) {
      if (before < 0 || step < before) ++count[{e, i}];
    }
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
  if (job(from, {"index-fit", "ddp", std::to_string(from), dir + "/ckpt", dir + "/part1", std::to_string(stop)}) != 0) {
    fail("the first part failed");
  }
  if (job(to, {"index-fit", "ddp", std::to_string(to), dir + "/ckpt", dir + "/part2", "-1", "last"}) != 0) {
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
  check_epoch_values(dir + "/part1.epochs", 0, "the first part");
  check_epoch_values(dir + "/part2.epochs", 1, "resumed on " + std::to_string(to));
  std::cout << "saved on " << from << " rank(s) in epoch 1, resumed on " << to
            << ": every sample of both epochs seen exactly once  match" << std::endl;
  return 0;
}

/// The Adam state in checkpoint `path`, read by a one-process optimizer: per parameter, its step and its moments
/// flattened, in parameter order.
std::pair<std::vector<int64_t>, torch::Tensor> adam_state(const std::string& path) {
  IndexModelImpl model;
  torch::optim::Adam adam(model.parameters(), torch::optim::AdamOptions(0.01));
  const auto file = volt::checkpoint::read(path);
  volt::checkpoint::load_optimizer_state(adam, file.at(volt::checkpoint::keys::optimizer_states).toListRef()[0].toTensor(),
                                         path);
  std::vector<int64_t> steps;
  std::vector<torch::Tensor> moments;
  for (const auto& p : model.parameters()) {
    const auto it = adam.state().find(volt::optim::detail::state_key(adam.state(), p.unsafeGetTensorImpl()));
    if (it == adam.state().end()) fail(path + ": no Adam state for a parameter");
    const auto& st = static_cast<const torch::optim::AdamParamState&>(*it->second);
    steps.push_back(st.step());
    moments.push_back(st.exp_avg().flatten());
    moments.push_back(st.exp_avg_sq().flatten());
  }
  return {steps, torch::cat(moments)};
}

torch::Tensor weights_in(const std::string& path) {
  std::vector<torch::Tensor> w;
  for (const auto& e : volt::checkpoint::read(path).at(volt::checkpoint::keys::state_dict).toGenericDict()) {
    w.push_back(e.value().toTensor().flatten());
  }
  return torch::cat(w);
}

// resume zero-resume <dir> -- <mpirun...>
// ZeRO<2> and DDP on 2 ranks stop at the same step of epoch 1: the sharded checkpoint holds the unsharded run's
// weights and Adam state (the layout of one process, read by one). Then it resumes on 1 rank, on 4 (ZeRO<1>), and
// a DDP checkpoint on 2 ZeRO<2> ranks: every sample of both epochs seen once, and the state each run made of the
// file (saved as its training starts) is the file's.
// resume fsdp-resume <dir> -- <mpirun...>
// The same for FSDP saved on 4 ranks (its parameters gathered unit by unit into the file): resumed on 1 rank, on 2
// and 3 FSDP ranks, and on 4, where it must end on the uninterrupted FSDP run's weights and Adam state, bit for bit.
struct ResumeCase {
  const char* name;
  const char* strategy;
  int ranks;
  const char* from;
  /// Every sample once; false where the epoch's rest does not divide by the new world size (the 16 samples left on 3
  /// ranks are padded to 18, as DistributedSampler pads: DDP repeats the same 2).
  bool once = true;
};
int sharded_resume(const std::string& dir, std::vector<std::string> mpirun, const std::string& sharded, int ranks,
                   const std::vector<ResumeCase>& cases) {
  const bool both_forms = std::any_of(cases.begin(), cases.end(), [](const ResumeCase& c) { return c.from == std::string("zs"); });
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto job = [&](int n, std::vector<std::string> args) {
    std::vector<std::string> cmd;
    if (n > 1) {
      cmd = mpirun;
      const auto np = std::find(cmd.begin(), cmd.end(), "-np");  // the command given runs 2
      if (np == cmd.end() || np + 1 == cmd.end()) fail("the mpirun command given has no -np N");
      *(np + 1) = std::to_string(n);
    }
    cmd.push_back(self_exe());
    cmd.insert(cmd.end(), args.begin(), args.end());
    if (run(cmd) != 0) fail("the run failed: index-fit " + args[0] + " on " + std::to_string(n) + " rank(s)");
  };
  const std::string stop = std::to_string(48 / (4 * ranks) + 2);  // epoch 1, two batches in
  const std::string r = std::to_string(ranks);
  job(ranks, {"index-fit", sharded, r, dir + "/z", dir + "/z_part1", stop});
  job(ranks, {"index-fit", "ddp", r, dir + "/d", dir + "/d_part1", stop});
  const auto [z_steps, z_moments] = adam_state(dir + "/z/last.ckpt");
  const auto [d_steps, d_moments] = adam_state(dir + "/d/last.ckpt");
  if (z_steps != d_steps || !torch::allclose(z_moments, d_moments, 1e-5, 1e-7) ||
      !torch::allclose(weights_in(dir + "/z/last.ckpt"), weights_in(dir + "/d/last.ckpt"), 1e-5, 1e-7)) {
    std::ostringstream d;
    d << "steps";
    for (std::size_t i = 0; i < z_steps.size(); ++i) d << " " << z_steps[i] << "/" << d_steps[i];
    d << "; moments " << z_moments << " vs " << d_moments << "; weights " << weights_in(dir + "/z/last.ckpt") << " vs "
      << weights_in(dir + "/d/last.ckpt");
    fail("MISMATCH: the " + sharded + " checkpoint's weights or Adam state differ from DDP's at the same step: " + d.str());
  }
  if (both_forms) {  // the same run writing sharded checkpoints ("zs"): every tensor the full file's, bit for bit
    job(ranks, {"index-fit", sharded + "-sharded", r, dir + "/zs", dir + "/zs_part1", stop});
    if (!volt::checkpoint::is_sharded(dir + "/zs/last.ckpt")) fail(dir + "/zs/last.ckpt is not a sharded checkpoint");
    const auto [s_steps, s_moments] = adam_state(dir + "/zs/last.ckpt");
    if (s_steps != z_steps || !torch::equal(s_moments, z_moments) ||
        !torch::equal(weights_in(dir + "/zs/last.ckpt"), weights_in(dir + "/z/last.ckpt"))) {
      fail("MISMATCH: the sharded form's weights or Adam state differ from the full file's of the same run");
    }
    std::cout << sharded << " on " << ranks << ": the sharded form holds the full file's weights and Adam state, bit "
              << "for bit  match" << std::endl;
  }
  for (const ResumeCase& c : cases) {
    const std::string part2 = dir + "/" + c.strategy + std::to_string(c.ranks) + "_from_" + c.from;
    job(c.ranks, {"index-fit", c.strategy, std::to_string(c.ranks), part2 + "_ckpt", part2, "-1",
                  dir + "/" + c.from + "/last.ckpt"});
    auto count = read_records(dir + "/" + c.from + "_part1", ranks);
    for (const auto& [k, n] : read_records(part2, c.ranks)) count[k] += n;
    for (int64_t epoch = 0; epoch < 2 && c.once; ++epoch) {
      for (int64_t i = 0; i < 48; ++i) {
        if (count[{epoch, i}] != 1) fail(std::string(c.name) + ": epoch " + std::to_string(epoch) + " sample " + std::to_string(i) + " seen " + std::to_string(count[{epoch, i}]) + " times");
      }
    }
    if (c.once) check_epoch_values(part2 + ".epochs", 1, c.name);
    const auto [from_steps, from_moments] = adam_state(dir + "/" + c.from + "/last.ckpt");
    const auto [got_steps, got_moments] = adam_state(part2 + ".start.ckpt");
    if (from_steps != got_steps || !torch::equal(from_moments, got_moments)) {
      fail(std::string("MISMATCH: ") + c.name + ": the resumed run's Adam state is not the file's");
    }
    if (c.strategy == sharded && c.ranks == ranks) {  // the same layout: the uninterrupted run's end, bit for bit
      if (!fs::exists(dir + "/whole_ckpt/last.ckpt")) job(ranks, {"index-fit", sharded, r, dir + "/whole_ckpt", dir + "/whole", "-1"});
      const auto [w_steps, w_moments] = adam_state(dir + "/whole_ckpt/last.ckpt");
      const auto [e_steps, e_moments] = adam_state(part2 + "_ckpt/last.ckpt");
      if (!torch::equal(weights_in(dir + "/whole_ckpt/last.ckpt"), weights_in(part2 + "_ckpt/last.ckpt")) ||
          w_steps != e_steps || !torch::equal(w_moments, e_moments)) {
        fail(std::string("MISMATCH: ") + c.name + ": the resumed run ends elsewhere than the uninterrupted one");
      }
    }
    std::cout << c.name << (c.once ? ": every sample once," : ":") << " the file's Adam state  match" << std::endl;
  }
  return 0;
}
int zero_resume(const std::string& dir, std::vector<std::string> mpirun) {
  return sharded_resume(dir, std::move(mpirun), "zero2", 2,
                        {{"zero2 on 2 -> 1 rank", "ddp", 1, "z"}, {"zero2 on 2 -> zero1 on 4", "zero1", 4, "z"},
                         {"ddp on 2 -> zero2 on 2", "zero2", 2, "d"}, {"zero2 on 2 -> zero2 on 2", "zero2", 2, "z"},
                         {"zero2 on 2, sharded form -> fsdp on 3", "fsdp", 3, "zs", false}});
}
int fsdp_resume(const std::string& dir, std::vector<std::string> mpirun) {
  return sharded_resume(dir, std::move(mpirun), "fsdp", 4,
                        {{"fsdp on 4 -> 1 rank", "ddp", 1, "z"}, {"fsdp on 4 -> fsdp on 2", "fsdp", 2, "z"},
                         {"fsdp on 4 -> fsdp on 3", "fsdp", 3, "z", false}, {"ddp on 4 -> fsdp on 2", "fsdp", 2, "d"},
                         {"fsdp on 4 -> fsdp on 4", "fsdp", 4, "z"},
                         {"fsdp on 4, sharded form -> 1 rank", "ddp", 1, "zs"},
                         {"fsdp on 4, sharded form -> fsdp on 2", "fsdp", 2, "zs"},
                         {"fsdp on 4, sharded form -> fsdp on 3", "fsdp", 3, "zs", false},
                         {"fsdp on 4, sharded form -> ddp on 2", "ddp", 2, "zs"},
                         {"fsdp on 4, sharded form -> fsdp on 4", "fsdp", 4, "zs"}});
}

// resume sharded-kill <dir> [rounds] -- <mpirun...>
// FSDP on 2 ranks writes sharded checkpoints (step=N.ckpt and last.ckpt, folders) after every step; one of its ranks
// is SIGKILLed as a save's temporary folder appears (at a random step, 0-0.4 ms after it is seen, the rank chosen
// in turn). Every checkpoint left reads whole (the index, each rank's file's size and CRC, every tensor covered), a
// temporary folder is all a save cut short leaves, and the run resumed from last.ckpt ends on the uninterrupted
// run's weights, bit for bit.
int sharded_kill(const std::string& dir, int rounds, const std::vector<std::string>& mpirun) {
  fs::remove_all(dir);
  auto cmd = [&](std::vector<std::string> args) {
    std::vector<std::string> c = mpirun;
    c.push_back(self_exe());
    c.insert(c.end(), args.begin(), args.end());
    return c;
  };
  const std::string ref = dir + "/reference.ckpt";
  if (run(cmd({"fsdp-sharded-fit", dir + "/ref_run", ref})) != 0) fail("the uninterrupted run failed");
  std::mt19937 rng(test_seed("sharded-kill"));
  int cut_short = 0;
  for (int r = 0; r < rounds; ++r) {
    const std::string run_dir = dir + "/run" + std::to_string(r), out = dir + "/out" + std::to_string(r) + ".ckpt";
    const int after = std::uniform_int_distribution<int>(1, 7)(rng);  // of 9 steps: killed in step after + 1's save
    const Child job = start(cmd({"fsdp-sharded-fit", run_dir, out}), false);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    const std::string next = "step=" + std::to_string(after + 1) + ".ckpt.tmp.";  // the next save's start
    std::string temporary;
    while (temporary.empty() && std::chrono::steady_clock::now() < deadline) {
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(run_dir, ec)) {
        if (e.path().filename().string().rfind(next, 0) == 0) temporary = e.path().string();
      }
      if (temporary.empty()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (temporary.empty()) fail("round " + std::to_string(r) + ": no save was seen after step " + std::to_string(after));
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 400)(rng)));
    const int victim = r % 2;
    std::ifstream pid_file(run_dir + "/pid." + std::to_string(victim));
    pid_t pid = 0;
    if (!(pid_file >> pid) || pid <= 0) fail("no pid file for rank " + std::to_string(victim));
    ::kill(pid, SIGKILL);
    wait_for(job);
    const bool left = fs::exists(temporary);
    cut_short += left;
    int read = 0;
    for (const std::string& folder : {run_dir, run_dir + "/val"}) {
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(folder, ec)) {
        if (e.path().extension() != ".ckpt") continue;
        (void)volt::checkpoint::read(e.path().string());  // throws on anything torn
        ++read;
      }
    }
    const auto last = volt::checkpoint::read(run_dir + "/last.ckpt");
    const int64_t step = last.at("loops").toGenericDict().at("global_step").toInt();
    std::cout << "round " << r << ": rank " << victim << " killed " << (left ? "inside" : "after") << " a save after step "
              << after << "; " << read << " checkpoints read whole, last.ckpt at step " << step << std::endl;
    // (a save writes step=N.ckpt, then last.ckpt: the kill may land between the two)
    if (step < after - 1) fail("round " + std::to_string(r) + ": last.ckpt holds step " + std::to_string(step));
    if (run(cmd({"fsdp-sharded-fit", run_dir + "_resumed", out, run_dir + "/last.ckpt"})) != 0) {
      fail("round " + std::to_string(r) + ": the run resumed from last.ckpt failed");
    }
    std::string why;
    if (!identical(ref, out, &why)) fail("MISMATCH: round " + std::to_string(r) + ": " + why);
    std::cout << "round " << r << ": resumed from last.ckpt, weights bit-identical  match" << std::endl;
  }
  std::cout << cut_short << " of " << rounds << " kills landed inside a save" << std::endl;
  return 0;
}

// resume file-ops-kill <dir> -- <mpirun...>
// FSDP on 2 ranks writes sharded checkpoints after every step, keeping the latest step=N.ckpt and last.ckpt (so each
// save writes two folders and deletes one; no validation checkpoints). Rank zero is SIGKILLed after its n-th file operation counted from step 4's
// save (VOLT_TEST_KILL_AFTER_FILE_OPS: files.hpp's test-only injection), for n = 1, 2, ... until the kill lands in step
// 5's save: after each, the job resumed in the same folder with fit(..., "last") ends on the uninterrupted run's
// weights, bit for bit, and no temporary the kill left outlives its saves.
int file_ops_kill(const std::string& dir, const std::vector<std::string>& mpirun) {
  fs::remove_all(dir);
  auto cmd = [&](std::vector<std::string> args, bool injected) {
    std::vector<std::string> c = mpirun;
    if (injected) c.insert(c.begin() + 1, {"-x", "VOLT_TEST_KILL_AFTER_FILE_OPS"});
    c.push_back(self_exe());
    c.insert(c.end(), args.begin(), args.end());
    return c;
  };
  const std::string ref = dir + "/reference.ckpt";
  if (run(cmd({"fsdp-topk-fit", dir + "/ref_run", ref}, false)) != 0) fail("the uninterrupted run failed");
  const auto entries = [](const std::string& folder, const std::string& part) {
    std::vector<std::string> found;
    std::error_code ec;
    for (const auto& e : fs::recursive_directory_iterator(folder, ec)) {
      if (e.path().filename().string().find(part) != std::string::npos) found.push_back(e.path().string());
    }
    return found;
  };
  int n = 1;
  for (; n <= 80; ++n) {
    const std::string run_dir = dir + "/run" + std::to_string(n), out = dir + "/out" + std::to_string(n) + ".ckpt";
    const int status = run(cmd({"fsdp-topk-fit", run_dir, out}, true),
                           {"VOLT_TEST_KILL_AFTER_FILE_OPS=/step=4.ckpt:" + std::to_string(n)});
    if (status == 0) fail("the job with a kill after file operation " + std::to_string(n) + " was not killed");
    const bool past = !entries(run_dir, "step=5.ckpt").empty();  // the kill landed in step 5's save: done
    const std::size_t left = entries(run_dir, ".tmp.").size();
    for (const auto& e : fs::directory_iterator(run_dir)) {  // every checkpoint the kill left reads whole
      if (e.path().extension() == ".ckpt") (void)volt::checkpoint::read(e.path().string());
    }
    if (run(cmd({"fsdp-topk-fit", run_dir, out, "last"}, false)) != 0) {
      fail("after a kill at file operation " + std::to_string(n) + ": the job resumed from \"last\" failed");
    }
    std::string why;
    if (!identical(ref, out, &why)) fail("MISMATCH: killed after file operation " + std::to_string(n) + ": " + why);
    const auto stale = entries(run_dir, ".tmp.");
    if (!stale.empty()) fail("after the resumed job, a temporary is left: " + stale.front());
    std::cout << "killed after file operation " << n << " of step 4's save (" << left << " temporaries left): "
              << "resumed from \"last\", weights bit-identical, nothing left behind  match" << std::endl;
    fs::remove_all(run_dir);
    if (past) break;
  }
  if (n < 8 || n > 80) fail("step 4's save took " + std::to_string(n) + " file operations; expected 8 to 80");
  std::cout << "a kill after each of step 4's " << n - 1 << " file operations resumed bit-identical" << std::endl;
  return 0;
}

// ---- stop signals ---------------------------------------------------------------------------------------------

/// Rank zero writes the step to <dir>/progress after each training batch, then every rank sleeps `delay_ms`, so
/// that a signal sent after step K lands in a running fit; each rank writes its pid to <dir>/pid.<rank>.
struct Pacer {
  std::string dir;
  int delay_ms = 0;
  template <class T, class M>
  void on_fit_start(T& trainer, M&) {
    std::ofstream(dir + "/pid." + std::to_string(trainer.strategy().global_rank())) << ::getpid() << "\n";
  }
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (trainer.is_global_zero()) {
      std::ofstream(dir + "/progress.tmp") << trainer.global_step() << "\n";
      fs::rename(dir + "/progress.tmp", dir + "/progress");
    }
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  }
};

// resume sig-fit single|ddp|spawn <dir> <weights-out> <delay_ms> [ckpt]: the Tiny fit on one process, on 2 DDP
// ranks (under mpirun) or on 2 Spawn workers, validating twice an epoch, a CSVLogger row every step, the default
// ModelCheckpoint in <dir>/ckpt; the final weights go to <weights-out>. SignalOptions::scontrol is VOLT_TEST_SCONTROL
// where that is set; the 2 DDP ranks span VOLT_TEST_NODES hosts where that is set.
template <class S>
int sig_fit(const std::string& dir, const std::string& out, int delay_ms, const std::string& ckpt) {
  fs::create_directories(dir);
  torch::manual_seed(1);
  Tiny model;
  volt::SignalOptions signals;
  if (const char* stand_in = std::getenv("VOLT_TEST_SCONTROL")) signals.scontrol = stand_in;
  const int nodes = S::is_distributed && std::getenv("VOLT_TEST_NODES") ? std::atoi(std::getenv("VOLT_TEST_NODES")) : 1;
  auto trainer = volt::make_trainer<S, volt::Fp32, volt::CPU>(
      {.devices = S::is_distributed ? 2 / nodes : 1, .num_nodes = nodes, .max_epochs = 4, .val_check_interval = 0.5,
       .deterministic = true, .seed = 7, .log_every_n_steps = 1, .default_root_dir = dir, .signals = signals},
      volt::ModelCheckpoint({.dirpath = dir + "/ckpt"}), volt::CSVLogger({.name = "logs"}), Pacer{dir, delay_ms});
  auto val = tiny_data(/*shuffle=*/false);  // the same order in every validation, so resumed means sum alike
  trainer.fit(model, tiny_data(), val, ckpt);
  save_final_weights<std::is_same_v<S, volt::DDP<volt::Spawn, volt::Mpi>>>(trainer, *model, out);
  return 0;
}

int64_t read_number(const std::string& file) {
  std::ifstream in(file);
  int64_t v = -1;
  in >> v;
  return v;
}

// resume signal single|mpirun-term|usr1-one-rank|spawn <dir> [-- <mpirun...>]: an uninterrupted reference run,
// then the same run stopped by a signal after a random step (SIGTERM to the process, to mpirun or to the Spawn
// main process; SIGUSR1 to rank 1 alone), then resumed with "last": the weights must be bit-identical to the
// reference's and the metric rows of both parts together the reference's rows. SLURM_JOB_ID is set with a
// stand-in `scontrol` (SignalOptions::scontrol, through VOLT_TEST_SCONTROL: not PATH, which mpirun started by its full
// path puts its own folder first in, where SLURM's scontrol may be) where the signal requeues (single: SIGTERM;
// usr1-one-rank: SIGUSR1): it must be called once, by rank zero. `single` also sends a second signal to a fresh run:
// it must end at once.
int signal_case(const std::string& kase, const std::string& dir, const std::vector<std::string>& mpirun) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string launcher = kase == "single" ? "single" : kase == "spawn" ? "spawn" : "ddp";
  auto cmd = [&](std::vector<std::string> args) {
    std::vector<std::string> c;
    if (launcher == "ddp") c = mpirun;
    c.push_back(self_exe());
    c.push_back("sig-fit");
    c.push_back(launcher);
    c.insert(c.end(), args.begin(), args.end());
    return c;
  };
  const int sig = kase == "usr1-one-rank" ? SIGUSR1 : SIGTERM;
  const bool requeues = kase == "single" || kase == "usr1-one-rank";
  const std::string bin = dir + "/bin", requeued = dir + "/requeued";
  fs::create_directories(bin);
  // SLURM signals every process of a job step, and the signal can reach rank zero's host after the ranks agreed on
  // another's (usr1-one-rank: rank 1's): the stand-in is sent the stop signal too before it writes, as scontrol is.
  std::ofstream(bin + "/scontrol") << "#!/bin/sh\nkill -s " << volt::cluster::signal_name(sig).substr(3)
                                   << " $$\necho \"$@\" >> '" << requeued << "'\n";
  fs::permissions(bin + "/scontrol", fs::perms::owner_all);
  std::vector<std::string> env;
  if (requeues) env = {"VOLT_TEST_SCONTROL=" + bin + "/scontrol", "SLURM_JOB_ID=4242"};

  if (run(cmd({dir + "/ref", dir + "/ref.ckpt", "0"})) != 0) fail("the uninterrupted run failed");
  const int64_t steps = launcher == "single" ? 48 : 24;
  std::mt19937 rng(test_seed(("signal " + kase).c_str()));
  // mpirun passes SIGTERM on to the ranks some hundreds of milliseconds later: slower steps keep the run going
  const bool slow = kase == "mpirun-term";
  const std::string delay = slow ? "200" : "40";
  const int64_t after = std::uniform_int_distribution<int64_t>(2, steps - (slow ? 8 : 4))(rng);

  const std::string run_dir = dir + "/run";
  fs::create_directories(run_dir);
  std::cout << "$ (signal " << volt::cluster::signal_name(sig) << " after step " << after << ")";
  for (const auto& a : cmd({run_dir, dir + "/unused.ckpt", delay})) std::cout << " " << a;
  std::cout << std::endl;
  const Child child = start(cmd({run_dir, dir + "/unused.ckpt", delay}), false, env);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (read_number(run_dir + "/progress") < after) {
    int status = 0;
    if (::waitpid(child.pid, &status, WNOHANG) == child.pid) fail("the run ended before step " + std::to_string(after));
    if (std::chrono::steady_clock::now() > deadline) fail("the run did not reach step " + std::to_string(after));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  pid_t target = child.pid;
  if (kase == "usr1-one-rank") target = static_cast<pid_t>(read_number(run_dir + "/pid.1"));
  if (target <= 0) fail("no pid to signal");
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(target, sig);
  const int status = wait_for(child);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  const std::string ckpt = run_dir + "/ckpt/interrupted.ckpt";
  if (!fs::exists(ckpt)) fail(kase + ": no " + ckpt + " after the signal (exit status " + std::to_string(status) + ")");
  if ((launcher == "single" || launcher == "spawn") && status != 128 + sig) {
    fail(kase + ": exit status " + std::to_string(status) + ", expected " + std::to_string(128 + sig));
  }
  if (status == 0) fail(kase + ": the stopped run exited with status 0");
  const int64_t saved = volt::checkpoint::read(ckpt).at("loops").toGenericDict().at("global_step").toInt();
  if (saved < after || saved >= steps) fail(kase + ": the checkpoint holds step " + std::to_string(saved));
  if (requeues) {
    std::ifstream in(requeued);
    std::vector<std::string> lines;
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    if (lines != std::vector<std::string>{"requeue 4242"}) {
      fail(kase + ": scontrol was called " + std::to_string(lines.size()) + " times" +
           (lines.empty() ? std::string() : " (first: " + lines[0] + ")") + "; expected once, with \"requeue 4242\"");
    }
  }

  if (run(cmd({run_dir, dir + "/out.ckpt", "0", "last"})) != 0) fail(kase + ": the resumed run failed");
  std::string why;
  if (!identical(dir + "/ref.ckpt", dir + "/out.ckpt", &why)) fail(kase + ": resumed from step " + std::to_string(saved) + ": " + why);
  auto ref_rows = vt::csv_rows(dir + "/ref/logs/version_0/metrics.csv");
  auto rows = vt::csv_rows(run_dir + "/logs/version_0/metrics.csv");
  const std::size_t before = rows.size();
  for (auto& r : vt::csv_rows(run_dir + "/logs/version_1/metrics.csv")) rows.push_back(std::move(r));
  std::sort(rows.begin(), rows.end());
  if (rows != ref_rows) {
    fail(kase + ": the metric rows of both parts (" + std::to_string(rows.size()) + ") are not the uninterrupted run's (" +
         std::to_string(ref_rows.size()) + ")");
  }
  std::cout << kase << ": " << volt::cluster::signal_name(sig) << " after step " << after << "; exited " << ms << " ms later with status "
            << status << "; checkpoint at step " << saved << (requeues ? ", job requeued once" : "") << "; resumed with "
            << "\"last\": weights bit-identical, " << before << " + " << rows.size() - before << " metric rows = the "
            << ref_rows.size() << " of the uninterrupted run  match" << std::endl;

  if (kase == "single") {  // a second signal while the first waits for the batch boundary: the process ends at once
    const std::string d2 = dir + "/second";
    fs::create_directories(d2);
    const Child c2 = start(cmd({d2, dir + "/unused2.ckpt", "500"}), false);
    while (read_number(d2 + "/progress") < 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    ::kill(c2.pid, SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const auto t1 = std::chrono::steady_clock::now();
    ::kill(c2.pid, SIGTERM);
    const int s2 = wait_for(c2);
    const auto ms2 = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t1).count();
    if (s2 != -SIGTERM) fail("after a second SIGTERM the status is " + std::to_string(s2) + ", expected death by SIGTERM");
    if (fs::exists(d2 + "/ckpt/interrupted.ckpt")) fail("a checkpoint was written although the second signal came first");
    std::cout << "a second SIGTERM 50 ms after the first ended the process " << ms2 << " ms later, by the signal  match"
              << std::endl;
  }
  return 0;
}

// ---- Python ---------------------------------------------------------------------------------------------

/// The value of `key` in the one-line `scontrol -o show job` of `job` on the cluster in `cluster` ("" if none).
std::string job_field(const std::string& cluster, const std::string& job, const std::string& key) {
  const std::string line = capture({cluster + "/bin/on", "head", "scontrol", "-o", "show", "job", job});
  const auto at = line.find(" " + key + "=");
  if (at == std::string::npos) return "";
  const auto start = at + key.size() + 2;
  return line.substr(start, line.find(' ', start) - start);
}

// resume node-loss <dir> <cluster-dir>: a host lost in the middle of a 2-host job, and the job submitted again on the
// host left. index-fit (DDP, one rank on each of 2 emulated hosts under srun, KillOnBadExit=0, a checkpoint after every
// step, 150 ms per batch) loses node2's link after a few steps: both ranks must end by themselves (volt's heartbeats)
// and the job with them. The link comes back; the job runs again on one host with "last" and resumes from the last
// checkpoint the 2 ranks wrote: every sample of both epochs is trained on exactly once (the lost run's batches before
// that checkpoint's step, the resumed run's after it).
int node_loss_case(const std::string& dir, const std::string& cluster) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string prefix;
  {
    std::ifstream env(cluster + "/env");
    for (std::string line; std::getline(env, line);) {
      const std::string key = "export VOLT_CLUSTER_PREFIX='";
      if (line.rfind(key, 0) == 0) prefix = line.substr(key.size(), line.size() - key.size() - 1);
    }
  }
  if (prefix.empty()) fail("no cluster in " + cluster);
  const std::string on = cluster + "/bin/on", last = dir + "/ckpt/last.ckpt";
  auto link = [&](const char* state) { return run({"ip", "-n", prefix + "n2", "link", "set", "eth0", state}); };
  const Child job = start({on, "head", "srun", "-N2", "-n2", "--mpi=pmix", "--kill-on-bad-exit=0", self_exe(),
                           "index-fit", "ddp", "2", dir + "/ckpt", dir + "/part1", "-1"},
                          false, {"VOLT_TEST_NODES=2", "VOLT_TEST_DELAY_MS=150"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(last)) {
    if (std::chrono::steady_clock::now() > deadline) fail("no checkpoint was written in 60 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::mt19937 rng(test_seed("node-loss"));
  std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(300, 1500)(rng)));
  link("down");
  const auto cut = std::chrono::steady_clock::now();
  int status = 0;
  pid_t ended = 0;
  const auto since_cut = [&] { return std::chrono::steady_clock::now() - cut; };
  // Both ranks must end by themselves (volt's heartbeats: about 15 s after the cut).
  const std::string mark = dir + "/part1";
  auto ranks_left = [&] {
    int left = 0;
    for (const auto& entry : fs::directory_iterator("/proc")) {
      const std::string name = entry.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string line = vt::proc_file(name, "cmdline");
      if (line.find("index-fit") != std::string::npos && line.find(mark) != std::string::npos &&
          line.rfind("srun", 0) != 0 && line.find("/srun") == std::string::npos) {
        ++left;
      }
    }
    return left;
  };
  while (ranks_left() > 0 && since_cut() < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double took = std::chrono::duration<double>(since_cut()).count();
  link("up");
  if (ranks_left() > 0) fail("the ranks were still running 60 s after the cut");
  // srun may never hear of the rank that ended while its host was cut off: end the job as SLURM would end a job on a
  // node it marks down, and wait for srun.
  run({on, "head", "scancel", "--user=root"});
  const auto waited = std::chrono::steady_clock::now();
  while ((ended = ::waitpid(job.pid, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - waited < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (ended != job.pid) {
    ::kill(job.pid, SIGKILL);
    ::waitpid(job.pid, &status, 0);
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) fail("the job that lost a host exited 0");
  for (int i = 0; run({cluster + "/bin/check"}) != 0; ++i) {
    if (i == 150) fail("the cluster did not come back after the link");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const int64_t saved = volt::checkpoint::read(last).at("loops").toGenericDict().at("global_step").toInt();
  if (run({on, "head", "srun", "-N1", "-n1", "--mpi=pmix", self_exe(), "index-fit", "ddp", "1", dir + "/ckpt",
           dir + "/part2", "-1", "last"}) != 0) {
    fail("the job submitted again on one host failed");
  }
  auto count = read_records(dir + "/part1", 2, saved);
  for (const auto& [k, n] : read_records(dir + "/part2", 1)) count[k] += n;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    for (int64_t i = 0; i < 48; ++i) {
      if (count[{epoch, i}] != 1) {
        fail("epoch " + std::to_string(epoch) + ": sample " + std::to_string(i) + " trained on " +
             std::to_string(count[{epoch, i}]) + " times");
      }
    }
  }
  if (count.size() != 96) fail("samples outside the data set were recorded");
  std::cout << "node loss: node2's link cut after step " << saved << "'s checkpoint; both ranks ended " << took
            << " s later; submitted again on one host, it resumed from \"last\" (step " << saved
            << "): every sample of both epochs trained on exactly once  match" << std::endl;
  return 0;
}

// What the cluster's SLURM daemons logged about job `id` (slurmctld's and each slurmd's lines naming it), to say
// what SLURM did when a job ends otherwise than expected.
std::string slurm_log_about(const std::string& cluster, const std::string& id) {
  const std::regex about("JobId=" + id + "([^0-9]|$)|StepId=" + id + "\\.|[Jj]ob " + id + "([^0-9]|$)");
  std::vector<fs::path> logs;
  for (const auto& e : fs::directory_iterator(cluster + "/log")) {
    if (e.path().filename().string().starts_with("slurm")) logs.push_back(e.path());
  }
  std::sort(logs.begin(), logs.end());
  std::string out;
  for (const auto& file : logs) {
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) {
      if (std::regex_search(line, about)) out += file.filename().string() + ": " + line + "\n";
    }
  }
  return out;
}

struct JobEnd {
  std::string state, restarts, seen;  // the last state and restart count read, and every state in turn
};

// Follows a job that requeues itself to its end, releasing it once it is pending after its requeue (SLURM holds a
// requeued job). The job's states as scontrol reports them, polled: a requeued job can pass through a terminal state
// (FAILED, as its first run's batch script ends, killed) before it is pending again, so a terminal state other than
// the second run's COMPLETED counts only once it has held for 5 s.
JobEnd follow_requeued_job(const std::string& cluster, const std::string& id,
                           std::chrono::steady_clock::time_point deadline) {
  JobEnd end;
  bool released = false;
  std::chrono::steady_clock::time_point terminal_since{};
  bool terminal = false;
  for (;;) {
    end.state = job_field(cluster, id, "JobState");
    end.restarts = job_field(cluster, id, "Restarts");
    const std::string mark = end.state + "(" + end.restarts + ")";
    if (!end.seen.ends_with(mark)) end.seen += (end.seen.empty() ? "" : " ") + mark;
    if (end.state == "COMPLETED" && end.restarts == "1") return end;
    const auto now = std::chrono::steady_clock::now();
    const std::string& s = end.state;
    if (s == "COMPLETED" || s == "FAILED" || s == "CANCELLED" || s == "TIMEOUT" || s == "NODE_FAIL") {
      if (!terminal) terminal_since = now;
      terminal = true;
      if (now - terminal_since > std::chrono::seconds(5)) return end;
    } else {
      terminal = false;
    }
    if (!released && end.restarts == "1" && s == "PENDING") {
      run({cluster + "/bin/on", "head", "scontrol", "update", "jobid=" + id, "starttime=now"});
      released = true;
    }
    if (now > deadline) return end;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

struct RequeuedRun {
  JobEnd end;
  std::string id, output;  // the job's id and its output (both runs)
  int64_t after = 0;       // the step after which it was signalled
};

// One submission of the requeue case's job: the script started by `how`, SIGUSR1 after a random step, followed to
// its end (test/resume.cpp's requeue_case below).
RequeuedRun submit_signalled_job(const std::string& dir, const std::string& cluster, const std::string& how) {
  const std::string run_dir = dir + "/run", out = dir + "/out.ckpt", script = dir + "/job.sh", log = dir + "/job.out";
  fs::remove_all(run_dir);
  fs::remove(log);
  const std::string start_ranks = how == "srun" ? "srun --mpi=pmix" : "exec mpirun --allow-run-as-root --bind-to none";
  std::ofstream(script) << "#!/bin/sh\nexport VOLT_TEST_NODES=2\n"
                        << "echo \"run with SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}\"\n"
                        << start_ranks << " '" << self_exe() << "' sig-fit ddp '" << run_dir << "' '" << out
                        << "' 40 last\n";
  const std::string job = capture({cluster + "/bin/on", "head", "sbatch", "--parsable", "--requeue", "-N2", "-n2",
                                   "--open-mode=append", "-o", log, script});
  if (job.empty() || job.find_first_not_of("0123456789\n") != std::string::npos) fail("sbatch said: " + job);
  RequeuedRun r;
  r.id = job.substr(0, job.find('\n'));
  std::mt19937 rng(test_seed(("requeue " + how).c_str()));
  r.after = std::uniform_int_distribution<int64_t>(2, 18)(rng);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (read_number(run_dir + "/progress") < r.after) {
    if (std::chrono::steady_clock::now() > deadline) {
      fail("job " + r.id + " did not reach step " + std::to_string(r.after));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::vector<std::string> scancel = {cluster + "/bin/on", "head", "scancel", "--signal=USR1"};
  if (how != "srun") scancel.push_back("--batch");
  scancel.push_back(r.id);
  std::cout << "job " << r.id << ": SIGUSR1 after step " << r.after << " ($ scancel --signal=USR1"
            << (how != "srun" ? " --batch " : " ") << r.id << ")" << std::endl;
  if (run(scancel) != 0) fail("scancel failed");
  r.end = follow_requeued_job(cluster, r.id, deadline + std::chrono::seconds(60));
  std::ostringstream output;
  output << std::ifstream(log).rdbuf();
  r.output = output.str();
  std::cout << "job " << r.id << "'s states (restarts): " << r.end.seen << std::endl;
  std::cout << "--- the job's output (both runs) ---\n" << r.output << "---" << std::endl;
  return r;
}

// resume requeue <dir> <cluster-dir> srun|mpirun [-- <mpirun...>]: SLURM's requeue for real, on the emulated cluster
// (test/cluster/up.sh). The 2-rank sig-fit, one rank on each of 2 hosts, is submitted with `sbatch --requeue`, its
// batch script starting the ranks with `srun --mpi=pmix` or `exec mpirun`, always with "last" (nothing to resume the
// first time). After a random step it is sent SIGUSR1 as a cluster sends it: `scancel --signal=USR1` to the job's
// steps (srun), `scancel --batch --signal=USR1` to the batch shell, which mpirun forwards (mpirun). volt must save,
// run the real `scontrol requeue`, and the job must run again (Restarts=1; SLURM holds a requeued job, which the test
// releases with `scontrol update starttime=now`) and resume: the weights bit-identical to an uninterrupted run's
// (under the given mpirun, on this host), the metric rows of both runs together that run's rows. A job that SLURM
// requeued but then failed without starting its script again (no second "run with" line: no volt code ran) is
// submitted once more, with what SLURM logged about it printed; a second such failure fails.
int requeue_case(const std::string& dir, const std::string& cluster, const std::string& how,
                 const std::vector<std::string>& mpirun) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::vector<std::string> ref = mpirun;
  for (const std::string& a : {self_exe(), std::string("sig-fit"), std::string("ddp"), dir + "/ref", dir + "/ref.ckpt",
                               std::string("0")}) {
    ref.push_back(a);
  }
  if (run(ref) != 0) fail("the uninterrupted run failed");
  const std::string run_dir = dir + "/run", out = dir + "/out.ckpt";
  RequeuedRun r = submit_signalled_job(dir, cluster, how);
  const bool not_restarted = r.end.state == "FAILED" && r.end.restarts == "1" &&
                             r.output.find("SLURM_RESTART_COUNT=1") == std::string::npos;
  if (not_restarted) {
    std::cout << "--- what SLURM logged about job " << r.id << " ---\n" << slurm_log_about(cluster, r.id) << "---\n"
              << "job " << r.id << " was requeued, then failed without its script starting again; submitting the "
              << "job once more" << std::endl;
    r = submit_signalled_job(dir, cluster, how);
  }
  const std::string &id = r.id, &state = r.end.state, &restarts = r.end.restarts;
  const int64_t after = r.after;
  if (state != "COMPLETED" || restarts != "1") {
    std::cout << "--- what SLURM logged about job " << id << " ---\n"
              << slurm_log_about(cluster, id) << "---" << std::endl;
    fail("job " + id + " ended " + state + " after " + restarts + " restarts; expected COMPLETED after 1");
  }
  const std::string ckpt = run_dir + "/ckpt/interrupted.ckpt";
  if (!fs::exists(ckpt)) fail("no " + ckpt + " after the signal");
  const int64_t saved = volt::checkpoint::read(ckpt).at("loops").toGenericDict().at("global_step").toInt();
  std::string why;
  if (!identical(dir + "/ref.ckpt", out, &why)) fail("requeued and resumed from step " + std::to_string(saved) + ": " + why);
  auto ref_rows = vt::csv_rows(dir + "/ref/logs/version_0/metrics.csv");
  auto rows = vt::csv_rows(run_dir + "/logs/version_0/metrics.csv");
  for (auto& row : vt::csv_rows(run_dir + "/logs/version_1/metrics.csv")) rows.push_back(std::move(row));
  std::sort(rows.begin(), rows.end());
  if (rows != ref_rows) fail("the metric rows of both runs are not the uninterrupted run's");
  std::cout << "requeue (" << how << "): SIGUSR1 after step " << after << ", checkpoint at step " << saved
            << ", job " << id << " requeued by scontrol and run again (Restarts=1), resumed from \"last\": weights "
            << "bit-identical, metric rows the uninterrupted run's  match" << std::endl;
  return 0;
}

// resume export <dir>: trains the quick-start net briefly, writes its checkpoint, an input and its output.
/// 4 -> 3 (tanh) -> 2 in float64 (Fp64True), stepped by `kind`'s optimizer: adamw (weight decay 0.05), adam (amsgrad,
/// weight decay 0.01 added to the gradient), sgd (momentum 0.9, weight decay 0.01).
struct OptNetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  std::string kind;
  explicit OptNetImpl(std::string k) : kind(std::move(k)) {
    torch::manual_seed(4);
    a = register_module("a", torch::nn::Linear(4, 3));
    b = register_module("b", torch::nn::Linear(3, 2));
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context&) {
    return torch::mse_loss(b(torch::tanh(a(batch.data))), batch.target);
  }
  std::unique_ptr<torch::optim::Optimizer> configure_optimizers() {
    if (kind == "adamw") {
      return std::make_unique<torch::optim::AdamW>(parameters(), torch::optim::AdamWOptions(0.02).weight_decay(0.05));
    }
    if (kind == "adam") {
      return std::make_unique<torch::optim::Adam>(parameters(),
                                                  torch::optim::AdamOptions(0.02).weight_decay(0.01).amsgrad(true));
    }
    return std::make_unique<torch::optim::SGD>(parameters(),
                                               torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  }
};
TORCH_MODULE(OptNet);

/// The file at `path` in the plain pickle a checkpoint is written in (no LibTorch type tags).
void write_plain(const std::string& path, const volt::checkpoint::Dict& d) {
  const auto bytes = volt::checkpoint::detail::pickle_plain(d);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// For each optimizer kind: the checkpoint after 3 steps over one batch of all 16 samples (`opt_<kind>.ckpt`), and
/// the weights after volt's 4th step, resumed from it (`opt_<kind>_next.ckpt`, weights only); the batch in `opt_io.pt`.
void export_optimizers(const std::string& dir) {
  torch::manual_seed(6);
  const auto x = torch::randn({16, 4}), y = torch::randn({16, 2});
  for (const std::string kind : {"adamw", "adam", "sgd"}) {
    const auto loader = [&] { return volt::data::TensorLoader(x, y, {.batch_size = 16}); };
    OptNet first(kind);
    auto t3 = volt::make_trainer<volt::SingleDevice, volt::Fp64True, volt::CPU>({.max_steps = 3});
    t3.fit(first, loader());
    t3.save_checkpoint(dir + "/opt_" + kind + ".ckpt");
    OptNet next(kind);
    auto t4 = volt::make_trainer<volt::SingleDevice, volt::Fp64True, volt::CPU>({.max_steps = 4});
    t4.fit(next, loader(), volt::NoLoader{}, dir + "/opt_" + kind + ".ckpt");
    t4.save_checkpoint(dir + "/opt_" + kind + "_next.ckpt", /*weights_only=*/true);
  }
  auto io = volt::checkpoint::make_dict();
  io.insert("input", x.to(torch::kFloat64));
  io.insert("target", y.to(torch::kFloat64));
  write_plain(dir + "/opt_io.pt", io);
}

int export_for_python(const std::string& dir) {
  fs::create_directories(dir);
  torch::manual_seed(3);
  auto x = torch::randn({64, 1, 28, 28});
  auto y = torch::randint(0, 10, {64});
  Net net(1);
  auto trainer = volt::make_trainer<volt::SingleDevice, volt::Fp32, volt::CPU>({.max_epochs = 1});
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = 16}));
  trainer.save_checkpoint(dir + "/model.ckpt");
  trainer.save_checkpoint(dir + "/weights.ckpt", /*weights_only=*/true);
  export_optimizers(dir);
  net->eval();
  torch::NoGradGuard no_grad;
  const auto input = torch::randn({5, 1, 28, 28});
  auto io = volt::checkpoint::make_dict();
  io.insert("input", input);
  io.insert("output", net->forward(input));
  write_plain(dir + "/io.pt", io);
  std::cout << "wrote " << dir << "/model.ckpt, weights.ckpt, io.pt and the optimizers' opt_*.ckpt" << std::endl;
  return 0;
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
    {"sigkill", 2, "<dir> [rounds] [manual|workers|async]", [](const std::vector<std::string>& a, int, char**) {
       return sigkill(a[2], a.size() > 3 ? std::stoi(a[3]) : 3, a.size() > 4 ? a[4] : "");
     }},
    {"kill-mid-write", 2, "<dir> [rounds]", [](const std::vector<std::string>& a, int, char**) {
       return kill_mid_write(a[2], a.size() > 3 ? std::stoi(a[3]) : 8);
     }},
    {"fsdp-exact", 2, "<dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return ddp_exact(a[2], after_dashes(argc, argv), "fsdp-fit");
     }},
    {"fsdp-sharded-exact", 2, "<dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return ddp_exact(a[2], after_dashes(argc, argv), "fsdp-sharded-fit");
     }},
    {"file-ops-kill", 2, "<dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return file_ops_kill(a[2], after_dashes(argc, argv));
     }},
    {"sharded-kill", 2, "<dir> [rounds] -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return sharded_kill(a[2], a.size() > 3 && a[3] != "--" ? std::stoi(a[3]) : 3, after_dashes(argc, argv));
     }},
    {"ddp-exact", 2, "<dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return ddp_exact(a[2], after_dashes(argc, argv));
     }},
    {"spawn-exact", 2, "<dir>", [](const std::vector<std::string>& a, int, char**) { return spawn_exact(a[2]); }},
    {"n-to-m", 4, "<from> <to> <dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return n_to_m(std::stoi(a[2]), std::stoi(a[3]), a[4], after_dashes(argc, argv));
     }},
    {"fsdp-resume", 2, "<dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return fsdp_resume(a[2], after_dashes(argc, argv));
     }},
    {"zero-resume", 2, "<dir> -- <mpirun...>", [](const std::vector<std::string>& a, int argc, char** argv) {
       return zero_resume(a[2], after_dashes(argc, argv));
     }},
    {"signal", 3, "single|mpirun-term|usr1-one-rank|spawn <dir> [-- <mpirun...>]",
     [](const std::vector<std::string>& a, int argc, char** argv) {
       return signal_case(a[2], a[3], a[2] == "single" || a[2] == "spawn" ? std::vector<std::string>{}
                                                                           : after_dashes(argc, argv));
     }},
    {"node-loss", 2, "<dir> <cluster-dir>", [](const std::vector<std::string>& a, int, char**) {
       return node_loss_case(a[2], a[3]);
     }},
    {"requeue", 3, "<dir> <cluster-dir> srun|mpirun -- <mpirun...>",
     [](const std::vector<std::string>& a, int argc, char** argv) {
       return requeue_case(a[2], a[3], a[4], after_dashes(argc, argv));
     }},
    {"export", 2, "<dir>", [](const std::vector<std::string>& a, int, char**) { return export_for_python(a[2]); }},
    // workers
    {"train", 3, "<dir> <out> [--resume] [--manual] [--workers] [--async] [--tokens FILE]", [](const std::vector<std::string>& a, int,
                                                                                  char**) {
       const bool resume = std::find(a.begin() + 4, a.end(), "--resume") != a.end();
       const int workers = std::find(a.begin() + 4, a.end(), "--workers") != a.end() ? 3 : 0;
       const bool async = std::find(a.begin() + 4, a.end(), "--async") != a.end();
       if (std::find(a.begin() + 4, a.end(), "--manual") != a.end()) return train<ManualTiny>(a[2], a[3], resume, workers);
       const auto tokens = std::find(a.begin() + 4, a.end(), "--tokens");
       if (tokens != a.end() && tokens + 1 != a.end()) return train<TokenTiny>(a[2], a[3], resume, workers, false, tokens[1]);
       return train<Tiny>(a[2], a[3], resume, workers, async);
     }},
    {"writer", 2, "<path>", [](const std::vector<std::string>& a, int, char**) { return writer(a[2]); }},
    {"ddp-fit", 3, "<dir> <out> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       return two_rank_fit<volt::Script>(a[2], a[3], a.size() > 4 ? a[4] : "");
     }},
    {"fsdp-fit", 3, "<dir> <out> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       return two_rank_fit<volt::Script, volt::FSDP<volt::Script, volt::Mpi>>(a[2], a[3], a.size() > 4 ? a[4] : "");
     }},
    {"fsdp-sharded-fit", 3, "<dir> <out> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       return two_rank_fit<volt::Script, volt::FSDP<volt::Script, volt::Mpi>>(a[2], a[3], a.size() > 4 ? a[4] : "", true);
     }},
    {"fsdp-topk-fit", 3, "<dir> <out> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       return two_rank_fit<volt::Script, volt::FSDP<volt::Script, volt::Mpi>>(a[2], a[3], a.size() > 4 ? a[4] : "", true,
                                                                                1);
     }},
    {"spawn-fit", 3, "<dir> <out> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       return two_rank_fit<volt::Spawn>(a[2], a[3], a.size() > 4 ? a[4] : "");
     }},
    {"sig-fit", 5, "single|ddp|spawn <dir> <out> <delay_ms> [ckpt]", [](const std::vector<std::string>& a, int, char**) {
       const std::string ckpt = a.size() > 6 ? a[6] : "";
       if (a[2] == "ddp") return sig_fit<volt::DDP<volt::Script, volt::Mpi>>(a[3], a[4], std::stoi(a[5]), ckpt);
       if (a[2] == "spawn") return sig_fit<volt::DDP<volt::Spawn, volt::Mpi>>(a[3], a[4], std::stoi(a[5]), ckpt);
       return sig_fit<volt::SingleDevice>(a[3], a[4], std::stoi(a[5]), ckpt);
     }},
    {"index-fit", 6, "ddp|zero1|zero2 <ranks> <dir> <record> <max_steps> [ckpt]",
     [](const std::vector<std::string>& a, int, char**) {
       return index_fit(a[2], std::stoi(a[3]), a[4], a[5], std::stoll(a[6]), a.size() > 7 ? a[7] : "");
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
