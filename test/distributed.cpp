// Multi-process tests. One program, one scenario per command line; CTest runs each through mpirun, through
// Script's self-relaunch or through Spawn (see CMakeLists.txt). Every rank runs the same scenario; the
// checks run where the answer is (rank 0, or the main process under Spawn) and set the exit status.
//
//   distributed fit <script|spawn> [--accumulate K] [--fused] [--ema DECAY]
//                                                     DDP weights (or their moving average) == a one-process loop
//                                                     on the same global batches
//   distributed indices <script|spawn> N              every sample seen once per epoch across ranks
//   distributed metrics                               sync_dist values, stop decisions, all_gather/broadcast
//   distributed zero <script|spawn> STAGE WORLD adam|sgd|fused-adam   ZeRO weights == a one-process loop (accumulation 3,
//                                                     clipping); the optimizer state split across the ranks
//   distributed collectives                           Mpi's reduce-scatter and all-gather (mpirun, any world size)
//   distributed mesh                                  volt::Mesh on 4 ranks: collectives, sends and receives on each axis
//   distributed mesh-roles [refused]                  ModelParallel on 4 ranks, a mesh with a tensor axis: batches and
//                                                     sync_dist over the data axes (refused: a part along the tensor axis)
//   distributed mesh-fault die|stall                  on a 2x2 mesh rank 3 dies or stalls during rank 2's receive:
//                                                     every rank ends with RankFailure naming it
//   distributed predict <script|spawn> WORLD          predict (gathered, and written by PredictionWriter) and validate
//                                                     on 1001 samples == a hand-written loop
//   distributed fail <script|spawn> RANK STEP [throw|die|stall]   rank RANK throws, is SIGKILLed or stalls (120 s,
//                                                     alive) at step STEP (the job must end: --timeout S for a stall)
//   distributed zero-inf STAGE                         ZeRO, a scaled loss, an inf on one rank: every rank skips the step
//   distributed zero-unfreeze                          ZeRO<2> on 2 ranks, a layer unfrozen during the fit: refused
//   distributed legacy-checkpoint write|resume DIR [sharded]  checkpoints an earlier volt wrote (test/data/legacy/)
//                                                     resume under DDP and ZeRO<2> as an uninterrupted run;
//                                                     `sharded`: its sharded folders too (FSDP, ZeRO<2>)
//   distributed manual-refusals                        ManualParallel on 2 ranks: a checkpoint refused
//   distributed manual-weigh-loss                      ManualParallel on 2 ranks, weigh_loss: refused
//   distributed expect-failure TIMEOUT MESSAGE... [--any-status] -- CMD...  runs CMD, passes if it exits non-zero
//                                                     (any status: --any-status) within TIMEOUT s with every MESSAGE
//                                                     in its output and leaves no process behind
//   distributed gpu-zero <script|spawn>               the same with ZeRO<2, L, Nccl>
//   distributed gpu-mesh                              Nccl on a 1x1 mesh's axes (split, and from own ids): reduce,
//                                                     gather, send to itself; exits 77 without CUDA or NCCL
//   distributed gpu-fsdp                              FSDP<Script, Nccl> with Bf16Mixed on one GPU == SingleDevice;
//                                                     its sharded checkpoint == its full file; exits 77 likewise
//   distributed gpu-ddp <script|spawn>                DDP<L, Nccl> with Bf16Mixed on one GPU (world size 1: NCCL
//                                                     refuses two ranks on one device) == SingleDevice; exits 77
//                                                     where CUDA or NCCL is missing
//
// Anywhere on the line before a "--": --timeout S (the collective timeout of the fail scenario), --world W (fit and the other
// fixed-size scenarios: W ranks instead of 2) and --nodes N (the job spans N hosts: devices = world / N, num_nodes = N;
// fit, zero and predict under Script then check every rank's rank, local rank and node rank against the hosts the
// ranks run on).

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "../examples/gpt_model.hpp"
#include "support/models.hpp"
#include "support/proc.hpp"
#include "support/trace.hpp"

#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::cerr << "CHECK FAILED: " << what << std::endl;
  }
}

constexpr int64_t kBatch = 4;  // per rank
int g_world = 2;  // ranks in the scenarios that do not take a world size (--world changes it)
int g_nodes = 1;  // hosts the job spans (--nodes: the cluster tests); every scenario asks for devices = world / nodes
std::chrono::milliseconds g_timeout = std::chrono::minutes(30);  // the fail scenario's collective timeout (--timeout S)
constexpr uint64_t kSeed = 11;

std::pair<torch::Tensor, torch::Tensor> data(int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto x = torch::randn({n, 4}, gen);
  auto y = torch::sin(x.sum(1, true)) + 0.1 * torch::randn({n, 1}, gen);
  return {x, y};
}

/// 4 -> 16 -> 8 -> 1 with tanh: a few parameters of different sizes, so small buckets split them.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  NetImpl() {
    torch::manual_seed(5);
    a = register_module("a", torch::nn::Linear(4, 16));
    b = register_module("b", torch::nn::Linear(16, 8));
    c = register_module("c", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return c(torch::tanh(b(torch::tanh(a(x))))); }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto loss = (forward(batch.data) - batch.target).pow(2).mean();
    ctx.log("loss", loss, {.sync_dist = true});
    return loss;
  }
  /// volt::optim::SGD (fused kernels where LibTorch has them) instead of torch::optim::SGD.
  bool fused = false;
  std::unique_ptr<torch::optim::Optimizer> configure_optimizers() {
    const auto o = torch::optim::SGDOptions(0.1).momentum(0.9);
    if (fused) return std::make_unique<volt::optim::SGD>(parameters(), o);
    return std::make_unique<torch::optim::SGD>(parameters(), o);
  }
};
TORCH_MODULE(Net);

torch::Tensor flat(torch::nn::Module& m) {
  std::vector<torch::Tensor> v;
  for (auto& p : m.parameters()) v.push_back(p.detach().flatten().cpu());
  return torch::cat(v);
}

/// The reference: one process, plain LibTorch. Global batch i of an epoch = rank 0's local batch i followed
/// by rank 1's, where rank r's local order is positions r, r+2, ... of randperm(n) seeded with seed+epoch;
/// the loss is the mean over the global batch (equal local batches make it the mean of the ranks' means).
/// With `ema_decay` > 0: the exponential moving average of the weights after each step instead (the first step's
/// weights, then decay * average + (1 - decay) * weights, in float64), as EMAWeightAveraging keeps it.
torch::Tensor reference_weights(int64_t n, int epochs, int accumulate, double ema_decay = 0.0) {
  auto [x, y] = data(n);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::Tensor average;
  const int64_t local = n / g_world, batches = local / kBatch;
  for (int e = 0; e < epochs; ++e) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed + static_cast<uint64_t>(e));
    auto perm = torch::randperm(n, gen, torch::kLong);
    for (int64_t i = 0; i < batches; ++i) {
      std::vector<torch::Tensor> idx;
      for (int r = 0; r < g_world; ++r) {
        auto mine = perm.slice(0, r, n, g_world);
        idx.push_back(mine.slice(0, i * kBatch, (i + 1) * kBatch));
      }
      auto id = torch::cat(idx);
      if (i % accumulate == 0) opt.zero_grad();
      auto loss = (net->forward(x.index_select(0, id)) - y.index_select(0, id)).pow(2).mean() / accumulate;
      loss.backward();
      if ((i + 1) % accumulate == 0 || i + 1 == batches) {
        opt.step();
        if (ema_decay > 0.0) {
          const torch::Tensor w = flat(*net).to(torch::kFloat64);
          average = average.defined() ? ema_decay * average + (1.0 - ema_decay) * w : w;
        }
      }
    }
  }
  return ema_decay > 0.0 ? average.to(torch::kFloat32) : flat(*net);
}

/// Script: every rank's place as the strategy has it against every rank's own host name (gathered): the node rank is
/// the host's place among the hosts in the order of their first rank, the local rank the rank's place among its host's
/// ranks; g_nodes hosts with g_world / g_nodes ranks each; where a launcher says the rank (PMIx: every launcher the
/// cluster tests use), it agrees. Prints every rank's place from rank 0.
template <class S>
void check_placement(S& strategy) {
  constexpr int64_t kName = 64;
  auto mine = torch::zeros({kName + 3}, torch::kLong);
  const std::string host = volt::detail::host_name().substr(0, kName);
  for (std::size_t i = 0; i < host.size(); ++i) mine[static_cast<int64_t>(i)] = static_cast<unsigned char>(host[i]);
  mine[kName] = strategy.global_rank();
  mine[kName + 1] = strategy.local_rank();
  mine[kName + 2] = strategy.node_rank();
  if (const char* pmix = std::getenv("PMIX_RANK")) {
    check(std::atoi(pmix) == strategy.global_rank(), "rank " + std::to_string(strategy.global_rank()) +
                                                         " is PMIx's rank " + pmix);
  }
  const torch::Tensor all = strategy.all_gather(mine);
  if (strategy.global_rank() != 0) return;
  std::vector<std::string> hosts;
  std::map<std::string, int> count;
  for (int r = 0; r < all.size(0); ++r) {
    std::string h;
    for (int64_t i = 0; i < kName && all[r][i].template item<int64_t>() != 0; ++i) {
      h += static_cast<char>(all[r][i].template item<int64_t>());
    }
    const int node = static_cast<int>(std::find(hosts.begin(), hosts.end(), h) - hosts.begin());
    if (node == static_cast<int>(hosts.size())) hosts.push_back(h);
    const int64_t got_rank = all[r][kName].template item<int64_t>();
    const int64_t got_local = all[r][kName + 1].template item<int64_t>();
    const int64_t got_node = all[r][kName + 2].template item<int64_t>();
    check(got_rank == r && got_local == count[h] && got_node == node,
          "rank " + std::to_string(r) + " on " + h + ": the strategy says rank " + std::to_string(got_rank) +
              ", local rank " + std::to_string(got_local) + ", node rank " + std::to_string(got_node) +
              "; the hosts say local rank " + std::to_string(count[h]) + ", node rank " + std::to_string(node));
    std::cout << "placement: rank " << r << " on " << h << ", local rank " << got_local << ", node rank " << got_node
              << std::endl;
    ++count[h];
  }
  check(static_cast<int>(hosts.size()) == g_nodes,
        std::to_string(hosts.size()) + " hosts, want " + std::to_string(g_nodes));
  for (const auto& [h, n] : count) {
    check(n == static_cast<int>(all.size(0)) / g_nodes, h + " runs " + std::to_string(n) + " ranks, want " +
                                                          std::to_string(all.size(0) / g_nodes));
  }
}

template <class L, class... Callbacks>
int fit_scenario_with(int accumulate, bool fused, double ema_decay, Callbacks... callbacks);

template <class L>
int fit_scenario(int accumulate, bool fused, double ema_decay) {
  if (ema_decay > 0.0) {  // the module ends with the average, which every rank keeps alike
    return fit_scenario_with<L>(accumulate, fused, ema_decay, volt::EMAWeightAveraging({.decay = ema_decay}));
  }
  return fit_scenario_with<L>(accumulate, fused, ema_decay);
}

template <class L, class... Callbacks>
int fit_scenario_with(int accumulate, bool fused, double ema_decay, Callbacks... callbacks) {
  const int64_t n = 64;
  const int epochs = 2;
  auto [x, y] = data(n);
  Net net;
  net->fused = fused;
  auto trainer = volt::make_trainer<volt::DDP<L, volt::Mpi>>(
      {.devices = g_world / g_nodes, .num_nodes = g_nodes, .max_epochs = epochs, .accumulate_grad_batches = accumulate},
      callbacks...);
  trainer.strategy().set_bucket_bytes(256, 512);  // several buckets for this small net
  volt::data::TensorLoader loader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed});
  const volt::FitResult result = trainer.fit(net, loader);
  // Under Script every rank gets here; under Spawn only the main process does.
  // (with EMA every rank checks: each must hold the reference's average)
  const bool answer_here = std::is_same_v<L, volt::Spawn> || trainer.is_global_zero() || ema_decay > 0.0;
  if (answer_here) {
    const torch::Tensor want = reference_weights(n, epochs, accumulate, ema_decay);
    const torch::Tensor got = flat(*net);
    const double diff = (got - want).abs().max().item<double>();
    std::cout << "max |ddp - reference| = " << diff << std::endl;
    check(torch::allclose(got, want, 1e-5, 1e-6), "DDP weights equal the one-process reference (max diff " + std::to_string(diff) + ")");
    check(result.metrics.count("loss") == 1, "fit returns the logged metrics");
    // The counters the reference loop walks through (under Spawn, brought back from rank 0 to this process).
    const int64_t batches = n / g_world / kBatch, steps = epochs * ((batches + accumulate - 1) / accumulate);
    check(trainer.current_epoch() == epochs && trainer.global_step() == steps,
          "after fit, current_epoch() = " + std::to_string(trainer.current_epoch()) + " (want " +
              std::to_string(epochs) + ") and global_step() = " + std::to_string(trainer.global_step()) +
              " (want " + std::to_string(steps) + ")");
  }
  if constexpr (std::is_same_v<L, volt::Script>) {
    check_placement(trainer.strategy());
    if (!trainer.is_global_zero()) return failures == 0 ? 0 : 1;
    const auto layout = trainer.strategy().bucket_layout();
    check(layout.size() > 2, "small bucket caps give several buckets (got " + std::to_string(layout.size()) + ")");
    check(!layout.empty() && layout.front().front() == net->parameters().size() - 1,
          "the first bucket starts with the last parameter (reverse order)");
  }
  return failures == 0 ? 0 : 1;
}

// ---- ZeRO: sharded optimizer state and gradients -------------------------------------------------------------------

/// The net of the DDP tests with Adam or SGD (momentum) as configure_optimizers returns it (`fused`: volt::optim's
/// Adam, which steps the pieces with LibTorch's fused kernel from 2.4 on).
struct ZeroNetImpl : NetImpl {
  bool adam = true;
  bool fused = false;
  /// The most bytes of `.grad` that layers b and c held when layer a's weight received its gradient, in backwards
  /// that step (every third micro-batch: 12 or 6 per epoch); -1 while none ran.
  int64_t held_late = -1;
  bool stepping = false;
  ZeroNetImpl() {
    a->weight.register_hook([this](const torch::Tensor&) {
      if (!stepping) return;
      int64_t bytes = 0;
      for (const auto& p : {b->weight, b->bias, c->weight, c->bias}) bytes += static_cast<int64_t>(volt::detail::bytes_of(p.grad()));
      held_late = std::max(held_late, bytes);
    });
  }
  /// Batch 2 of every epoch, the last of its window, returns no loss on every rank: that window does not step.
  static constexpr int64_t kSkipped = 2;
  /// Batch 4: layer a, frozen before the fit, starts to require gradients (the sharded layout refuses that).
  bool unfreeze = false;
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    if (unfreeze && ctx.batch_idx() == 4) {
      for (auto& p : a->parameters()) p.set_requires_grad(true);
    }
    if (ctx.batch_idx() == kSkipped) return {};
    stepping = (ctx.batch_idx() + 1) % 3 == 0;
    return NetImpl::training_step(batch, ctx);
  }
  std::unique_ptr<torch::optim::Optimizer> configure_optimizers() {
    if (adam && fused) return std::make_unique<volt::optim::Adam>(parameters(), torch::optim::AdamOptions(0.01));
    if (adam) return std::make_unique<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.01));
    return std::make_unique<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  }
};

/// The one-process reference for `world` ranks: global batch i of an epoch is every rank's local batch i in rank
/// order (rank r's local order: positions r, r + world, ... of randperm(n) seeded with seed + epoch), the loss their
/// mean over the window of `accumulate` batches, the gradients clipped to a total norm of `clip` before each step;
/// batch `ZeroNetImpl::kSkipped` (the last of its window) is skipped, and with it that window's step; so is the step
/// of epoch 0's batch `skip_step_at`. `dtype`: the net and data cast to it (float64: Fp64True's reference).
template <class Module = ZeroNetImpl>
torch::Tensor zero_reference(int world, int64_t n, int epochs, int accumulate, double clip, bool adam,
                             int64_t skip_step_at = -1, torch::Dtype dtype = torch::kFloat32) {
  auto [x32, y32] = data(n);
  const torch::Tensor x = x32.to(dtype), y = y32.to(dtype);
  Module net;
  net.to(dtype);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (adam) {
    opt = std::make_unique<torch::optim::Adam>(net.parameters(), torch::optim::AdamOptions(0.01));
  } else {
    opt = std::make_unique<torch::optim::SGD>(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  const int64_t batches = n / world / kBatch;
  for (int e = 0; e < epochs; ++e) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed + static_cast<uint64_t>(e));
    auto perm = torch::randperm(n, gen, torch::kLong);
    for (int64_t i = 0; i < batches; ++i) {
      std::vector<torch::Tensor> idx;
      for (int r = 0; r < world; ++r) idx.push_back(perm.slice(0, r, n, world).slice(0, i * kBatch, (i + 1) * kBatch));
      const auto id = torch::cat(idx);
      if (i % accumulate == 0) opt->zero_grad();
      if (i == ZeroNetImpl::kSkipped) continue;
      ((net.forward(x.index_select(0, id)) - y.index_select(0, id)).pow(2).mean() / accumulate).backward();
      if (((i + 1) % accumulate == 0 || i + 1 == batches) && !(e == 0 && i == skip_step_at)) {
        torch::nn::utils::clip_grad_norm_(net.parameters(), clip);
        opt->step();
      }
    }
  }
  return flat(net);
}

/// ZeRO stage `Stage` on `world` ranks (accumulation 3, clipping, Adam or SGD) against the one-process reference; on
/// each rank the optimizer's state is its share: over all ranks, the state of every parameter element once.
template <int Stage, class L>
int zero_scenario(int world, bool adam, bool fused) {
  const int64_t n = 96;
  const int epochs = 2, accumulate = 3;
  const double clip = 0.05;
  auto [x, y] = data(n);
  ZeroNetImpl net;
  net.adam = adam;
  net.fused = fused;
  auto trainer = volt::make_trainer<volt::ZeRO<Stage, L, volt::Mpi>>(
      {.devices = world / g_nodes, .num_nodes = g_nodes, .max_epochs = epochs, .accumulate_grad_batches = accumulate,
       .gradient_clip_val = clip});
  trainer.strategy().set_bucket_bytes(256, 512);  // three buckets for this net, parameters across blocks
  volt::data::TensorLoader loader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed});
  trainer.fit(net, loader);
  const bool answer_here = std::is_same_v<L, volt::Spawn> || trainer.is_global_zero();
  if (answer_here) {
    const torch::Tensor want = zero_reference(world, n, epochs, accumulate, clip, adam);
    const double diff = (flat(net) - want).abs().max().item<double>();
    std::cout << "ZeRO<" << Stage << "> on " << world << " ranks, " << (adam ? (fused ? "volt::optim::Adam" : "Adam") : "SGD")
              << ": max |weights - reference| = " << diff << std::endl;
    check(torch::allclose(flat(net), want, 1e-5, 1e-6), "ZeRO weights equal the one-process reference (max diff " +
                                                            std::to_string(diff) + ")");
  }
  if constexpr (std::is_same_v<L, volt::Script>) {  // (Spawn's workers trained their own copies of the net)
    check_placement(trainer.strategy());
    // Each `.grad` went into its bucket and was dropped as it arrived: the later layers held none by then.
    check(net.held_late == 0, "layers b and c held " + std::to_string(net.held_late) + " bytes of .grad when layer "
                              "a's gradient arrived in a stepping backward (want 0: each dropped once in its bucket)");
    // Every rank holds the same weights (the all-gather after the last step reached them all).
    const torch::Tensor every = trainer.strategy().all_gather(flat(net));
    check(torch::equal(std::get<0>(every.min(0)), std::get<0>(every.max(0))), "every rank ends with the same weights");
    // Every element's state once over the ranks: Adam two tensors per parameter, SGD one (momentum), as floats.
    int64_t elements = 0;
    for (const auto& p : net.parameters()) elements += p.numel();
    const int64_t want_bytes = elements * 4 * (adam ? 2 : 1);
    const auto mine = static_cast<int64_t>(volt::detail::optimizer_state_bytes(*trainer.optimizer()));
    const int64_t all = trainer.strategy().all_reduce(torch::tensor({mine}), volt::Reduce::sum).template item<int64_t>();
    check(all == want_bytes, "the ranks' optimizer states add up to one unsharded state (" + std::to_string(all) +
                                 " bytes, want " + std::to_string(want_bytes) + ")");
    check(mine <= want_bytes / world + 4 * 2 * world, "this rank holds about 1/world of it (" + std::to_string(mine) + ")");
    const auto grads = static_cast<int64_t>(trainer.strategy().gradient_bytes());
    const int64_t padded = 4 * (18 + 128 + 80 + 2 * world);  // the buckets' lengths, padding included (at most)
    check(Stage == 1 ? grads >= elements * 4 : grads <= padded / world,
          "gradient bytes held: " + std::to_string(grads) + " (stage 1: whole buckets; stage 2: this rank's blocks)");
  }
  return failures == 0 ? 0 : 1;
}

// ---- FSDP: the parameters sharded too, gathered unit by unit ---------------------------------------------------------

/// A block of the FSDP net: one unit.
struct FsdpBlockImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  FsdpBlockImpl(int64_t in, int64_t out) { fc = register_module("fc", torch::nn::Linear(in, out)); }
  torch::Tensor forward(const torch::Tensor& x) {
    on_forward();
    if (x.requires_grad()) x.register_hook([this](const torch::Tensor&) { on_backward(); });  // after its backward
    return torch::tanh(fc(x));
  }
  std::function<void()> on_forward = [] {}, on_backward = [] {};
};
TORCH_MODULE(FsdpBlock);

/// 4 -> 10 (root) -> tanh (a unit without parameters) -> 7 -> 9 -> 5 -> 11 -> 6 (five units: 77, 72, 50, 66 and 72
/// elements) -> 1 (root: 57 elements with the first layer), so that units do not divide by 2, 3 or 4 ranks; training_step as ZeroNetImpl's (batch 2 of each
/// epoch returns no loss). Each block, as it runs, counts the blocks whose parameters hold storage (gathered).
struct FsdpNetImpl : torch::nn::Module {
  torch::nn::Linear first{nullptr}, head{nullptr};  // ("in" would be refused by LibTorch's archives: a keyword)
  torch::nn::Tanh act{nullptr};                     // a unit without parameters, before the first with them
  torch::nn::ModuleList blocks;
  volt::ActivationCheckpointing which;
  int64_t most_gathered = 0;  // the most blocks gathered at once while one ran forward with gradients, once laid out
  bool laid_out = false;      // set between steps once the first optimizer step was taken
  int declare = 0;            // configure_model declares the units: 1 as they run, 2 with blocks 0 and 1 swapped
  int64_t first_most_gathered = 0;  // the most blocks gathered at once while one ran forward, before laid_out
  std::set<std::string> dtypes;  // of the blocks' weights as they ran forward with gradients, once laid out
  std::function<void(const char*)> probe = [](const char*) {};  // "forward", "backward": as a block runs, once laid out
  FsdpNetImpl() {
    torch::manual_seed(5);
    first = register_module("first", torch::nn::Linear(4, 10));
    act = register_module("act", torch::nn::Tanh());
    blocks = register_module("blocks", torch::nn::ModuleList());
    const int64_t widths[] = {10, 7, 9, 5, 11, 6};
    for (int i = 0; i < 5; ++i) {
      FsdpBlock block(widths[i], widths[i + 1]);
      block->on_forward = [this, me = block.get()] {
        if (!torch::GradMode::is_enabled()) return;
        if (!laid_out) {
          int64_t held = 0;
          for (const auto& b : *blocks) held += b->parameters().front().storage().nbytes() > 0 ? 1 : 0;
          first_most_gathered = std::max(first_most_gathered, held);
          return probe("first forward");
        }
        int64_t held = 0;
        for (const auto& b : *blocks) held += b->parameters().front().storage().nbytes() > 0 ? 1 : 0;
        most_gathered = std::max(most_gathered, held);
        dtypes.insert(std::string(c10::toString(me->fc->weight.scalar_type())));
        probe("forward");
      };
      block->on_backward = [this] { probe(laid_out ? "backward" : "first backward"); };
      blocks->push_back(block);
    }
    head = register_module("head", torch::nn::Linear(6, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = volt::sharded_call(act, first(x));
    h = volt::forward_blocks<FsdpBlockImpl>(blocks, h, volt::Units{}, which);
    return head(h);
  }
  /// The units in the order forward runs them (`declare` 1; 2: blocks 0 and 1 the other way round).
  void configure_model(volt::ModelPlan& plan) {
    if (declare == 0) return;
    plan.unit(act);
    if (declare == 2) plan.unit(*blocks[1]), plan.unit(*blocks[0]);
    for (std::size_t i = declare == 2 ? 2 : 0; i < blocks->size(); ++i) plan.unit(*blocks[i]);
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    if (ctx.batch_idx() == ZeroNetImpl::kSkipped) return {};
    auto loss = (forward(batch.data) - batch.target).pow(2).mean();
    ctx.log("loss", loss, {.sync_dist = true});
    return loss;
  }
  void validation_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    ctx.log("val_loss", (forward(batch.data) - batch.target).pow(2).mean(), {.sync_dist = true});
  }
  std::unique_ptr<torch::optim::Optimizer> configure_optimizers() {
    return std::make_unique<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(0.01));
  }
};

/// The most bytes of parameters, gradients and optimizer state a rank held at once, counted through the strategy's
/// layout, per phase: "forward" and "backward" as a block runs, "between steps" after a batch that stepped.
struct HeldBytes {
  struct Most {
    int64_t parameters = 0, gradients = 0, state = 0, total = 0;
  };
  std::map<std::string, Most> most;
  template <class S>
  void sample(const std::string& phase, const S& strategy, torch::optim::Optimizer& optimizer) {
    Most& m = most[phase];
    const auto p = static_cast<int64_t>(strategy.parameter_bytes()), g = static_cast<int64_t>(strategy.gradient_bytes());
    const auto o = static_cast<int64_t>(volt::detail::optimizer_state_bytes(optimizer));
    m.parameters = std::max(m.parameters, p), m.gradients = std::max(m.gradients, g), m.state = std::max(m.state, o);
    m.total = std::max(m.total, p + g + o);
  }
};

/// Between steps (after the first, which runs whole): the bytes of storage the module's parameters hold (every unit and
/// the root freed: 0) and the optimizer's parameters' (this rank's pieces); after a batch that stepped, `bytes`
/// samples "between steps".
struct HeldBetweenSteps {
  std::shared_ptr<int64_t> module_bytes = std::make_shared<int64_t>(0), piece_bytes = std::make_shared<int64_t>(0);
  std::shared_ptr<HeldBytes> bytes = std::make_shared<HeldBytes>();
  std::shared_ptr<int64_t> step = std::make_shared<int64_t>(0);
  template <class T, class M, class B>
  void on_train_batch_start(T& trainer, M&, const B&, int64_t) {
    *step = trainer.global_step();
  }
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M& module, const torch::Tensor&, const B&, int64_t) {
    if (trainer.global_step() < 1) return;
    module.laid_out = true;
    for (const auto& p : module.parameters()) *module_bytes = std::max<int64_t>(*module_bytes, p.storage().nbytes());
    int64_t pieces = 0;
    for (const auto& group : trainer.optimizer()->param_groups()) {
      for (const auto& p : group.params()) pieces += p.numel() * p.element_size();
    }
    *piece_bytes = std::max(*piece_bytes, pieces);
    if (trainer.global_step() > *step) bytes->sample("between steps", trainer.strategy(), *trainer.optimizer());
  }
};

/// After optimizer step 2 (laid out), the optimizer's state as a checkpoint gathers it, read back by LibTorch's Adam on
/// rank zero: the dtypes of its tensors (float32 whatever the units are gathered in).
struct StateDuringFit {
  std::shared_ptr<std::set<std::string>> dtypes = std::make_shared<std::set<std::string>>();
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (trainer.global_step() != 2 || !dtypes->empty()) return;
    const at::Tensor bytes = trainer.strategy().optimizer_state(*trainer.optimizer());
    dtypes->insert("gathered");
    if (!trainer.is_global_zero()) return;
    FsdpNetImpl fresh;
    torch::optim::Adam adam(fresh.parameters(), torch::optim::AdamOptions(0.01));
    volt::checkpoint::load_optimizer_state(adam, bytes, "the gathered state");
    for (const auto& [key, state] : adam.state()) {
      const auto& s = static_cast<const torch::optim::AdamParamState&>(*state);
      dtypes->insert(std::string(c10::toString(s.exp_avg().scalar_type())));
      dtypes->insert(std::string(c10::toString(s.exp_avg_sq().scalar_type())));
    }
  }
};

/// Once laid out, each training batch's all-gathers and reduce-scatters, from the flight recorder: per batch the most
/// and the fewest of each, on batches that stepped the optimizer (`stepping`) and on the others.
struct CollectiveCounts {
  struct Range {
    int64_t least = 1 << 30, most = -1;
    void add(int64_t n) { least = std::min(least, n), most = std::max(most, n); }
  };
  std::shared_ptr<std::map<std::string, Range>> seen = std::make_shared<std::map<std::string, Range>>();
  std::shared_ptr<uint64_t> from = std::make_shared<uint64_t>(0);
  std::shared_ptr<int64_t> step = std::make_shared<int64_t>(0);
  std::shared_ptr<bool> counting = std::make_shared<bool>(false);
  template <class T>
  static volt::detail::FlightRecorder& recorder(T& trainer) {
    return trainer.strategy().backend().axis().group()->recorder();
  }
  template <class T, class M, class B>
  void on_train_batch_start(T& trainer, M& module, const B&, int64_t) {
    *from = recorder(trainer).progress().issued();
    *step = trainer.global_step();
    *counting = module.laid_out;  // (the first step runs whole)
  }
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor& loss, const B&, int64_t) {
    if (!*counting || !loss.defined()) return;
    auto& r = recorder(trainer);
    const uint64_t to = r.progress().issued();
    if (to - *from > volt::detail::FlightRecorder::kKept) return;  // (older entries are gone)
    int64_t gathers = 0, scatters = 0, gather_bytes = 0, scatter_bytes = 0;
    for (uint64_t seq = *from + 1; seq <= to; ++seq) {
      const auto e = r.entry(seq);
      const bool gather = e.kind == volt::detail::Collective::all_gather;
      const bool scatter = e.kind == volt::detail::Collective::reduce_scatter;
      gathers += gather, scatters += scatter;
      gather_bytes += gather ? e.bytes : 0, scatter_bytes += scatter ? e.bytes : 0;
    }
    const std::string when = trainer.global_step() > *step ? "stepping" : "accumulating";
    (*seen)[when + " all-gathers"].add(gathers);
    (*seen)[when + " reduce-scatters"].add(scatters);
    (*seen)[when + " all-gather bytes"].add(gather_bytes);  // (a reduce-scatter's: this rank's block of the result)
    (*seen)[when + " reduce-scatter bytes"].add(scatter_bytes);
  }
};

/// The one-process reference for FSDP under Bf16Mixed on `world` ranks: zero_reference's batches, windows and steps,
/// each rank's share of a global batch run on its own under bfloat16 autocast (each rank computes its gradients in
/// bfloat16), every micro-batch's gradients averaged over the ranks in float32 and added in float32 over the window;
/// float32 weights, clipping and Adam.
template <class Module>
torch::Tensor bf16_reference(int world, int64_t n, int epochs, int accumulate, double clip) {
  auto [x, y] = data(n);
  Module net;
  auto params = net.parameters();
  torch::optim::Adam opt(params, torch::optim::AdamOptions(0.01));
  const int64_t batches = n / world / kBatch;
  for (int e = 0; e < epochs; ++e) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed + static_cast<uint64_t>(e));
    auto perm = torch::randperm(n, gen, torch::kLong);
    for (int64_t i = 0; i < batches; ++i) {
      if (i % accumulate == 0) opt.zero_grad();
      if (i == ZeroNetImpl::kSkipped) continue;
      std::vector<torch::Tensor> mean(params.size());
      for (int r = 0; r < world; ++r) {
        const auto id = perm.slice(0, r, n, world).slice(0, i * kBatch, (i + 1) * kBatch);
        volt::detail::AutocastGuard autocast(c10::DeviceType::CPU, at::kBFloat16);
        const auto loss = (net.forward(x.index_select(0, id)) - y.index_select(0, id)).pow(2).mean() / accumulate;
        const auto g = torch::autograd::grad({loss}, params);
        for (std::size_t k = 0; k < params.size(); ++k) {
          const auto share = g[k].to(torch::kFloat32) / world;
          mean[k] = mean[k].defined() ? mean[k] + share : share;
        }
      }
      torch::NoGradGuard no_grad;
      for (std::size_t k = 0; k < params.size(); ++k) {
        auto& grad = params[k].mutable_grad();
        grad = grad.defined() ? grad + mean[k] : mean[k];
      }
      if ((i + 1) % accumulate == 0 || i + 1 == batches) {
        torch::nn::utils::clip_grad_norm_(params, clip);
        opt.step();
      }
    }
  }
  return flat(net);
}

/// FSDP's net under precision `P`: the one-process reference's weights, and the mean loss of `rows` under them (as the
/// precision's forward computes it).
template <class P>
std::pair<torch::Tensor, double> fsdp_reference(int world, int64_t n, int epochs, int accumulate, double clip,
                                                const torch::Tensor& x, const torch::Tensor& y) {
  constexpr bool bf16 = std::is_same_v<P, volt::Bf16Mixed>;
  const torch::Tensor want = bf16 ? bf16_reference<FsdpNetImpl>(world, n, epochs, accumulate, clip)
                                  : zero_reference<FsdpNetImpl>(world, n, epochs, accumulate, clip, /*adam=*/true);
  FsdpNetImpl ref;
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (auto& p : ref.parameters()) {
    p.copy_(want.slice(0, at, at + p.numel()).view(p.sizes()));
    at += p.numel();
  }
  std::optional<volt::detail::AutocastGuard> autocast;
  if (bf16) autocast.emplace(c10::DeviceType::CPU, at::kBFloat16);
  return {want, (ref.forward(x) - y).pow(2).mean().item<double>()};
}

/// The FSDP net's buckets, padded to a multiple of `world`: the 5 units', then the root's.
std::vector<int64_t> fsdp_padded(int world) {
  std::vector<int64_t> out;
  for (int64_t unit : {77, 72, 50, 66, 72, 57}) out.push_back((unit + world - 1) / world * world);
  return out;
}

/// Per batch, from the flight recorder: the root and the 5 units gathered in forward (in the compute dtype, `gathered`
/// bytes an element), the units again in backward where freed after forward; every micro-batch's gradients, each
/// unit's and the root's, reduce-scattered once in float32.
template <class Counts>
void check_fsdp_collectives(const Counts& counts, int world, bool reshard, int64_t gathered, const std::string& what) {
  const auto padded = fsdp_padded(world);
  int64_t units_bytes = 0;
  for (int i = 0; i < 5; ++i) units_bytes += padded[i] * gathered;
  const int64_t all = std::accumulate(padded.begin(), padded.end(), int64_t{0});
  const int64_t units = 5, gathers = 1 + units + (reshard ? units : 0);
  const int64_t gather_bytes = padded[5] * gathered + units_bytes * (reshard ? 2 : 1);
  for (const std::string when : {"stepping", "accumulating"}) {
    for (const auto& [name, want] : std::map<std::string, int64_t>{{"all-gathers", gathers},
                                                                   {"reduce-scatters", units + 1},
                                                                   {"all-gather bytes", gather_bytes},
                                                                   {"reduce-scatter bytes", 4 * all / world}}) {
      const auto it = counts.seen->find(when + " " + name);
      check(it != counts.seen->end() && it->second.least == want && it->second.most == want,
            what + ": " + when + " " + name + " per batch " +
                (it == counts.seen->end() ? std::string("never seen")
                                          : std::to_string(it->second.least) + " to " + std::to_string(it->second.most)) +
                ", want " + std::to_string(want));
    }
  }
}

/// The bytes a rank held against ZeRO's formula for stage 3 with Adam in float32 (16 bytes an element over the world
/// size, padding included: shards 4, gradient blocks 4, Adam's two states 8 at most), plus what the forward and backward
/// gather: the root and two units (reshard_after_forward: the running one and the next, started ahead) or every unit,
/// `gathered` bytes an element; and in backward up to `kBucketsInFlight` + 1 units' float32 gradient buckets and one
/// unit's `.grad` on their way into them.
void check_fsdp_memory(const HeldBytes& held, int world, bool reshard, int64_t gathered, const std::string& what,
                       bool say) {
  const auto padded = fsdp_padded(world);
  const int64_t all = std::accumulate(padded.begin(), padded.end(), int64_t{0});
  std::vector<int64_t> units(padded.begin(), padded.begin() + 5);
  std::sort(units.rbegin(), units.rend());
  const int64_t shards = 4 * all / world, blocks = 4 * all / world, state = 8 * all / world;
  const int64_t working = gathered * (padded[5] + (reshard ? units[0] + units[1] : std::accumulate(units.begin(),
                                                                                                    units.end(), 0L)));
  const int64_t in_flight = 4 * units[0] * static_cast<int64_t>(volt::detail::kBucketsInFlight + 2);
  struct Bound {
    const char* phase;
    int64_t parameters, gradients, state;
    bool laid_out = true;
  };
  // Before the first step's layout the parameters are whole (394 elements), but its backward already reduce-scatters
  // unit by unit: its gradients stay within the blocks and a few buckets, never DDP's whole copy.
  const int64_t whole = 4 * 394;
  for (const Bound& b : {Bound{"between steps", shards, blocks, state}, Bound{"forward", shards + working, blocks, state},
                         Bound{"backward", shards + working, blocks + in_flight, state},
                         Bound{"first forward", whole, blocks, 0, false},
                         Bound{"first backward", whole, blocks + in_flight, 0, false}}) {
    const auto it = held.most.find(b.phase);
    if (it == held.most.end()) {
      check(false, what + ": no " + b.phase + " sample of the bytes held");
      continue;
    }
    const HeldBytes::Most& m = it->second;
    if (say) std::cout << what << ", " << b.phase << ": parameters " << m.parameters << " (bound " << b.parameters
              << "), gradients " << m.gradients << " (" << b.gradients << "), Adam " << m.state << " (" << b.state
              << ") bytes; DDP's 16 an element: " << 16 * 394 << std::endl;
    check(m.parameters <= b.parameters && m.gradients <= b.gradients && m.state <= b.state &&
              (!b.laid_out || (m.parameters >= shards && m.gradients >= blocks)),
          what + ", " + b.phase + ": bytes held within the formula's bound (parameters " + std::to_string(m.parameters) +
              " <= " + std::to_string(b.parameters) + ", gradients " + std::to_string(m.gradients) + " <= " +
              std::to_string(b.gradients) + ", state " + std::to_string(m.state) + " <= " + std::to_string(b.state) + ")");
  }
  const auto between = held.most.find("between steps");
  if (between != held.most.end()) {
    check(between->second.total <= 16 * all / world, what + ": between steps " + std::to_string(between->second.total) +
                                                         " bytes, ZeRO-3's 16 bytes an element over the ranks " +
                                                         std::to_string(16 * all / world));
  }
}
/// What every rank of fsdp_scenario checks (Script): the same weights everywhere, nothing gathered between steps, its
/// pieces and Adam state its share, the units gathered at once while one runs and in which dtype, the collectives and
/// the bytes held per phase.
template <class T>
void check_fsdp_rank(T& trainer, FsdpNetImpl& net, const HeldBetweenSteps& held, const CollectiveCounts& counts,
                     int world, bool reshard, const std::string& what) {
  constexpr bool bf16 = std::is_same_v<typename T::precision_type, volt::Bf16Mixed>;
  const torch::Tensor every = trainer.strategy().all_gather(flat(net));
  check(torch::equal(std::get<0>(every.min(0)), std::get<0>(every.max(0))), "every rank ends with the same weights");
  check(*held.module_bytes == 0, "between steps the module's parameters hold " + std::to_string(*held.module_bytes) +
                                     " bytes of storage at most (want 0: every unit and the root freed)");
  int64_t elements = 0;
  for (const auto& p : net.parameters()) elements += p.numel();
  const auto padded = fsdp_padded(world);
  const int64_t all = std::accumulate(padded.begin(), padded.end(), int64_t{0});
  const int64_t pieces =
      trainer.strategy().all_reduce(torch::tensor({*held.piece_bytes}), volt::Reduce::sum).template item<int64_t>();
  check(*held.piece_bytes <= 4 * all / world && pieces == 4 * elements,
        "this rank's pieces are its share: " + std::to_string(*held.piece_bytes) + " bytes (at most " +
            std::to_string(4 * all / world) + "), all ranks' " + std::to_string(pieces) + " of " +
            std::to_string(4 * elements));
  const int64_t most = reshard ? 2 : 5;
  check(net.most_gathered <= most && net.most_gathered >= 1,
        what + ": at most " + std::to_string(most) + " blocks gathered while one ran (saw " +
            std::to_string(net.most_gathered) + ")");
  const std::set<std::string> dtypes{bf16 ? "BFloat16" : "Float"};
  check(net.dtypes == dtypes, what + ": the blocks ran forward with their weights in " + *dtypes.begin() + " (saw " +
                                  std::to_string(net.dtypes.size()) + " dtypes: " +
                                  (net.dtypes.empty() ? std::string("none") : *net.dtypes.begin()) + ")");
  check_fsdp_collectives(counts, world, reshard, bf16 ? 2 : 4, what);
  // (Activation checkpointing runs each block's forward again inside backward: the phases are not told apart there.)
  if (net.which.every == 0) check_fsdp_memory(*held.bytes, world, reshard, bf16 ? 2 : 4, what, trainer.is_global_zero());
  const auto mine = static_cast<int64_t>(volt::detail::optimizer_state_bytes(*trainer.optimizer()));
  const int64_t total = trainer.strategy().all_reduce(torch::tensor({mine}), volt::Reduce::sum).template item<int64_t>();
  check(total == elements * 4 * 2, "the ranks' Adam states add up to one unsharded state (" + std::to_string(total) +
                                       " bytes, want " + std::to_string(elements * 8) + ")");
  check(net.parameters().front().scalar_type() == torch::kFloat32, "after the fit the module is float32 again");
}

/// FSDP on `world` ranks under precision `P` (Adam, accumulation 3, clipping; `reshard` after forward or not;
/// activation checkpointing in every unit or not) against the one-process loop on the global batches (Bf16Mixed:
/// bf16_reference); between steps no parameter holds storage and each rank's pieces are its share; while a block runs,
/// at most 2 blocks are gathered (its own and the next one's, started ahead) where units are freed after forward, in
/// the precision's compute dtype; the collectives and the bytes held per phase as the formulas say.
template <class L, class P>
int fsdp_scenario(int world, bool reshard, bool checkpointing) {
  constexpr bool bf16 = std::is_same_v<P, volt::Bf16Mixed>;
  const int64_t n = 96;
  const int epochs = 2, accumulate = 3;
  const double clip = 0.05;
  auto [x, y] = data(n);
  FsdpNetImpl net;
  net.which = volt::ActivationCheckpointing{.every = checkpointing ? 1u : 0u};
  HeldBetweenSteps held;
  CollectiveCounts counts;
  StateDuringFit state;
  auto trainer = volt::make_trainer<volt::FSDP<L, volt::Mpi>, P>(
      {.devices = world / g_nodes, .num_nodes = g_nodes, .max_epochs = epochs, .accumulate_grad_batches = accumulate,
       .gradient_clip_val = clip}, held, counts, state);
  trainer.strategy().set_reshard_after_forward(reshard);
  net.probe = [&](const char* phase) { held.bytes->sample(phase, trainer.strategy(), *trainer.optimizer()); };
  volt::data::TensorLoader loader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed});
  // 32 validation samples: on 3 ranks padded to 33 (sample 0 twice), 11 a rank in batches of 4, 4 and 3, every rank
  // as many forwards (each gathers every unit).
  const auto [vx, vy] = data(n + 32);
  const torch::Tensor val_x = vx.slice(0, n), val_y = vy.slice(0, n);
  const volt::FitResult result = trainer.fit(net, loader, volt::data::TensorLoader(val_x, val_y, {.batch_size = kBatch}));
  const std::string what = std::string("FSDP on ") + std::to_string(world) + " ranks (reshard_after_forward " +
                           (reshard ? "on" : "off") + (checkpointing ? ", activation checkpointing" : "") +
                           (bf16 ? ", Bf16Mixed" : "") + ")";
  if (std::is_same_v<L, volt::Spawn> || trainer.is_global_zero()) {
    const int64_t padded_n = (32 + world - 1) / world * world;  // DistributedSampler's padding: the first samples again
    const auto rows = torch::cat({torch::arange(32), torch::arange(padded_n - 32)});
    const auto [want, want_val] =
        fsdp_reference<P>(world, n, epochs, accumulate, clip, val_x.index_select(0, rows), val_y.index_select(0, rows));
    const double diff = (flat(net) - want).abs().max().template item<double>();
    // Bf16Mixed: the reference computes the ranks' bfloat16 gradients as they do; what is left is the order of float32
    // sums (MPI's reduction, the window's) and where float32 losses round to bfloat16 (measured: up to 1e-6).
    const double atol = bf16 ? 1e-5 : 1e-6, rtol = bf16 ? 1e-4 : 1e-5;
    std::cout << what << ": max |weights - reference| = " << diff << std::endl;
    check(torch::allclose(flat(net), want, rtol, atol),
          what + ": weights equal the one-process reference (max diff " + std::to_string(diff) + ")");
    // The last validation ran on the final weights: its mean over the ranks' batches is the reference's over the 32
    // samples and their padding (Bf16Mixed: each batch's mean rounded to bfloat16).
    const auto got_val = result.metrics.find("val_loss");
    if constexpr (std::is_same_v<L, volt::Script>) {
      check(*state.dtypes == std::set<std::string>{"Float", "gathered"},
            what + ": the Adam state a checkpoint gathers during the fit is float32 (saw " +
                std::to_string(state.dtypes->size()) + " kinds: " +
                (state.dtypes->empty() ? std::string("none") : *state.dtypes->rbegin()) + ")");
    }
    check(got_val != result.metrics.end() && std::abs(got_val->second - want_val) < (bf16 ? 1e-2 : 1e-5) * (1 + want_val),
          what + ": the last validation's loss is the final weights' over every sample (got " +
              (got_val == result.metrics.end() ? std::string("none") : std::to_string(got_val->second)) + ", want " +
              std::to_string(want_val) + ")");
  }
  if constexpr (std::is_same_v<L, volt::Script>) check_fsdp_rank(trainer, net, held, counts, world, reshard, what);
  return failures == 0 ? 0 : 1;
}

/// FSDP of a module that declares its units (configure_model): the parameters are laid out as the fit starts, so its
/// first step runs sharded as every later one (at most 2 blocks gathered while one runs: its own and the next's), and
/// the weights end on the one-process loop's (accumulation 3, clipping). `swapped_on`: that rank declares two blocks
/// the other way round, which every rank refuses before any step.
int fsdp_declared_scenario(int world, int swapped_on) {
  const int64_t n = 96;
  const int epochs = 2, accumulate = 3;
  const double clip = 0.05;
  auto [x, y] = data(n);
  FsdpNetImpl net;
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  net.declare = rank != nullptr && std::atoi(rank) == swapped_on ? 2 : 1;
  auto trainer = volt::make_trainer<volt::FSDP<volt::Script, volt::Mpi>>(
      {.devices = world / g_nodes, .num_nodes = g_nodes, .max_epochs = epochs, .accumulate_grad_batches = accumulate,
       .gradient_clip_val = clip});
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed}));
  const std::string what = "FSDP of declared units on " + std::to_string(world) + " ranks";
  check(net.first_most_gathered >= 1 && net.first_most_gathered <= 2,
        what + ": from the first step on at most 2 blocks gathered while one ran (saw " +
            std::to_string(net.first_most_gathered) + " of 5)");
  if (trainer.is_global_zero()) {
    const torch::Tensor want = zero_reference<FsdpNetImpl>(world, n, epochs, accumulate, clip, /*adam=*/true);
    const double diff = (flat(net) - want).abs().max().item<double>();
    std::cout << what << ": max |weights - reference| = " << diff << std::endl;
    check(torch::allclose(flat(net), want, 1e-5, 1e-6), what + ": weights equal the one-process reference (max diff " +
                                                            std::to_string(diff) + ")");
  }
  return failures == 0 ? 0 : 1;
}

/// Fp16Mixed's loss scaling without its float16 autocast, so that it runs on the CPU: its scaler's inf check is tested.
struct ScaledFp32 : volt::Fp16Mixed {
  static constexpr const char* name = "ScaledFp32";
  static constexpr bool needs_fp16_autocast = false;
  using Fp16Mixed::Fp16Mixed;
  volt::PrecisionDefaults::NoGuard forward_context(c10::DeviceType) { return {}; }
};

/// Puts an inf into rank 1's first piece's gradient after the backward of epoch 0's batch `batch`.
struct PoisonRankOne {
  int64_t batch = 3;
  int64_t now = -1;
  template <class T, class M, class B>
  void on_train_batch_start(T&, M&, const B&, int64_t batch_idx) {
    now = batch_idx;
  }
  template <class T, class M>
  void on_after_backward(T& trainer, M&) {
    if (trainer.strategy().global_rank() != 1 || trainer.current_epoch() != 0 || now != batch) return;
    torch::NoGradGuard no_grad;
    trainer.optimizer()->param_groups()[0].params()[0].mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
  }
};

/// ZeRO stage `Stage` on 2 ranks with a scaled loss whose gradients hold an inf on rank 1 only, at one step: every rank
/// skips that step (the inf check agreed) and backs the scale off; the weights equal a one-process loop without it.
template <int Stage>
int zero_inf_scenario() {
  const int64_t n = 96;
  const int64_t poisoned = 3;
  auto [x, y] = data(n);
  ZeroNetImpl net;
  net.adam = false;
  auto trainer = volt::make_trainer<volt::ZeRO<Stage, volt::Script, volt::Mpi>, ScaledFp32>(
      {.devices = g_world, .max_epochs = 2}, PoisonRankOne{poisoned});
  trainer.strategy().set_bucket_bytes(256, 512);
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed}));
  const torch::Tensor every = trainer.strategy().all_gather(flat(net));
  check(torch::equal(std::get<0>(every.min(0)), std::get<0>(every.max(0))), "every rank ends with the same weights");
  const double scale = trainer.precision().scaler().state_dict().at("scale");
  check(scale == 65536.0 / 2, "the loss scale backed off once (" + std::to_string(scale) + ", want 32768)");
  if (trainer.is_global_zero()) {
    const torch::Tensor want = zero_reference(g_world, n, 2, 1, 1e9, false, poisoned);
    const double diff = (flat(net) - want).abs().max().item<double>();
    std::cout << "ZeRO<" << Stage << "> with an inf on rank 1: max |weights - reference| = " << diff << std::endl;
    check(torch::allclose(flat(net), want, 1e-5, 1e-6), "the poisoned step was skipped on every rank (max diff " +
                                                            std::to_string(diff) + ")");
  }
  return failures == 0 ? 0 : 1;
}

/// ZeRO<2> on 2 ranks whose module unfreezes a layer during the fit: refused (the layout is made once), on every rank.
int zero_unfreeze_scenario() {
  auto [x, y] = data(96);
  ZeroNetImpl net;
  net.unfreeze = true;
  for (auto& p : net.a->parameters()) p.set_requires_grad(false);
  auto trainer = volt::make_trainer<volt::ZeRO<2, volt::Script, volt::Mpi>>({.devices = g_world, .max_epochs = 1});
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = kBatch}));
  std::cerr << "fit returned although a parameter was unfrozen during a ZeRO fit" << std::endl;
  return 3;
}

// ---- max_time across ranks -------------------------------------------------------------------------------------

/// max_time on 2 ranks whose steps take different times (rank 1's twice rank 0's): rank zero's clock decides for
/// both, so they stop after the same batch, the checkpoint holds that step, and the fit returns on both.
int max_time_scenario() {
  struct Slow : NetImpl {
    int rank = 0;
    torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
      std::this_thread::sleep_for(std::chrono::milliseconds(rank == 0 ? 20 : 40));
      return NetImpl::training_step(b, ctx);
    }
  } net;
  auto [x, y] = data(256);
  const std::string dir = "/tmp/volt_dist_max_time_" + std::to_string(::getppid());
  std::error_code gone;
  std::filesystem::remove_all(dir, gone);  // nothing of an earlier run (its interrupted.ckpt would make ours -v1)
  auto trainer = volt::make_trainer<volt::DDP<volt::Script, volt::Mpi>>(
      {.devices = g_world, .max_epochs = 4, .max_time = std::chrono::milliseconds(250), .default_root_dir = dir});
  net.rank = trainer.strategy().global_rank();
  volt::data::TensorLoader loader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed});
  trainer.fit(net, loader);  // returns: no exception, no exit
  const int64_t step = trainer.global_step();
  const torch::Tensor steps = trainer.strategy().all_gather(torch::tensor({step}));
  std::cout << "rank " << net.rank << " stopped at step " << step << std::endl;
  check(steps.min().item<int64_t>() == steps.max().item<int64_t>(), "every rank stopped at the same step");
  check(step > 0 && step < 4 * (256 / g_world / kBatch), "the time limit stopped the fit before its end");
  if (trainer.is_global_zero()) {
    const auto loops = volt::checkpoint::read(dir + "/checkpoints/interrupted.ckpt").at("loops").toGenericDict();
    check(loops.at("global_step").toInt() == step, "the checkpoint holds the step the fit stopped at");
  }
  trainer.strategy().barrier();
  if (trainer.is_global_zero()) std::filesystem::remove_all(dir);
  return failures == 0 ? 0 : 1;
}

// ---- manual optimization under DDP ---------------------------------------------------------------------------

/// The net with manual optimization: SGD steps `a` and `b` on every batch (their parameters alone toggled on), Adam
/// steps `c` every second batch, its gradients accumulated by hand over two batches with the first backward under
/// ctx.no_sync() (its loss a second forward, halved).
struct ManualNetImpl : NetImpl {
  static constexpr bool automatic_optimization = false;
  std::tuple<std::unique_ptr<torch::optim::SGD>, std::unique_ptr<torch::optim::Adam>> configure_optimizers() {
    std::vector<torch::Tensor> ab = a->parameters();
    for (const auto& p : b->parameters()) ab.push_back(p);
    return {std::make_unique<torch::optim::SGD>(ab, torch::optim::SGDOptions(0.1).momentum(0.9)),
            std::make_unique<torch::optim::Adam>(c->parameters(), torch::optim::AdamOptions(1e-2))};
  }
  void training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto opts = ctx.optimizers();
    ctx.toggle_optimizer(opts[0]);
    auto loss = (forward(batch.data) - batch.target).pow(2).mean();
    opts[0].zero_grad();
    // `c` is frozen while `a` and `b` train: its gradient (on odd batches, this rank's own half of the accumulation)
    // must come out of the synchronised backward as it went in.
    const torch::Tensor c_grad = c->weight.grad().defined() ? c->weight.grad().clone() : torch::Tensor();
    ctx.manual_backward(loss);
    if (c_grad.defined() != c->weight.grad().defined() || (c_grad.defined() && !torch::equal(c_grad, c->weight.grad()))) {
      throw std::runtime_error("the backward for a and b changed the gradient of the frozen c");
    }
    opts[0].step();
    ctx.untoggle_optimizer(opts[0]);
    ctx.toggle_optimizer(opts[1]);
    auto half = (forward(batch.data) - batch.target).pow(2).mean() / 2;
    if (ctx.batch_idx() % 2 == 0) {
      opts[1].zero_grad();
      auto no_sync = ctx.no_sync();
      ctx.manual_backward(half);
    } else {
      ctx.manual_backward(half);
      opts[1].step();
    }
    ctx.untoggle_optimizer(opts[1]);
    ctx.log("loss", loss, {.sync_dist = true});
  }
};
TORCH_MODULE(ManualNet);

/// The one-process reference of ManualNet on the global batches (see reference_weights).
torch::Tensor manual_reference_weights(int64_t n, int epochs) {
  auto [x, y] = data(n);
  Net net;
  std::vector<torch::Tensor> ab = net->a->parameters();
  for (const auto& p : net->b->parameters()) ab.push_back(p);
  torch::optim::SGD first(ab, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::Adam second(net->c->parameters(), torch::optim::AdamOptions(1e-2));
  auto freeze = [&](std::vector<torch::Tensor> ps, bool on) {
    for (auto& p : ps) p.set_requires_grad(on);
  };
  const int64_t local = n / g_world, batches = local / kBatch;
  for (int e = 0; e < epochs; ++e) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed + static_cast<uint64_t>(e));
    auto perm = torch::randperm(n, gen, torch::kLong);
    for (int64_t i = 0; i < batches; ++i) {
      std::vector<torch::Tensor> idx;
      for (int r = 0; r < g_world; ++r) idx.push_back(perm.slice(0, r, n, g_world).slice(0, i * kBatch, (i + 1) * kBatch));
      auto id = torch::cat(idx);
      const auto bx = x.index_select(0, id), by = y.index_select(0, id);
      freeze(net->c->parameters(), false);
      first.zero_grad();
      (net->forward(bx) - by).pow(2).mean().backward();
      first.step();
      freeze(net->c->parameters(), true);
      freeze(ab, false);
      if (i % 2 == 0) second.zero_grad();
      ((net->forward(bx) - by).pow(2).mean() / 2).backward();
      if (i % 2 == 1) second.step();
      freeze(ab, true);
    }
  }
  return flat(*net);
}

template <class L>
int manual_scenario() {
  const int64_t n = 64;
  const int epochs = 2;
  auto [x, y] = data(n);
  ManualNet net;
  volt::Trainer<volt::DDP<L, volt::Mpi>> trainer({.devices = g_world, .max_epochs = epochs});
  trainer.strategy().set_bucket_bytes(256, 512);  // several buckets, some holding parameters of both optimizers
  volt::data::TensorLoader loader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed});
  trainer.fit(net, loader);
  if (std::is_same_v<L, volt::Spawn> || trainer.is_global_zero()) {
    const torch::Tensor want = manual_reference_weights(n, epochs);
    const torch::Tensor got = flat(*net);
    const double diff = (got - want).abs().max().item<double>();
    std::cout << "max |ddp manual - reference| = " << diff << std::endl;
    check(torch::allclose(got, want, 1e-5, 1e-6),
          "DDP manual-optimization weights equal the one-process reference (max diff " + std::to_string(diff) + ")");
    const int64_t batches = n / g_world / kBatch, steps = epochs * (batches + batches / 2);
    check(trainer.global_step() == steps, "global_step() = " + std::to_string(trainer.global_step()) + " counts both "
          "optimizers' steps (want " + std::to_string(steps) + ")");
  }
  return failures == 0 ? 0 : 1;
}

/// Records the sample indices (the data is the index) each rank sees. At every epoch's end the ranks'
/// lists are gathered and rank 0 checks them; a wrong epoch throws, which fails the fit in every launcher
/// (under Spawn, code after fit does not run in the workers, so the checks live inside the fit).
struct IndexNetImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  int64_t n;
  std::vector<int64_t> seen;
  std::vector<std::vector<int64_t>> orders;
  explicit IndexNetImpl(int64_t n_) : n(n_) { lin = register_module("lin", torch::nn::Linear(1, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context&) {
    auto ids = batch.data.squeeze(1).to(torch::kLong);
    for (int64_t i = 0; i < ids.size(0); ++i) seen.push_back(ids[i].item<int64_t>());
    return lin(batch.data).sum() * 0;
  }
  void on_train_epoch_end(volt::Context& ctx) {
    auto all = ctx.all_gather(torch::tensor(seen, torch::kLong));  // equal lengths: DDP pads the shards
    seen.clear();
    if (!ctx.is_global_zero()) return;
    std::vector<int64_t> epoch(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
    std::map<int64_t, int> count;
    for (int64_t i : epoch) ++count[i];
    int64_t extra = 0;
    for (auto& [i, c] : count) extra += c - 1;
    const int64_t pad = (g_world - n % g_world) % g_world;
    std::ostringstream why;
    if (static_cast<int64_t>(count.size()) != n || count.begin()->first != 0 || count.rbegin()->first != n - 1) {
      why << "epoch " << ctx.current_epoch() << ": " << count.size() << " distinct samples of " << n;
    } else if (extra != pad) {
      why << "epoch " << ctx.current_epoch() << ": " << extra << " repeats, but the padding is " << pad;
    } else if (!orders.empty() && orders.back() == epoch) {
      why << "epoch " << ctx.current_epoch() << " repeats the previous epoch's order";
    }
    if (!why.str().empty()) throw std::runtime_error("index check failed: " + why.str());
    orders.push_back(epoch);
    std::cout << "epoch " << ctx.current_epoch() << ": all " << n << " samples seen once across ranks (" << extra
              << " padding repeats)" << std::endl;
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.0)); }
};
TORCH_MODULE(IndexNet);

template <class L>
int indices_scenario(int64_t n) {
  auto x = torch::arange(n, torch::kFloat32).unsqueeze(1);
  auto y = torch::zeros({n, 1});
  IndexNet net(n);
  volt::Trainer<volt::DDP<L>> trainer({.devices = g_world, .max_epochs = 3});
  volt::data::TensorLoader loader(x, y, {.batch_size = 3, .shuffle = true, .seed = 5});
  trainer.fit(net, loader);
  return failures == 0 ? 0 : 1;
}

/// predict and validate over 1001 samples (batches of 10, the last of 1) on WORLD ranks: predict returns every
/// batch's result once, in the loader's order, on every rank; the validation mean is the mean over the 1001
/// samples. The reference is a hand-written loop in the same process (rank 0's weights, which DDP broadcasts).
struct PredictNetImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  PredictNetImpl() { lin = register_module("lin", torch::nn::Linear(4, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) { return lin(b.data).sum(); }
  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    ctx.log("val_loss", (lin(b.data) - b.target).pow(2).mean(), {.sync_dist = true});
    ctx.log("val_count", static_cast<double>(b.data.size(0)), {.reduce = volt::Reduce::sum, .sync_dist = true});
  }
  torch::Tensor predict_step(const torch::data::Example<>& b, volt::Context&) { return lin(b.data); }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.0)); }
};
TORCH_MODULE(PredictNet);

/// The PredictionWriter's files of `world` ranks in `dir` hold every sample's prediction once, equal to `want`'s row.
void check_written(const std::string& dir, int world, const torch::Tensor& want) {
  std::vector<int> seen(static_cast<std::size_t>(want.size(0)), 0);
  for (int r = 0; r < world; ++r) {
    const auto d = volt::checkpoint::read(dir + "/predictions_rank" + std::to_string(r) + ".pt");
    const auto preds = d.at("predictions").toList(), indices = d.at("batch_indices").toList();
    check(preds.size() == indices.size() && d.at("world_size").toInt() == world, "rank " + std::to_string(r) + "'s file");
    for (std::size_t b = 0; b < std::min(preds.size(), indices.size()); ++b) {
      const torch::Tensor p = preds.get(b).toTensor(), idx = indices.get(b).toTensor();
      for (int64_t j = 0; j < idx.size(0); ++j) {
        const int64_t i = idx[j].item<int64_t>();
        ++seen[static_cast<std::size_t>(i)];
        if (!torch::equal(p[j], want[i])) check(false, "the written prediction of sample " + std::to_string(i));
      }
    }
  }
  check(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }), "every sample written once");
}

template <class L>
int predict_scenario(int world) {
  constexpr int64_t n = 1001, batch = 10;
  auto [x, y] = data(n);
  PredictNet net;
  const std::string dir = (std::filesystem::temp_directory_path() / ("volt_predict_" + std::string(std::is_same_v<L, volt::Spawn> ? "spawn" : "script") +
                                                                     std::to_string(world))).string();
  auto trainer = volt::make_trainer<volt::DDP<L>, volt::Fp32, volt::CPU>(
      {.devices = world / g_nodes, .num_nodes = g_nodes}, volt::PredictionWriter({.dirpath = dir}));
  volt::data::TensorLoader loader(x, y, {.batch_size = batch});
  const std::vector<torch::Tensor> got = trainer.predict(net, loader);
  const auto metrics = trainer.validate(net, loader);
  // The same predictions written by each rank with their samples' indices, none kept.
  check(trainer.predict(net, loader, /*return_predictions=*/false).empty(), "return_predictions=false keeps none");
  trainer.strategy().barrier();
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> want;
  for (int64_t start = 0; start < n; start += batch) want.push_back(net->lin(x.narrow(0, start, std::min(batch, n - start))));
  const double mean = (net->lin(x) - y).pow(2).mean().template item<double>();
  check(got.size() == want.size(), "predict returns " + std::to_string(got.size()) + " batches of " +
                                       std::to_string(want.size()));
  for (std::size_t k = 0; k < std::min(got.size(), want.size()); ++k) {
    if (!torch::equal(got[k], want[k])) {
      check(false, "predict's batch " + std::to_string(k) + " differs from the one-process batch");
      break;
    }
  }
  if (trainer.is_global_zero()) check_written(dir, trainer.strategy().world_size(), torch::cat(want));
  trainer.strategy().barrier();  // every rank has read what it checks: the folder goes
  if (trainer.is_global_zero()) std::filesystem::remove_all(dir);
  if constexpr (std::is_same_v<L, volt::Script>) check_placement(trainer.strategy());
  check(metrics.at("val_count") == static_cast<double>(n), "validation counted " + std::to_string(metrics.at("val_count")) +
                                                               " samples of " + std::to_string(n));
  check(std::abs(metrics.at("val_loss") - mean) <= 1e-6 * std::abs(mean),
        "validation mean " + std::to_string(metrics.at("val_loss")) + " vs " + std::to_string(mean) + " over the samples");
  if (failures == 0 && trainer.is_global_zero()) {
    std::cout << "predict: " << got.size() << " batches in order on " << trainer.strategy().world_size() << " ranks; validation mean over "
              << n << " samples matches; the PredictionWriter's files hold every sample once" << std::endl;
  }
  return failures == 0 ? 0 : 1;
}

/// volt::Mpi's flat reduce-scatter and all-gather against known answers, on every rank count mpirun gives: rank r's
/// flat tensor holds (r + 1) * (i + 1) at element i, so the reduced block k holds (i + 1) times the sum, mean, max or
/// min of 1..W at i = k*n + j; each rank's block given to the all-gather holds 1000 r + j, the others -1.
int collectives_scenario() {
  volt::detail::MpiRuntime::instance().ensure_initialized();
  // Lives to the end of the process, as a launcher's group does (MPI closes it at exit).
  auto* group = new volt::detail::MpiGroup(MPI_COMM_WORLD);
  volt::Mpi mpi(group);
  const int w = group->size(), r = group->rank();
  const int64_t n = 5;
  const double sum = w * (w + 1) / 2.0;
  const std::vector<std::pair<volt::Reduce, double>> ops{
      {volt::Reduce::sum, sum}, {volt::Reduce::mean, sum / w}, {volt::Reduce::max, w}, {volt::Reduce::min, 1}};
  for (const auto dtype : {torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kFloat16, torch::kInt64}) {
    for (const auto& [op, factor] : ops) {
      if (op == volt::Reduce::mean && dtype == torch::kInt64) continue;
      const torch::Tensor index = torch::arange(w * n, torch::kFloat64) + 1;
      const torch::Tensor flat = (index * (r + 1)).to(dtype);
      auto work = mpi.ireduce_scatter_(flat, op);
      work.wait();
      const torch::Tensor want = (index.narrow(0, r * n, n) * factor).to(dtype);
      check(torch::equal(volt::detail::block_of(flat, r, w), want),
            std::string("reduce-scatter ") + c10::toString(dtype) + " op " + std::to_string(static_cast<int>(op)));
    }
    const torch::Tensor gathered = torch::full({w * n}, -1.0, torch::kFloat64).to(dtype);
    volt::detail::block_of(gathered, r, w).copy_(torch::arange(n) + 1000 * r);
    mpi.iall_gather_(gathered).wait();
    torch::Tensor want = torch::empty({w, n}, torch::kFloat64);
    for (int k = 0; k < w; ++k) want[k] = torch::arange(n, torch::kFloat64) + 1000 * k;
    check(torch::equal(gathered, want.reshape(-1).to(dtype)), std::string("all-gather ") + c10::toString(dtype));
  }
  // A view of a larger tensor works in place; a length that does not divide is refused with the shape.
  torch::Tensor outer = torch::zeros({w * 4 + 3});
  torch::Tensor view = outer.narrow(0, 3, w * 4);
  view.fill_(1.0);
  mpi.reduce_scatter_(view, volt::Reduce::sum);
  check(volt::detail::block_of(view, r, w).eq(w).all().item<bool>(), "reduce-scatter into a view");
  check(outer.narrow(0, 0, 3).eq(0).all().item<bool>(), "nothing outside the view written");
  try {
    mpi.reduce_scatter_(torch::zeros({w * 4 + 1}), volt::Reduce::sum);
    check(w == 1, "a flat tensor of " + std::to_string(w * 4 + 1) + " elements is refused");
  } catch (const std::invalid_argument& e) {
    check(std::string(e.what()).find("equal blocks") != std::string::npos, std::string("the refusal: ") + e.what());
  }
  if (r == 0) std::cout << "collectives: reduce-scatter and all-gather on " << w << " ranks match" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// The world rank at `coord` of a row-major mesh of `sizes` (the layout volt::Mesh documents), written out here as
/// the reference the mesh's members are checked against.
int mesh_rank(const std::vector<int>& sizes, const std::vector<int>& coord) {
  int r = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) r = r * sizes[k] + coord[k];
  return r;
}

/// The members of axis `k` through world rank `rank` of a row-major mesh of `sizes`, by their coordinate.
std::vector<int> mesh_line(const std::vector<int>& sizes, int rank, std::size_t k) {
  std::vector<int> coord(sizes.size());
  for (std::size_t j = sizes.size(), rest = static_cast<std::size_t>(rank); j-- > 0;) {
    coord[j] = static_cast<int>(rest % static_cast<std::size_t>(sizes[j]));
    rest /= static_cast<std::size_t>(sizes[j]);
  }
  std::vector<int> line;
  for (int i = 0; i < sizes[k]; ++i) {
    coord[k] = i;
    line.push_back(mesh_rank(sizes, coord));
  }
  return line;
}

/// volt::Mesh on 4 ranks (mpirun -np 4): a 2x2 mesh, and a 2x1x2 one with an axis of one. Along each axis: the
/// members are the row-major line through this rank; all-reduce (sum, mean), reduce-scatter, all-gather and broadcast
/// give the sums, means and values of the line's members (each rank contributes its world rank + 1); sends and
/// receives go both ways along the axis (one batch with each rank sending to and receiving from the other, bfloat16
/// into a transposed view; then a reply whose value depends on what arrived); the flight recorder names the axis and
/// the peer. A mesh that does not fit the job and an unknown axis are refused with the sizes and the axes.
int mesh_scenario() {
  volt::detail::MpiRuntime::instance().ensure_initialized();
  auto* group = new volt::detail::MpiGroup(MPI_COMM_WORLD);  // lives to the end of the process, as a launcher's does
  const int world = group->size(), me = group->rank();
  check(world == 4, "the mesh scenario runs on 4 ranks, got " + std::to_string(world));
  const std::vector<std::pair<std::vector<volt::Mesh::Dim>, std::vector<int>>> meshes{
      {{{"data", 2}, {"tensor", 2}}, {2, 2}}, {{{"pipe", -1}, {"data", 1}, {"tensor", 2}}, {2, 1, 2}}};
  for (const auto& [dims, sizes] : meshes) {
    volt::Mesh mesh(group, dims);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const volt::MeshAxis& axis = mesh.axis(dims[k].name);
      const std::vector<int> line = mesh_line(sizes, me, k);
      const std::string where = mesh.shape() + ", axis " + axis.name() + ", rank " + std::to_string(me);
      check(axis.members() == line && axis.size() == sizes[k] && line[static_cast<std::size_t>(axis.rank())] == me,
            where + ": the members are the row-major line through this rank");
      double sum = 0;
      for (int m : line) sum += m + 1;
      volt::Mpi mpi(axis);
      torch::Tensor t = torch::full({3}, me + 1.0);
      mpi.all_reduce_(t, volt::Reduce::sum);
      check(t.eq(sum).all().item<bool>(), where + ": all-reduce sums the line");
      t.fill_(me + 1.0);
      mpi.all_reduce_(t, volt::Reduce::mean);
      check(t.eq(sum / axis.size()).all().item<bool>(), where + ": the mean divides by the axis size");
      torch::Tensor flat = torch::full({2 * axis.size()}, me + 1.0);
      mpi.reduce_scatter_(flat, volt::Reduce::sum);
      check(volt::detail::block_of(flat, axis.rank(), axis.size()).eq(sum).all().item<bool>(), where + ": reduce-scatter");
      volt::detail::block_of(flat, axis.rank(), axis.size()).fill_(me);
      mpi.all_gather_(flat);
      for (int i = 0; i < axis.size(); ++i) {
        check(volt::detail::block_of(flat, i, axis.size()).eq(line[static_cast<std::size_t>(i)]).all().item<bool>(),
              where + ": all-gather block " + std::to_string(i));
      }
      torch::Tensor b = torch::full({2}, static_cast<double>(me));
      mpi.broadcast_(b, axis.size() - 1);
      check(b.eq(line.back()).all().item<bool>(), where + ": broadcast from the last member");
      const torch::Tensor stacked = mpi.all_gather(torch::tensor({static_cast<double>(me)}));
      for (int i = 0; i < axis.size(); ++i) {
        check(stacked[i][0].item<double>() == line[static_cast<std::size_t>(i)], where + ": stacked all_gather");
      }
      if (axis.size() < 2) continue;
      // Both ways at once: each sends its rank in bfloat16 to the next on the line and receives from the previous,
      // into a transposed (non-contiguous) view; then the first replies to the last with what it received, doubled.
      const int next = (axis.rank() + 1) % axis.size(), prev = (axis.rank() + axis.size() - 1) % axis.size();
      const torch::Tensor out = (torch::arange(6, torch::kFloat32).reshape({2, 3}) + 10 * me).to(torch::kBFloat16);
      torch::Tensor in_storage = torch::zeros({3, 2}, torch::kBFloat16), in = in_storage.t();
      mpi.ibatch_({{volt::P2P::send, out, next}, {volt::P2P::recv, in, prev}}).wait();
      const int from = line[static_cast<std::size_t>(prev)];
      check(torch::equal(in, (torch::arange(6, torch::kFloat32).reshape({2, 3}) + 10 * from).to(torch::kBFloat16)),
            where + ": received rank " + std::to_string(from) + "'s tensor into a transposed view");
      torch::Tensor reply = torch::zeros({1}, torch::kFloat64);
      if (axis.rank() == 0) {
        mpi.isend_(torch::tensor({2.0 * in[0][0].item<double>()}, torch::kFloat64), axis.size() - 1).wait();
      } else if (axis.rank() == axis.size() - 1) {
        mpi.irecv_(reply, 0).wait();
        check(reply.item<double>() == 2.0 * 10 * me, where + ": the first member's reply (what it received from the "
                                                              "last, doubled) reaches the last");
      }
      const std::string recent = group->recorder().recent(8);
      check(recent.find(std::string("on axis ") + axis.name()) != std::string::npos &&
                recent.find("send #") != std::string::npos && recent.find("to rank " + std::to_string(line[next])) != std::string::npos,
            where + ": the flight recorder names the axis and the peer: " + recent);
    }
  }
  for (const auto& [dims, what] : std::vector<std::pair<std::vector<volt::Mesh::Dim>, std::string>>{
           {{{"data", 3}, {"tensor", 2}}, "does not fit a job of 4 ranks"},
           {{{"data", -1}, {"tensor", -1}}, "one of them -1 at most"},
           {{{"data", 2}, {"data", 2}}, "distinct names"}}) {
    try {
      volt::Mesh bad(group, dims);
      check(false, "a mesh of " + bad.shape() + " is refused on 4 ranks");
    } catch (const std::invalid_argument& e) {
      check(std::string(e.what()).find(what) != std::string::npos, std::string("the refusal: ") + e.what());
    }
  }
  // Roles: the data axes flattened are the ranks that share every other coordinate, in world-rank order (row-major
  // along the data axes), here two data axes with a tensor axis between them; a mesh of data axes only is the world.
  for (const auto& [dims, sizes] : std::vector<std::pair<std::vector<volt::Mesh::Dim>, std::vector<int>>>{
           {{{"replicate", 2}, {"tensor", 2, volt::AxisRole::tensor}, {"shard", 1}}, {2, 2, 1}},
           {{{"pipe", 2, volt::AxisRole::pipe}, {"data", 2}}, {2, 2}},
           {{{"replicate", 2}, {"shard", 2}}, {2, 2}}}) {
    volt::Mesh mesh(group, dims);
    std::vector<int> want;  // written out: the world ranks whose non-data coordinates are this rank's
    for (int w = 0; w < world; ++w) {
      std::vector<int> coord_w(sizes.size()), coord_me(sizes.size());
      for (std::size_t j = sizes.size(), a = static_cast<std::size_t>(w), b = static_cast<std::size_t>(me); j-- > 0;) {
        coord_w[j] = static_cast<int>(a % static_cast<std::size_t>(sizes[j])), a /= static_cast<std::size_t>(sizes[j]);
        coord_me[j] = static_cast<int>(b % static_cast<std::size_t>(sizes[j])), b /= static_cast<std::size_t>(sizes[j]);
      }
      bool same = true;
      for (std::size_t k = 0; k < dims.size(); ++k) {
        if (dims[k].role != volt::AxisRole::data && coord_w[k] != coord_me[k]) same = false;
      }
      if (same) want.push_back(w);
    }
    const volt::MeshAxis& data = mesh.data();
    const std::string where = mesh.shape() + ", the data axes, rank " + std::to_string(me);
    check(data.members() == want && want[static_cast<std::size_t>(data.rank())] == me,
          where + ": the members are the ranks that share the other coordinates, in rank order");
    volt::Mpi mpi(data);
    torch::Tensor t = torch::full({2}, me + 1.0);
    mpi.all_reduce_(t, volt::Reduce::sum);
    double sum = 0;
    for (int m : want) sum += m + 1;
    check(t.eq(sum).all().item<bool>(), where + ": all-reduce sums them");
  }
  volt::Mesh mesh(group, {{"data", 2}, {"tensor", 2}});
  try {
    (void)mesh.axis("pipe");
    check(false, "an unknown axis is refused");
  } catch (const std::invalid_argument& e) {
    check(std::string(e.what()).find("its axes: data=2 x tensor=2") != std::string::npos, std::string("the refusal: ") + e.what());
  }
  if (me == 0 && failures == 0) std::cout << "mesh: every axis of 2x2 and 2x1x2 meshes reduces, gathers and sends" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// On a 2x2 mesh (4 ranks), rank 2 waits to receive from rank 3, its neighbour on the tensor axis, and rank 3 fails
/// as `how` says: "die" (SIGKILL to itself, 0.5 s after a barrier) or "stall"
/// (sleeps, alive: rank 2 times out; run it with --timeout). Ranks 0 and 1 wait on the data axis (die) or sleep
/// (stall). Every rank that ends with RankFailure says so, with the rank it names. Under mpirun, "die" needs
/// `--enable-recovery`, which leaves the survivors to end by themselves (mpirun would kill them at once).
int mesh_fault_scenario(const std::string& how) {
  volt::detail::MpiRuntime::instance().ensure_initialized();
  auto* group = new volt::detail::MpiGroup(MPI_COMM_WORLD);
  group->set_timeout(g_timeout);
  const int me = group->rank();
  volt::Mesh mesh(group, {{"data", 2}, {"tensor", 2}});
  volt::Mpi tensor(mesh.axis("tensor")), data(mesh.axis("data"));
  try {
    volt::Mpi(group).barrier();
    if (me == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      std::cerr << "mesh-fault: rank 3 (pid " << ::getpid() << ") " << (how == "die" ? "dies" : "stalls") << std::endl;
      if (how == "die") ::kill(::getpid(), SIGKILL);
      std::this_thread::sleep_for(std::chrono::seconds(120));
      return 3;
    }
    if (me == 2) {
      torch::Tensor t = torch::zeros({4});
      tensor.irecv_(t, 1).wait();
    } else if (how == "die") {
      torch::Tensor t = torch::ones({4});
      data.all_reduce_(t, volt::Reduce::sum);  // with rank 2 (receiving) or rank 3 (dead): it never completes
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
    std::cerr << "mesh-fault: rank " << me << " was not stopped" << std::endl;
  } catch (const volt::RankFailure& e) {
    // One write per line: the ranks' lines reach mpirun's output whole.
    const std::string line = "mesh-fault: rank " + std::to_string(me) + " ended with RankFailure naming rank " +
                             std::to_string(e.failed_rank()) + ": " + e.what() + "\n";
    (void)!::write(2, line.data(), line.size());
  }
  return 1;
}

/// sync_dist values, EarlyStopping agreement and the Context collectives, under mpirun.
struct MetricNetImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  MetricNetImpl() { lin = register_module("lin", torch::nn::Linear(1, 1)); }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    const double r = ctx.global_rank();
    ctx.log("rank_mean", r, {.on_step = false, .on_epoch = true, .sync_dist = true});
    ctx.log("rank_sum", r, {.on_step = false, .on_epoch = true, .reduce = volt::Reduce::sum, .sync_dist = true});
    ctx.log("rank_max", r, {.on_step = true, .on_epoch = false, .reduce = volt::Reduce::max, .sync_dist = true});
    ctx.log("rank_local", r, {.on_step = false, .on_epoch = true});
    return lin(batch.data).sum() * 0;
  }
  /// Logged by the ranks that get a validation batch (one batch of 3 samples on 2 ranks: rank 0 alone).
  void validation_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    const volt::LogOptions sum{.reduce = volt::Reduce::sum, .sync_dist = true};
    ctx.log("val_sum", batch.data.sum().to(torch::kFloat64), sum);
    ctx.log("val_count", static_cast<double>(batch.data.size(0)), sum);
    ctx.log("val_mean", batch.data.mean(), {.sync_dist = true});
    ctx.log("val_max", batch.data.max(), {.reduce = volt::Reduce::max, .sync_dist = true});
    ctx.log("val_local", batch.data.sum(), {.reduce = volt::Reduce::sum});  // without sync_dist: rank 0's alone
    if (mixed) ctx.log("mixed", 1.0, {.sync_dist = ctx.global_rank() == 0});
  }
  bool mixed = false;  // log "mixed" with sync_dist on rank 0 and without on the others: an error on every rank
  void on_train_epoch_end(volt::Context& ctx) {
    auto t = torch::full({2}, static_cast<double>(ctx.global_rank() + 1));
    ctx.broadcast_(t, 1);
    check(t[0].item<double>() == 2.0, "broadcast_ from rank 1");
    auto g = ctx.all_gather(torch::tensor({static_cast<double>(ctx.global_rank())}));
    check(g.size(0) == g_world && g[1][0].item<double>() == 1.0, "all_gather stacks ranks in order");
    // Only rank 1 says stop: the decision is "any", so both ranks stop after this epoch.
    ctx.log("stop_signal", ctx.global_rank() == 1 ? 1.0 : 0.0, {.on_epoch = true, .reduce = volt::Reduce::max});
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.0)); }
};
TORCH_MODULE(MetricNet);

int metrics_scenario() {
  auto x = torch::zeros({16, 1}), y = torch::zeros({16, 1});
  MetricNet net;
  // EarlyStopping on the rank-local "stop_signal": rank 1 would stop at once (mode max, threshold), rank 0
  // never; the decision is reduced, so both stop after epoch 0 together instead of deadlocking.
  // A ModelCheckpoint monitors "val_local", logged without sync_dist by the one rank with a validation batch: the other
  // shows that rank's value, so both take the decision to save together.
  const auto ckpt_dir = std::filesystem::temp_directory_path() / ("volt_dist_metrics_" + std::to_string(::getppid()));
  auto trainer = volt::make_trainer<volt::DDP<volt::Script>>(
      {.devices = g_world, .max_epochs = 5},
      volt::EarlyStopping({.monitor = "stop_signal", .mode = volt::Mode::max, .stopping_threshold = 0.5,
                           .check_on_train_epoch_end = true}),
      volt::ModelCheckpoint({.dirpath = ckpt_dir.string(), .monitor = "val_local", .mode = volt::Mode::max}));
  volt::data::TensorLoader loader(x, y, {.batch_size = 2});
  // One validation batch of 3 samples (1, 2, 3) for 2 ranks: rank 1 gets none, and takes part with empty sums, as
  // Lightning runs such a loader; the values are the one batch's: sum 6, count 3, mean 2, max 3.
  volt::data::TensorLoader small(torch::tensor({1.0f, 2.0f, 3.0f}).unsqueeze(1), torch::zeros({3, 1}), {.batch_size = 4});
  auto result = trainer.fit(net, loader, small);
  for (const auto& m : {result.metrics, trainer.validate(net, small)}) {
    check(m.at("val_sum") == 6.0 && m.at("val_count") == 3.0 && m.at("val_mean") == 2.0 && m.at("val_max") == 3.0,
          "a validation loader with fewer batches than ranks: sync_dist values of its one batch (sum " +
              std::to_string(m.at("val_sum")) + ", count " + std::to_string(m.at("val_count")) + ", mean " +
              std::to_string(m.at("val_mean")) + ", max " + std::to_string(m.at("val_max")) + ")");
  }
  check(result.metrics.at("val_local") == 6.0, "the value logged without sync_dist by rank 0 alone, on every rank (" +
                                                  std::to_string(result.metrics.at("val_local")) + ")");
  trainer.strategy().barrier();
  if (trainer.is_global_zero()) {
    check(std::filesystem::exists(ckpt_dir / "epoch=0-step=4.ckpt"), "ModelCheckpoint saved on val_local");
    std::filesystem::remove_all(ckpt_dir);
  }
  check(trainer.current_epoch() == 1, "every rank stops after epoch 0 (current_epoch " + std::to_string(trainer.current_epoch()) + ")");
  check(result.metrics.at("rank_mean") == 0.5, "sync_dist mean of ranks 0 and 1 is 0.5");
  check(result.metrics.at("rank_sum") == 4.0, "sync_dist sum: rank 1 logs 1 in each of its 4 batches, rank 0 logs 0");
  check(result.metrics.at("rank_max") == 1.0, "sync_dist max of step values");
  check(result.metrics.at("rank_local") == trainer.strategy().global_rank(), "without sync_dist the value stays local");
  return failures == 0 ? 0 : 1;
}

/// The Profiler callback under DDP on every rank: each writes its own trace (the window's batches of its shard) with
/// the fit loop's ranges, read back with a JSON reader.
int profiler_scenario() {
  auto [x, y] = vt::regression_data(64);
  const auto dir = std::filesystem::temp_directory_path() / ("volt_dist_profiler_" + std::to_string(::getppid()));
  vt::ProfiledNet net;
  auto trainer = volt::make_trainer<volt::DDP<volt::Script>>(
      {.devices = g_world, .max_epochs = 1},
      volt::Profiler({.dirpath = dir.string(), .wait = 2, .warmup = 1, .active = 2, .row_limit = 8}));
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = 4}));  // 8 batches on each rank
  const int rank = trainer.strategy().global_rank();
  const auto& p = trainer.callback<volt::Profiler>();
  const std::string path = (dir / ("trace.rank" + std::to_string(rank) + ".pt.trace.json")).string();
  check(p.trace_path() == path, "rank " + std::to_string(rank) + "'s trace at " + path + " (" + p.trace_path() + ")");
  const std::string problems = vt::check_profiler_trace(path, rank, {3, 4}, p.summary());
  check(problems.empty(), "rank " + std::to_string(rank) + "'s trace: " + problems);
  trainer.strategy().barrier();
  if (trainer.is_global_zero()) std::filesystem::remove_all(dir);
  return failures == 0 ? 0 : 1;
}

/// A small GPT (examples/gpt_model.hpp) as a module: next-token loss on windows of tokens, AdamW.
struct TinyGptImpl : torch::nn::Module {
  gpt::GPT net{nullptr};
  explicit TinyGptImpl(const gpt::Config& c) { net = register_module("net", gpt::GPT(c)); }
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context&) {
    auto logits = net->forward(b.data.slice(1, 0, -1));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                b.data.slice(1, 1).reshape({-1}));
  }
  volt::optim::AdamW configure_optimizers() {
    return volt::optim::AdamW(parameters(), torch::optim::AdamWOptions(3e-3));
  }
};
TORCH_MODULE(TinyGpt);

/// The weights of a small GPT (dropout on) after an epoch on 2 ranks under `Strategy`, its blocks checkpointed as
/// `which`; the same initial weights, data and generator states every time.
gpt::Config tiny_gpt_config(volt::ActivationCheckpointing which) {
  return {.vocab = 13, .context = 12, .layers = 3, .heads = 2, .width = 16, .dropout = 0.1, .checkpointing = which};
}

template <class Strategy>
torch::Tensor tiny_gpt_weights(volt::ActivationCheckpointing which) {
  torch::manual_seed(5);
  TinyGpt m(tiny_gpt_config(which));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto tokens = torch::randint(13, {48, 13}, gen);
  auto trainer = volt::make_trainer<Strategy>({.devices = g_world, .max_epochs = 1, .accumulate_grad_batches = 2});
  volt::data::TensorLoader loader(tokens, tokens, {.batch_size = kBatch, .shuffle = true, .seed = kSeed});
  torch::manual_seed(21 + trainer.strategy().global_rank());  // each rank its own dropout masks, the same each run
  trainer.fit(m, loader);
  return flat(*m);
}

/// A small GPT of examples/gpt_model.hpp (no dropout; 3 blocks, each a unit; the token embedding, shared with the head,
/// in the root) for 10 AdamW steps under FSDP on `world` ranks, against one process stepping LibTorch's AdamW on the
/// global batches (every rank's local batch i in rank order, as zero_reference).
int fsdp_gpt_scenario(int world, bool reshard) {
  const gpt::Config config{.vocab = 13, .context = 12, .layers = 3, .heads = 2, .width = 16, .dropout = 0.0};
  const int64_t n = 48 * world / 2, steps = 10;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto tokens = torch::randint(13, {n, 13}, gen);
  torch::manual_seed(5);
  TinyGpt m(config);
  auto trainer = volt::make_trainer<volt::FSDP<volt::Script, volt::Mpi>>(
      {.devices = world / g_nodes, .num_nodes = g_nodes, .max_epochs = 10, .max_steps = steps});
  trainer.strategy().layout() = volt::FullySharded{.reshard_after_forward = reshard};  // the layout as a value
  trainer.fit(m, volt::data::TensorLoader(tokens, tokens, {.batch_size = kBatch, .shuffle = true, .seed = kSeed}));
  const torch::Tensor every = trainer.strategy().all_gather(flat(*m));
  check(torch::equal(std::get<0>(every.min(0)), std::get<0>(every.max(0))), "every rank ends with the same weights");
  if (!trainer.is_global_zero()) return failures == 0 ? 0 : 1;
  torch::manual_seed(5);
  TinyGpt ref(config);
  torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(3e-3));
  const int64_t batches = n / world / kBatch;
  int64_t step = 0;
  for (int e = 0; step < steps; ++e) {
    auto order = at::make_generator<at::CPUGeneratorImpl>(kSeed + static_cast<uint64_t>(e));
    auto perm = torch::randperm(n, order, torch::kLong);
    for (int64_t i = 0; i < batches && step < steps; ++i, ++step) {
      std::vector<torch::Tensor> idx;
      for (int r = 0; r < world; ++r) idx.push_back(perm.slice(0, r, n, world).slice(0, i * kBatch, (i + 1) * kBatch));
      const auto rows = tokens.index_select(0, torch::cat(idx));
      auto logits = ref->net->forward(rows.slice(1, 0, -1));
      opt.zero_grad();
      torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), rows.slice(1, 1).reshape({-1}))
          .backward();
      opt.step();
    }
  }
  const double diff = (flat(*m) - flat(*ref)).abs().max().item<double>();
  std::cout << "FSDP GPT on " << world << " ranks, " << steps << " AdamW steps: max |weights - one process| = " << diff
            << std::endl;
  // atol 1e-5: DDP's weights, checked the same way, differ from this loop's by 2.1e-6 on 2 ranks and 1.5e-6 on 3 (each
  // rank's mean over its tokens, then averaged, rounds otherwise than one mean over all, and Adam divides by the
  // gradients' size); a unit's missing gather or gradient moves them by 1e-3 and more.
  check(torch::allclose(flat(*m), flat(*ref), 1e-5, 1e-5), "the GPT's FSDP weights equal the one-process loop's (max "
                                                            "diff " + std::to_string(diff) + ")");
  return failures == 0 ? 0 : 1;
}

/// Activation checkpointing under DDP, ZeRO<2> and FSDP on 2 ranks: the weights equal the run without it, bit for bit.
int checkpointing_scenario() {
  using DDP = volt::DDP<volt::Script, volt::Mpi>;
  using Zero = volt::ZeRO<2, volt::Script, volt::Mpi>;
  const auto ddp_plain = tiny_gpt_weights<DDP>({});
  const auto ddp_all = tiny_gpt_weights<DDP>({.every = 1});
  const auto ddp_half = tiny_gpt_weights<DDP>({.every = 2});
  const auto zero_plain = tiny_gpt_weights<Zero>({});
  const auto zero_all = tiny_gpt_weights<Zero>({.every = 1});
  using Fsdp = volt::FSDP<volt::Script, volt::Mpi>;
  const auto fsdp_plain = tiny_gpt_weights<Fsdp>({});
  const auto fsdp_all = tiny_gpt_weights<Fsdp>({.every = 1});
  torch::manual_seed(5);
  TinyGpt initial(tiny_gpt_config({}));
  check(!torch::allclose(ddp_plain, flat(*initial)), "the fit changed the weights");
  check(torch::equal(ddp_all, ddp_plain), "DDP: every block checkpointed gives the plain run's weights (max diff " +
                                              std::to_string((ddp_all - ddp_plain).abs().max().item<double>()) + ")");
  check(torch::equal(ddp_half, ddp_plain), "DDP: every 2nd block checkpointed gives the plain run's weights");
  check(torch::equal(zero_all, zero_plain),
        "ZeRO<2>: every block checkpointed gives the plain run's weights (max diff " +
            std::to_string((zero_all - zero_plain).abs().max().item<double>()) + ")");
  check(torch::equal(fsdp_all, fsdp_plain),
        "FSDP: every block (unit) checkpointed gives the plain run's weights (max diff " +
            std::to_string((fsdp_all - fsdp_plain).abs().max().item<double>()) + ")");
  check(torch::allclose(fsdp_plain, ddp_plain, 1e-5, 1e-6),
        "FSDP's weights are DDP's, dropout and all (max diff " +
            std::to_string((fsdp_plain - ddp_plain).abs().max().item<double>()) + ")");
  std::cout << "activation checkpointing on " << g_world << " ranks: DDP, ZeRO<2> and FSDP weights as without it"
            << std::endl;
  return failures == 0 ? 0 : 1;
}

/// MaskedLM (test/support/models.hpp) after one optimizer step of 3 micro-batches of 2 rows on each of 2 ranks, the
/// loss weighted by its tokens (`weigh_loss`), under `Strategy`: the 12 rows the step saw (rank r reads rows r, r + 2,
/// ... in order) and their token mean computed in this process by hand give the same weights.
template <class Strategy>
bool weighted_step_matches(const torch::Tensor& tokens, const torch::Tensor& lengths, const torch::Tensor& want,
                           const std::string& name) {
  vt::MaskedLM m;
  auto trainer = volt::make_trainer<Strategy>({.devices = g_world, .max_steps = 1, .accumulate_grad_batches = 3});
  // (FSDP: the window's micro-batches accumulate locally, as weigh_loss needs; by default it refuses: fsdp-weigh-loss)
  if constexpr (Strategy::layout_type::stage == 3) trainer.strategy().set_sync_every_micro_batch(false);
  trainer.fit(m, volt::data::TensorLoader(tokens, lengths, {.batch_size = 2}));
  const double diff = (vt::flat_params(*m) - want).abs().max().item<double>();
  check(torch::allclose(vt::flat_params(*m), want, 1e-6, 1e-7),
        name + ": one step on 2 ranks of 3 micro-batches weighted by tokens equals the token mean of the 12 rows "
               "(max diff " + std::to_string(diff) + ")");
  return diff < 1e-6;
}

int weighted_loss_scenario() {
  const auto [tokens, lengths] = vt::ragged_tokens(24, 6, 11, 8);
  // By hand, in this process: one SGD step on the mean over every real token of rows 0 to 11.
  vt::MaskedLM ref;
  auto [sum, count] = vt::masked_token_loss(ref->forward(tokens.slice(0, 0, 12)), tokens.slice(0, 0, 12),
                                            lengths.slice(0, 0, 12));
  (sum / count).backward();
  {
    torch::NoGradGuard no_grad;
    for (auto& p : ref->parameters()) p.sub_(ref->lr * p.grad());
  }
  const torch::Tensor want = vt::flat_params(*ref);
  weighted_step_matches<volt::DDP<volt::Script, volt::Mpi>>(tokens, lengths, want, "DDP");
  weighted_step_matches<volt::ZeRO<2, volt::Script, volt::Mpi>>(tokens, lengths, want, "ZeRO<2>");
  weighted_step_matches<volt::FSDP<volt::Script, volt::Mpi>>(tokens, lengths, want, "FSDP");
  std::cout << "weigh_loss on " << g_world << " ranks: DDP, ZeRO<2> and FSDP step on the token mean" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// FSDP reduce-scatters each micro-batch, so a window weighted by tokens is refused there (expect-failure checks the
/// message, which names the way out).
/// A masked LM that shards all of itself under ModelParallel (one part, its root).
struct ShardedMaskedLM : vt::MaskedLMImpl {
  void configure_model(volt::ModelPlan& plan) { plan.shard(*this); }
};

/// `Strategy` on 2 ranks (FSDP, or ModelParallel with a sharded part), a window of 3 micro-batches weighted by tokens:
/// refused in the first step (expect-failure checks the message).
template <class Strategy, class Module>
int sharded_weigh_loss_scenario() {
  const auto [tokens, lengths] = vt::ragged_tokens(24, 6, 11, 8);
  Module m;
  volt::make_trainer<Strategy>({.devices = g_world, .max_steps = 1, .accumulate_grad_batches = 3})
      .fit(m, volt::data::TensorLoader(tokens, lengths, {.batch_size = 2}));
  std::cerr << "fit returned although weigh_loss ran over a window under " << Strategy::name << std::endl;
  return 3;
}

/// Three blocks of equal width between a first layer and a head (the root), each a unit; rank `reversed_on` runs
/// the blocks in reverse order. `Planned`: ModelParallel's plan shards the whole module as one part.
template <bool Planned>
struct OrderNetImpl : torch::nn::Module {
  torch::nn::Linear first{nullptr}, head{nullptr};
  std::vector<torch::nn::Linear> blocks;
  int reversed_on = 1;
  OrderNetImpl() {
    torch::manual_seed(5);
    first = register_module("first", torch::nn::Linear(4, 8));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), torch::nn::Linear(8, 8)));
    head = register_module("head", torch::nn::Linear(8, 1));
  }
  void configure_model(volt::ModelPlan& plan)
    requires Planned
  {
    plan.shard(*this);
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    auto h = first(batch.data);
    for (int i = 0; i < 3; ++i) h = torch::tanh(volt::sharded_call(blocks[ctx.global_rank() == reversed_on ? 2 - i : i], h));
    return (head(h) - batch.target).pow(2).mean();
  }
  std::unique_ptr<torch::optim::Optimizer> configure_optimizers() {
    return std::make_unique<torch::optim::SGD>(parameters(), torch::optim::SGDOptions(0.1));
  }
};

/// `Strategy` on 2 ranks, rank 1 running its units in reverse order in the first step: every rank must refuse (the
/// Trainer's error names the rank; expect-failure checks both ranks' lines: the call, the units and the ranks).
template <class Strategy, bool Planned>
int unit_order_scenario() {
  auto [x, y] = data(32);
  OrderNetImpl<Planned> net;
  auto trainer = volt::make_trainer<Strategy>({.devices = g_world, .max_steps = 2});
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = kBatch}));
  std::cerr << "rank " << trainer.strategy().global_rank() << ": fit returned although rank 1 ran its units in "
            << "reverse order" << std::endl;
  return 3;
}

/// Saves a checkpoint to `path` inside the fit, after optimizer step `step` (mid-epoch, with the loader's position).
struct SaveAtStep {
  int64_t step = 0;
  std::string path;
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (!path.empty() && trainer.global_step() == step) trainer.save_checkpoint(path);
  }
};

/// Net on 2 ranks under `Strategy` for `steps` optimizer steps (96 samples, shuffled: 12 steps an epoch), resumed from
/// `from` where given, saved to `save_to` after its last step (inside the fit) where given; its weights.
template <class Strategy>
torch::Tensor legacy_run(int64_t steps, const std::string& from, const std::string& save_to,
                         volt::StateDictType form = volt::StateDictType::full) {
  auto [x, y] = data(96);
  Net net;
  auto trainer = volt::make_trainer<Strategy>({.devices = g_world, .max_steps = steps}, SaveAtStep{steps, save_to});
  if (form == volt::StateDictType::sharded) trainer.strategy().set_state_dict_type(form);
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed}),
              volt::NoLoader{}, from);
  return flat(*net);
}

/// The weights of the checkpoint at `path` (its state_dict), flattened in Net's parameter order as `flat` does.
torch::Tensor saved_weights(const std::string& path) {
  const auto weights = volt::checkpoint::read(path).at("state_dict").toGenericDict();
  Net order;
  std::vector<torch::Tensor> v;
  for (const auto& item : order->named_parameters()) v.push_back(weights.at(item.key()).toTensor().flatten());
  return torch::cat(v);
}

/// `resumed` against `whole`: bit for bit where this host's kernels round as the writer's did (its own 5 steps give the
/// file's weights exactly), else within a few float32 roundings per step (another CPU's vector units sum in another
/// order; a lost momentum buffer or loader position moves the weights by 1e-3 and more).
void check_resumed(const torch::Tensor& resumed, const torch::Tensor& whole, bool same_rounding, const std::string& what) {
  std::ostringstream diff;
  diff << std::scientific << (resumed - whole).abs().max().item<double>();
  check(same_rounding ? torch::equal(resumed, whole) : torch::allclose(resumed, whole, 1e-5, 1e-6),
        what + " resumed from the earlier version's checkpoint ends as the uninterrupted run (" +
            (same_rounding ? "bit for bit" : "this host rounds otherwise than the writer: within 1e-5") +
            ", max diff " + diff.str() + ")");
}

/// Checkpoints that volt wrote before DDP and ZeRO became one strategy with layouts (test/data/legacy/, written by
/// `write` at that version, in a folder per LibTorch line, as each line's kernels round alike): `resume` continues each
/// under today's strategy to 12 steps and must end on the weights of an uninterrupted 12-step run, bit for bit where
/// this host's first 5 steps give the file's weights exactly (check_resumed). With `sharded`, the folder also holds
/// sharded checkpoints (a folder each) of FSDP and ZeRO<2> (written from the version that wrote them in flat pieces).
int legacy_checkpoint_scenario(const std::string& mode, const std::string& folder, bool sharded) {
  const std::string dir = folder + "/torch" + std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  using DDP = volt::DDP<volt::Script, volt::Mpi>;
  using Zero = volt::ZeRO<2, volt::Script, volt::Mpi>;
  using Fsdp = volt::FSDP<volt::Script, volt::Mpi>;
  constexpr auto kSharded = volt::StateDictType::sharded;
  if (mode == "write") {
    legacy_run<DDP>(5, "", dir + "/ddp_world2_step5.ckpt");
    legacy_run<Zero>(5, "", dir + "/zero2_world2_step5.ckpt");
    if (sharded) {
      legacy_run<Fsdp>(5, "", dir + "/fsdp_world2_step5_sharded.ckpt", kSharded);
      legacy_run<Zero>(5, "", dir + "/zero2_world2_step5_sharded.ckpt", kSharded);
    }
    return 0;
  }
  const torch::Tensor ddp = legacy_run<DDP>(12, dir + "/ddp_world2_step5.ckpt", "");
  const torch::Tensor zero = legacy_run<Zero>(12, dir + "/zero2_world2_step5.ckpt", "");
  const torch::Tensor ddp_whole = legacy_run<DDP>(12, "", ""), zero_whole = legacy_run<Zero>(12, "", "");
  const torch::Tensor ddp5 = legacy_run<DDP>(5, "", ""), zero5 = legacy_run<Zero>(5, "", "");
  check(!torch::equal(ddp5, ddp_whole), "the 7 steps after the checkpoint change the weights");
  check_resumed(ddp, ddp_whole, torch::equal(ddp5, saved_weights(dir + "/ddp_world2_step5.ckpt")), "DDP");
  check_resumed(zero, zero_whole, torch::equal(zero5, saved_weights(dir + "/zero2_world2_step5.ckpt")), "ZeRO<2>");
  if (sharded) {
    const std::string fsdp_dir = dir + "/fsdp_world2_step5_sharded.ckpt", zero_dir = dir + "/zero2_world2_step5_sharded.ckpt";
    check(volt::checkpoint::is_sharded(fsdp_dir) && volt::checkpoint::is_sharded(zero_dir),
          "the sharded checkpoints are folders of the sharded form");
    const torch::Tensor fsdp = legacy_run<Fsdp>(12, fsdp_dir, ""), fsdp_whole = legacy_run<Fsdp>(12, "", "");
    const torch::Tensor fsdp5 = legacy_run<Fsdp>(5, "", "");
    check_resumed(fsdp, fsdp_whole, torch::equal(fsdp5, saved_weights(fsdp_dir)), "FSDP (sharded form)");
    check_resumed(legacy_run<Zero>(12, zero_dir, ""), zero_whole, torch::equal(zero5, saved_weights(zero_dir)),
                  "ZeRO<2> (sharded form)");
  }
  std::cout << "checkpoints of the earlier version resume under DDP and ZeRO<2>" << (sharded ? " and, sharded, FSDP" : "")
            << " on " << g_world << " ranks" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// ManualParallel on 2 ranks, where each rank may hold other parameters: a checkpoint (one file from rank zero) is
/// refused on every rank with a CheckpointError, and nothing is written.
int manual_refusals_scenario() {
  using Manual = volt::ManualParallel<volt::Script, volt::Mpi>;
  auto [x, y] = data(32);
  Net net;
  auto trainer = volt::make_trainer<Manual>({.devices = g_world, .max_steps = 1});
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = kBatch}));
  const std::string path = "/tmp/volt_dist_manual_" + std::to_string(::getppid()) + ".ckpt";
  std::string refused;
  try {
    trainer.save_checkpoint(path);
  } catch (const volt::CheckpointError& e) {
    refused = e.what();
  }
  check(refused.find("ManualParallel lets each rank hold different parameters") != std::string::npos,
        "a checkpoint under ManualParallel on 2 ranks is refused with a CheckpointError (got \"" + refused + "\")");
  check(!std::filesystem::exists(path), "the refused checkpoint wrote no file");
  std::cout << "ManualParallel on " << g_world << " ranks: the checkpoint refused" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// FsdpNet in parts (ModelParallel, the composition of seed 004): `hsdp` on a 2x2 mesh, the blocks sharded along
/// "shard" and replicated along "replicate" (hybrid sharding), the head replicated and `first` in no part (so replicated
/// too); `two-parts` on one axis of every rank, the blocks and the head each a sharded part, `first` replicated.
struct PlannedNetImpl : FsdpNetImpl {
  std::string kind;
  void configure_model(volt::ModelPlan& plan) {
    plan.shard(blocks, kind == "hsdp" ? "shard" : "data");
    if (kind == "hsdp") {
      plan.replicate(head);
    } else {
      plan.shard(head, "data");
    }
  }
};

/// Clipping by norm in float64: `Strategy` (`kind`: zero1, zero2, fsdp, model-parallel: FsdpNet's blocks and head two
/// sharded parts) on `world` ranks under Fp64True, Adam with accumulation 3 and a clip every step meets, against the
/// one-process loop in float64 on the same global batches: within 1e-12 (a norm summed in float32 was 1e-9 off).
int clip_fp64_scenario(const std::string& kind) {
  const int64_t n = 96;
  const int epochs = 2, accumulate = 3;
  const double clip = 0.05;
  auto [x, y] = data(n);
  PlannedNetImpl net;
  net.kind = "two-parts";
  const volt::TrainerOptions options{.devices = g_world, .max_epochs = epochs, .accumulate_grad_batches = accumulate,
                                     .gradient_clip_val = clip};
  const auto fit = [&]<class Strategy>(Strategy*) {
    auto trainer = volt::make_trainer<Strategy, volt::Fp64True>(options);
    trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed}));
    return trainer.is_global_zero();
  };
  bool here = false;
  if (kind == "zero1") here = fit(static_cast<volt::ZeRO<1, volt::Script, volt::Mpi>*>(nullptr));
  if (kind == "zero2") here = fit(static_cast<volt::ZeRO<2, volt::Script, volt::Mpi>*>(nullptr));
  if (kind == "fsdp") here = fit(static_cast<volt::FSDP<volt::Script, volt::Mpi>*>(nullptr));
  if (kind == "model-parallel") here = fit(static_cast<volt::ModelParallel<volt::Script, volt::Mpi>*>(nullptr));
  if (kind == "ddp") here = fit(static_cast<volt::DDP<volt::Script, volt::Mpi>*>(nullptr));
  if (!here) return failures == 0 ? 0 : 1;
  const torch::Tensor want = zero_reference<FsdpNetImpl>(g_world, n, epochs, accumulate, clip, /*adam=*/true, -1,
                                                         torch::kFloat64);
  const torch::Tensor got = flat(net);
  check(got.scalar_type() == torch::kFloat64, "the weights are float64");
  const double diff = (got - want).abs().max().item<double>();
  std::cout << kind << " on " << g_world << " ranks, Fp64True, clipped every step: max |weights - one process| = "
            << diff << std::endl;
  std::ostringstream said;
  said << kind << ": the float64 weights within 1e-12 of the one-process loop's (max diff " << diff << ")";
  check(diff <= 1e-12, said.str());
  return failures == 0 ? 0 : 1;
}

/// Between steps, once laid out: whether any block, and the head, hold parameter storage.
struct PartsBetweenSteps {
  std::shared_ptr<std::set<std::string>> seen = std::make_shared<std::set<std::string>>();
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M& net, const torch::Tensor&, const B&, int64_t) {
    if (trainer.global_step() < 2) return;
    int64_t blocks = 0;
    for (const auto& p : net.blocks->parameters()) blocks += static_cast<int64_t>(p.storage().nbytes());
    seen->insert(std::string("blocks ") + (blocks > 0 ? "held" : "freed"));
    seen->insert(std::string("head ") + (net.head->weight.storage().nbytes() > 0 ? "held" : "freed"));
    seen->insert(std::string("first ") + (net.first->weight.storage().nbytes() > 0 ? "held" : "freed"));
  }
};

/// Saves once, right after optimizer step `step` (a window's end).
struct SaveOnceAt {
  int64_t step = 0;
  std::string path;
  bool done = false;
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (done || path.empty() || trainer.global_step() != step) return;
    done = true;
    trainer.save_checkpoint(path);
  }
};

/// ModelParallel on `world` ranks (`kind`: PlannedNetImpl's), Adam with accumulation over 3 micro-batches and clipping,
/// against the one-process loop on the global batches; between steps the sharded parts hold no parameter storage and
/// the replicated ones do; each rank's Adam state is a sharded part's share along its axis plus the replicated parts
/// whole. `hsdp`: a checkpoint written after step 2 (inside an epoch) resumes under ModelParallel and under DDP on the same ranks, each
/// ending on the reference's weights; `two-parts`: a checkpoint is refused (one sharded part's optimizer state only).
int model_parallel_scenario(int world, const std::string& kind) {
  using MP = volt::ModelParallel<volt::Script, volt::Mpi>;
  const int64_t n = 192;  // 4 ranks: 12 batches an epoch, 3 steps (the first window's is skipped: kSkipped)
  const int epochs = 2, accumulate = 3;
  const double clip = 0.05;
  const volt::TrainerOptions options{.devices = world, .max_epochs = epochs, .accumulate_grad_batches = accumulate,
                                     .gradient_clip_val = clip};
  auto [x, y] = data(n);
  auto loader = [&] { return volt::data::TensorLoader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed}); };
  const bool hsdp = kind == "hsdp";
  const std::string path = "/tmp/volt_dist_model_parallel_" + std::to_string(::getppid()) + ".ckpt";
  std::error_code ignored;
  std::filesystem::remove(path, ignored);  // a file left by a killed run (every rank: the first save is steps away)
  PlannedNetImpl net;
  net.kind = kind;
  PartsBetweenSteps parts;
  auto trainer = volt::make_trainer<MP>(options, parts, SaveOnceAt{2, hsdp ? path : ""});
  if (hsdp) trainer.strategy().set_mesh({{"replicate", 2}, {"shard", 2}});
  std::ostringstream said;  // what the fit says on this rank (passed on after it)
  std::streambuf* const kept = std::cerr.rdbuf(said.rdbuf());
  trainer.fit(net, loader());
  std::cerr.rdbuf(kept);
  std::cerr << said.str();
  const std::string what = "ModelParallel on " + std::to_string(world) + " ranks (" + kind + ")";
  // Two sharded parts: the checkpoint's later refusal is said as the fit starts, on rank zero only.
  const bool warned = said.str().find("volt: warning: configure_model plans 2 sharded parts") != std::string::npos;
  check(warned == (!hsdp && trainer.is_global_zero()), what + ": the two sharded parts' warning said " +
                                                           (warned ? "" : "not ") + "on rank " +
                                                           std::to_string(trainer.strategy().global_rank()));
  const torch::Tensor want = zero_reference<FsdpNetImpl>(world, n, epochs, accumulate, clip, /*adam=*/true);
  const double diff = (flat(net) - want).abs().max().item<double>();
  std::cout << what << ": max |weights - reference| = " << diff << std::endl;
  check(torch::allclose(flat(net), want, 1e-5, 1e-6), what + ": weights equal the one-process reference");
  const std::set<std::string> held{"blocks freed", hsdp ? "head held" : "head freed", "first held"};
  check(*parts.seen == held, what + ": between steps the sharded parts hold no parameter storage, the replicated do (" +
                                 std::to_string(parts.seen->size()) + " observations)");
  // Each rank's Adam state (two float32 moments): its block of each unit along the sharded axis (a unit padded to a
  // multiple of the axis size, the padding holding no state), the rest whole.
  const volt::MeshAxis& axis = trainer.strategy().mesh().axis(hsdp ? "shard" : "data");
  const auto block_of = [&](int64_t unit) {
    const int64_t block = (unit + axis.size() - 1) / axis.size();
    return std::clamp<int64_t>(unit - axis.rank() * block, 0, block);
  };
  int64_t want_elements = net.first->weight.numel() + net.first->bias.numel();
  for (const auto& b : *net.blocks) {
    int64_t unit = 0;
    for (const auto& p : b->parameters()) unit += p.numel();
    want_elements += block_of(unit);
  }
  const int64_t head = net.head->weight.numel() + net.head->bias.numel();
  want_elements += hsdp ? head : block_of(head);
  const auto got = static_cast<int64_t>(volt::detail::optimizer_state_bytes(*trainer.optimizer()));
  check(got == want_elements * 8, what + ": this rank's Adam state is " + std::to_string(got) + " bytes (want " +
                                      std::to_string(want_elements * 8) + ": each unit's share along the axis)");
  if (!hsdp) {
    std::string refused;
    try {
      trainer.save_checkpoint(path);
    } catch (const volt::CheckpointError& e) {
      refused = e.what();
    }
    check(refused.find("optimizer's state of one sharded part") != std::string::npos,
          what + ": a checkpoint is refused with a CheckpointError (got \"" + refused + "\")");
    check(!std::filesystem::exists(path), what + ": the refused checkpoint wrote no file");
    return failures == 0 ? 0 : 1;
  }
  check(std::filesystem::exists(path), what + ": the checkpoint after step 2 was written");
  // Both resumes start from other weights than the fit did: only what they load from the file brings them back.
  const auto moved = [](torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.add_(0.5);
  };
  PlannedNetImpl again;
  again.kind = kind;
  moved(again);
  auto resumed = volt::make_trainer<MP>(options);
  resumed.strategy().set_mesh({{"replicate", 2}, {"shard", 2}});
  resumed.fit(again, loader(), volt::NoLoader{}, path);
  check(torch::allclose(flat(again), want, 1e-5, 1e-6), what + ": resumed from step 2, it ends on the reference");
  FsdpNetImpl plain;
  moved(plain);
  auto ddp = volt::make_trainer<volt::DDP<volt::Script, volt::Mpi>>(options);
  ddp.fit(plain, loader(), volt::NoLoader{}, path);
  check(torch::allclose(flat(plain), want, 1e-5, 1e-6), what + ": its checkpoint resumes under DDP to the reference");
  ddp.strategy().barrier();
  if (trainer.is_global_zero()) std::filesystem::remove(path);
  if (failures == 0) std::cout << what << ": equals the reference; its checkpoint resumes under it and DDP" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// HSDP's plan (blocks sharded along "shard", the head replicated) that records the sum of every batch it trains on
/// and logs its global rank with sync_dist.
struct RoleNetImpl : PlannedNetImpl {
  std::vector<double> batch_sums;
  RoleNetImpl() { kind = "hsdp"; }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    batch_sums.push_back(batch.data.sum().item<double>());
    ctx.log("rank", torch::scalar_tensor(static_cast<double>(ctx.global_rank())),
            {.on_step = false, .on_epoch = true, .sync_dist = true});
    return PlannedNetImpl::training_step(batch, ctx);
  }
};

/// ModelParallel on 4 ranks over a mesh of three axes, replicate=1 x shard=2 x tensor=2 with the last of the tensor
/// role (no layout on it): the ranks of a tensor line (0 and 1, 2 and 3) train on the same batches and those of a data
/// line on different ones; `sync_dist` averages over the data line only (ranks r % 2 and r % 2 + 2: mean r % 2 + 1,
/// where the world's would be 1.5); the weights end on the one-process loop over the 2 data ranks' global batches;
/// predict, every part replicated, returns every batch once, in order. `refused`: a part planned along the tensor axis instead, which every rank refuses (expect-failure checks it).
int mesh_roles_scenario(bool refused) {
  using MP = volt::ModelParallel<volt::Script, volt::Mpi>;
  const int64_t n = 96;
  const int epochs = 2, accumulate = 3;
  const double clip = 0.05;
  const volt::TrainerOptions options{.devices = 4, .max_epochs = epochs, .accumulate_grad_batches = accumulate,
                                     .gradient_clip_val = clip};
  auto [x, y] = data(n);
  const std::vector<volt::Mesh::Dim> mesh{{"replicate", 1}, {"shard", 2}, {"tensor", 2, volt::AxisRole::tensor}};
  if (refused) {
    struct AlongTensor : FsdpNetImpl {
      void configure_model(volt::ModelPlan& plan) { plan.shard(blocks, "tensor"); }
    } along_tensor;
    auto trainer = volt::make_trainer<MP>(options);
    trainer.strategy().set_mesh(mesh);
    trainer.fit(along_tensor, volt::data::TensorLoader(x, y, {.batch_size = kBatch}));
    std::cerr << "fit returned although a part was planned along the tensor axis" << std::endl;
    return 3;
  }
  RoleNetImpl net;
  auto trainer = volt::make_trainer<MP>(options);
  trainer.strategy().set_mesh(mesh);
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed}));
  const int me = trainer.strategy().global_rank();
  std::ostringstream sums;
  for (const double v : net.batch_sums) sums << std::hexfloat << v << ' ';
  const std::vector<std::string> all = trainer.strategy().host_all_gather(sums.str());
  check(all.size() == 4 && all[0] == all[1] && all[2] == all[3] && !net.batch_sums.empty(),
        "the ranks along the tensor axis trained on the same batches");
  check(all.size() == 4 && all[0] != all[2], "the ranks along the data axes trained on different batches");
  const double logged = trainer.callback_metric_values().at("rank");
  check(logged == me % 2 + 1, "sync_dist averaged the ranks over the data axes only: " + std::to_string(logged) +
                                  " on rank " + std::to_string(me) + " (want " + std::to_string(me % 2 + 1) + ")");
  const torch::Tensor want = zero_reference<FsdpNetImpl>(2, n, epochs, accumulate, clip, /*adam=*/true);
  const double diff = (flat(net) - want).abs().max().item<double>();
  check(torch::allclose(flat(net), want, 1e-5, 1e-6), "the weights equal the one-process loop over the 2 data ranks' "
                                                      "global batches (max diff " + std::to_string(diff) + ")");
  // predict with every part replicated (batches dealt whole, results gathered): each batch once, in the loader's order,
  // though the ranks of a tensor line predict the same batches
  struct Replicated : FsdpNetImpl {
    torch::Tensor predict_step(const torch::data::Example<>& batch, volt::Context&) { return forward(batch.data); }
  } plain;
  auto predicting = volt::make_trainer<MP>(options);
  predicting.strategy().set_mesh(mesh);
  const std::vector<torch::Tensor> predicted = predicting.predict(plain, volt::data::TensorLoader(x, y, {.batch_size = kBatch}));
  torch::Tensor whole;
  {
    torch::NoGradGuard no_grad;
    whole = plain.forward(x);
  }
  check(predicted.size() == static_cast<std::size_t>(n / kBatch) && torch::allclose(torch::cat(predicted), whole),
        "predict returns each of the " + std::to_string(n / kBatch) + " batches once, in order (got " +
            std::to_string(predicted.size()) + ")");
  if (me == 0 && failures == 0) {
    std::cout << "a mesh of " << trainer.strategy().mesh().shape() << ": batches shared along the tensor axis, "
              << "sync_dist and gradients over the data axes, max |weights - reference| = " << diff << std::endl;
  }
  return failures == 0 ? 0 : 1;
}

/// ManualParallel on 2 ranks, whose gradients volt does not average, with a loss weighted by tokens (which needs that
/// average): refused in the first step (expect-failure checks the message).
int manual_weigh_loss_scenario() {
  const auto [tokens, lengths] = vt::ragged_tokens(24, 6, 11, 8);
  vt::MaskedLM m;
  volt::make_trainer<volt::ManualParallel<volt::Script, volt::Mpi>>({.devices = g_world, .max_steps = 1})
      .fit(m, volt::data::TensorLoader(tokens, lengths, {.batch_size = 2}));
  std::cerr << "fit returned although weigh_loss ran under ManualParallel" << std::endl;
  return 3;
}

/// A name logged with sync_dist on rank 0 and without on rank 1 (a validation batch for each): every rank refuses it
/// at the epoch's end with the same message (expect-failure checks it), none waits for a reduction the other skips.
int metrics_mixed_scenario() {
  MetricNet net;
  net->mixed = true;
  volt::Trainer<volt::DDP<volt::Script>> trainer({.devices = g_world});
  trainer.validate(net, volt::data::TensorLoader(torch::ones({4, 1}), torch::zeros({4, 1}), {.batch_size = 2}));
  std::cerr << "validate returned although the ranks logged \"mixed\" two ways" << std::endl;
  return 3;
}

/// Rank `fail_rank` fails at step `fail_step`, as `how` says: "throw" (an exception), "die" (SIGKILL to itself, as a
/// crash or a kill: not a word to the others), "stall" (sleeps 120 s, alive: its heartbeats go on).
struct FailNetImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  int fail_rank, fail_step;
  std::string how;
  FailNetImpl(int r, int s, std::string h) : fail_rank(r), fail_step(s), how(std::move(h)) {
    lin = register_module("lin", torch::nn::Linear(4, 1));
  }
  torch::Tensor training_step(const torch::data::Example<>& batch, volt::Context& ctx) {
    if (ctx.global_rank() == fail_rank && ctx.global_step() == fail_step) {
      std::cerr << how << " at step " << fail_step << " on rank " << fail_rank << " (" << volt::detail::host_name()
                << ", pid " << ::getpid() << ")" << std::endl;
      if (how == "die") ::kill(::getpid(), SIGKILL);
      if (how == "stall") std::this_thread::sleep_for(std::chrono::seconds(120));
      throw std::runtime_error("boom at step " + std::to_string(fail_step) + " on rank " + std::to_string(fail_rank));
    }
    return (lin(batch.data) - batch.target).pow(2).mean();
  }
  torch::optim::SGD configure_optimizers() { return torch::optim::SGD(parameters(), torch::optim::SGDOptions(0.01)); }
};
TORCH_MODULE(FailNet);

template <class L>
int fail_scenario(int rank, int step, const std::string& how) {
  auto [x, y] = data(64);
  FailNet net(rank, step, how);
  volt::Trainer<volt::DDP<L>> trainer(
      {.devices = g_world / g_nodes, .num_nodes = g_nodes, .max_epochs = 1000, .timeout = g_timeout});
  volt::data::TensorLoader loader(x, y, {.batch_size = 4, .shuffle = true});
  trainer.fit(net, loader);  // throws in every process
  std::cerr << "fit returned although a rank failed" << std::endl;
  return 3;
}

/// Runs `argv` with its output captured; passes when it exits non-zero within `timeout` seconds, its output
/// contains every one of `messages`, and no process carrying `token` in its command line remains afterwards.
/// The job's Open MPI session folders go under a folder of this run's, removed at the end: a job whose rank failed
/// leaves its job family's empty folder (ompi.<host>.<uid>/jf.<n>) behind.
int expect_failure(double timeout, const std::vector<std::string>& messages, std::vector<std::string> args,
                   const std::string& token, bool any_status) {
  const std::filesystem::path scratch =
      std::filesystem::temp_directory_path() / ("volt_expect_" + std::to_string(::getpid()));
  std::filesystem::remove_all(scratch);
  std::filesystem::create_directories(scratch);
  const std::string out_path = scratch / "output.log";
  std::vector<std::string> env_strings{"OMPI_MCA_orte_tmpdir_base=" + scratch.string()};
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "OMPI_MCA_orte_tmpdir_base=", 26) != 0) env_strings.emplace_back(*e);
  }
  std::vector<char*> env;
  for (auto& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const auto start = std::chrono::steady_clock::now();
  if (posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), env.data()) != 0) {
    std::cerr << "cannot start " << args[0] << std::endl;
    return 1;
  }
  int status = 0;
  bool timed_out = false;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout) {
      timed_out = true;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::ifstream in(out_path);
  const std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::cout << "---- output of the failing job ----\n" << output << "---- (" << took << " s) ----" << std::endl;
  check(!timed_out, "the job ended within " + std::to_string(timeout) + " s");
  check(any_status || (WIFEXITED(status) ? WEXITSTATUS(status) != 0 : true), "the job exited non-zero");
  for (const std::string& message : messages) {
    check(output.find(message) != std::string::npos, "the output carries the message \"" + message + "\"");
  }
  // No process of the job may remain (give the runtime a moment to reap).
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  int left = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos || std::stoi(name) == ::getpid()) continue;
    std::string line = vt::proc_file(name, "cmdline");
    const std::string stat_line = vt::proc_file(name, "stat");
    const auto close = stat_line.rfind(')');
    const bool zombie = close != std::string::npos && close + 2 < stat_line.size() && stat_line[close + 2] == 'Z';
    if (!zombie && line.find(token) != std::string::npos) {
      ++left;
      std::replace(line.begin(), line.end(), '\0', ' ');
      std::cerr << "left behind: pid " << name << ": " << line << std::endl;
    }
  }
  check(left == 0, "no process of the job is left behind");
  std::filesystem::remove_all(scratch);
  return failures == 0 ? 0 : 1;
}

/// DDP (or ZeRO<2>: `Sharded`) over NCCL at world size 1 must train exactly as SingleDevice does: same data order,
/// same bf16 autocast kernels, gradients averaged over one rank (ZeRO: reduce-scattered, the one shard stepped and
/// all-gathered). Under Spawn the reference runs in the main process after fit.
template <class L, bool Sharded = false>
int gpu_ddp_scenario() {
#if VOLT_WITH_NCCL
  using S = std::conditional_t<Sharded, volt::ZeRO<2, L, volt::Nccl>, volt::DDP<L, volt::Nccl>>;
  const std::string name = std::string(Sharded ? "ZeRO<2, " : "DDP<") + L::name + ", Nccl>";
  if (!volt::GPU::is_available()) {
    std::cout << "no CUDA device visible: skipped" << std::endl;
    return 77;
  }
  const int64_t n = 64;
  const int epochs = 2;
  auto [x, y] = data(n);
  auto loader = [&] { return volt::data::TensorLoader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed}); };
  Net ddp_net;
  volt::Trainer<S, volt::Bf16Mixed, volt::GPU> trainer({.devices = 1, .max_epochs = epochs});
  trainer.fit(ddp_net, loader());
  // Under Script this process was the rank; under Spawn only the main process gets here.
  Net ref_net;
  volt::Trainer<volt::SingleDevice, volt::Bf16Mixed, volt::GPU> reference({.max_epochs = epochs});
  reference.fit(ref_net, loader());
  const torch::Tensor got = flat(*ddp_net), want = flat(*ref_net);
  const double diff = (got - want).abs().max().item<double>();
  std::cout << "max |" << name << " - SingleDevice| = " << diff << std::endl;
  check(trainer.global_step() == reference.global_step(), "both ran the same number of steps");
  check(!torch::equal(want, flat(*Net{})), "the reference trained");
  check(torch::allclose(got, want, 1e-5, 1e-6), name + " at world size 1 equals SingleDevice");
  return failures == 0 ? 0 : 1;
#else
  std::cout << "volt::nccl is not linked (no NCCL or no CUDA LibTorch at configure time): skipped" << std::endl;
  return 77;
#endif
}

/// The weights and Adam moments a checkpoint (either form) holds, read back by LibTorch's Adam over a fresh FsdpNet.
torch::Tensor fsdp_state_in(const std::string& path) {
  const auto file = volt::checkpoint::read(path);
  std::vector<torch::Tensor> all;
  for (const auto& e : file.at(volt::checkpoint::keys::state_dict).toGenericDict()) {
    all.push_back(e.value().toTensor().flatten().to(torch::kFloat64));
  }
  FsdpNetImpl fresh;
  torch::optim::Adam adam(fresh.parameters(), torch::optim::AdamOptions(0.01));
  volt::checkpoint::load_optimizer_state(
      adam, file.at(volt::checkpoint::keys::optimizer_states).toListRef()[0].toTensor(), path);
  for (const auto& p : fresh.parameters()) {
    const auto it = adam.state().find(volt::optim::detail::state_key(adam.state(), p.unsafeGetTensorImpl()));
    check(it != adam.state().end(), path + ": Adam state for every parameter");
    if (it == adam.state().end()) continue;
    const auto& st = static_cast<const torch::optim::AdamParamState&>(*it->second);
    all.push_back(st.exp_avg().flatten().to(torch::kFloat64));
    all.push_back(st.exp_avg_sq().flatten().to(torch::kFloat64));
  }
  return torch::cat(all);
}

/// Saves the state after optimizer step 4 in both forms: `<dir>/full.ckpt` and the folder `<dir>/sharded.ckpt`.
struct SaveBothForms {
  std::string dir;
  template <class T, class M, class B>
  void on_train_batch_end(T& trainer, M&, const torch::Tensor&, const B&, int64_t) {
    if (trainer.global_step() != 4 || std::filesystem::exists(dir + "/full.ckpt")) return;
    trainer.save_checkpoint(dir + "/full.ckpt");
    trainer.strategy().set_state_dict_type(volt::StateDictType::sharded);
    trainer.save_checkpoint(dir + "/sharded.ckpt");
    trainer.strategy().set_state_dict_type(volt::StateDictType::full);
  }
};

/// What the world-size-1 scenarios share: whether a GPU scenario has no device here (said; the test is then skipped),
/// the options both of their runs take (Adam's windows of 3 micro-batches, clipping), and the loader of 96 samples.
template <class Accelerator>
bool no_device_for() {
  if (!std::is_same_v<Accelerator, volt::GPU> || volt::GPU::is_available()) return false;
  std::cout << "no CUDA device visible: skipped" << std::endl;
  return true;
}
volt::TrainerOptions world_one_options() {
  return {.devices = 1, .max_epochs = 2, .accumulate_grad_batches = 3, .gradient_clip_val = 0.05};
}
volt::data::TensorLoader world_one_loader(const torch::Tensor& x, const torch::Tensor& y) {
  return volt::data::TensorLoader(x, y, {.batch_size = kBatch, .shuffle = true, .seed = kSeed});
}

/// FSDP at world size 1 against SingleDevice: FsdpNet's five units under Bf16Mixed (gathered in bfloat16, their
/// storage freed between steps), with accumulation over 3, clipping and activation checkpointing, the same options on
/// both; a checkpoint of the pieces in the sharded form holds the full file's weights and Adam state. On the GPU over
/// NCCL (which refuses two ranks on one device: world size 1 is what one GPU can run), on the CPU over MPI.
template <class Backend, class Accelerator>
int fsdp_world_one_scenario() {
  constexpr bool gpu = std::is_same_v<Accelerator, volt::GPU>;
  if (no_device_for<Accelerator>()) return 77;
  const std::string what = std::string("FSDP<Script, ") + Backend::name + "> on the " + (gpu ? "GPU" : "CPU");
  const volt::TrainerOptions options = world_one_options();
  auto [x, y] = data(96);
  auto loader = [&] { return world_one_loader(x, y); };
  const auto dir = std::filesystem::temp_directory_path() / ("volt_fsdp_world_one_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  FsdpNetImpl net, ref, untrained;
  net.which = ref.which = volt::ActivationCheckpointing{.every = 1};
  HeldBetweenSteps held;
  auto trainer = volt::make_trainer<volt::FSDP<volt::Script, Backend>, volt::Bf16Mixed, Accelerator>(
      options, held, SaveBothForms{dir.string()});
  trainer.fit(net, loader());
  auto reference = volt::make_trainer<volt::SingleDevice, volt::Bf16Mixed, Accelerator>(options);
  reference.fit(ref, loader());
  const torch::Tensor got = flat(net).cpu(), want = flat(ref).cpu();
  const double diff = (got - want).abs().max().template item<double>();
  std::cout << "max |" << what << " - SingleDevice| (Bf16Mixed) = " << diff << std::endl;
  check(trainer.global_step() == reference.global_step(), "both ran the same number of steps");
  check(!torch::equal(want, flat(untrained)), "the reference trained");
  // As on several ranks (fsdp ... bf16): the same bfloat16 products; float32 sums in another order.
  check(torch::allclose(got, want, 1e-4, 1e-5), what + " at world size 1 equals SingleDevice");
  check(net.dtypes == std::set<std::string>{"BFloat16"}, "the blocks ran forward with bfloat16 weights (saw " +
                                                            std::to_string(net.dtypes.size()) + " dtypes)");
  check(*held.module_bytes == 0, "between steps the module's parameters hold no storage (saw " +
                                     std::to_string(*held.module_bytes) + " bytes)");
  check(net.parameters().front().device().is_cuda() == gpu, "after the fit the module is on its device");
  const std::string full = (dir / "full.ckpt").string(), sharded = (dir / "sharded.ckpt").string();
  check(volt::checkpoint::is_sharded(sharded), "the sharded save wrote a folder with an index");
  if (std::filesystem::exists(full) && volt::checkpoint::is_sharded(sharded)) {
    check(torch::equal(fsdp_state_in(full), fsdp_state_in(sharded)),
          "the sharded form holds the full file's weights and Adam state, bit for bit");
  }
  std::filesystem::remove_all(dir);
  if (failures == 0) std::cout << what << ": equals SingleDevice; both checkpoint forms agree" << std::endl;
  return failures == 0 ? 0 : 1;
}

int gpu_fsdp_scenario() {
#if VOLT_WITH_NCCL
  return fsdp_world_one_scenario<volt::Nccl, volt::GPU>();
#else
  std::cout << "volt::nccl is not linked (no NCCL or no CUDA LibTorch at configure time): skipped" << std::endl;
  return 77;
#endif
}

/// ModelParallel at world size 1 against SingleDevice: PlannedNet's `hsdp` plan on a 1x1 mesh (the blocks sharded along
/// one axis and replicated along the other, each axis a backend of its own), Adam, accumulation over 3, clipping. On the
/// GPU over NCCL (its axes split from the world's communicator), on the CPU over MPI.
template <class Backend, class Accelerator>
int model_parallel_world_one_scenario() {
  constexpr bool gpu = std::is_same_v<Accelerator, volt::GPU>;
  if (no_device_for<Accelerator>()) return 77;
  const std::string what = std::string("ModelParallel<Script, ") + Backend::name + "> on the " + (gpu ? "GPU" : "CPU");
  const volt::TrainerOptions options = world_one_options();
  auto [x, y] = data(96);
  auto loader = [&] { return world_one_loader(x, y); };
  PlannedNetImpl net;
  net.kind = "hsdp";
  FsdpNetImpl ref, untrained;
  auto trainer = volt::make_trainer<volt::ModelParallel<volt::Script, Backend>, volt::Fp32, Accelerator>(options);
  trainer.strategy().set_mesh({{"replicate", 1}, {"shard", 1}});
  trainer.fit(net, loader());
  auto reference = volt::make_trainer<volt::SingleDevice, volt::Fp32, Accelerator>(options);
  reference.fit(ref, loader());
  const torch::Tensor got = flat(net).cpu(), want = flat(ref).cpu();
  const double diff = (got - want).abs().max().template item<double>();
  std::cout << "max |" << what << " - SingleDevice| = " << diff << std::endl;
  check(!torch::equal(want, flat(untrained)), "the reference trained");
  check(torch::allclose(got, want, 1e-5, 1e-6), what + " at world size 1 equals SingleDevice");
  check(net.parameters().front().device().is_cuda() == gpu, "after the fit the module is on its device");
  if (failures == 0) std::cout << what << ": equals SingleDevice" << std::endl;
  return failures == 0 ? 0 : 1;
}

int gpu_model_parallel_scenario() {
#if VOLT_WITH_NCCL
  return model_parallel_world_one_scenario<volt::Nccl, volt::GPU>();
#else
  std::cout << "volt::nccl is not linked (no NCCL or no CUDA LibTorch at configure time): skipped" << std::endl;
  return 77;
#endif
}

/// Nccl on a mesh at world size 1 (NCCL refuses two ranks on one device): a 1x1 mesh's axes split from the world's
/// communicator (ncclCommSplit) and made from their own ids (ncclCommInitRank), each all-reducing, all-gathering and
/// sending to itself and receiving from itself in one group; exits 77 where CUDA or NCCL is missing.
int gpu_mesh_scenario() {
#if VOLT_WITH_NCCL
  if (!volt::GPU::is_available()) {
    std::cout << "no CUDA device visible: skipped" << std::endl;
    return 77;
  }
  const torch::Device cuda(torch::kCUDA, 0);
  volt::Mesh mesh(nullptr, {{"data", 1}, {"tensor", 1}});
  volt::Nccl world(volt::MeshAxis::world(nullptr), cuda);
  for (const char* name : {"data", "tensor"}) {
    volt::Nccl split(world, mesh.axis(name)), own(mesh.axis(name), cuda);
    for (volt::Nccl* nccl : {&split, &own}) {
      torch::Tensor t = torch::arange(6, torch::TensorOptions().device(cuda).dtype(torch::kFloat32));
      nccl->all_reduce_(t, volt::Reduce::sum);
      torch::Tensor flat = t.clone();
      nccl->all_gather_(flat);
      const torch::Tensor out = torch::randn({3, 4}, torch::TensorOptions().device(cuda)).to(torch::kBFloat16);
      torch::Tensor in = torch::zeros_like(out);
      nccl->ibatch_({{volt::P2P::send, out, 0}, {volt::P2P::recv, in, 0}}).wait();
      torch::cuda::synchronize();
      check(torch::equal(t.cpu(), torch::arange(6, torch::kFloat32)) && torch::equal(flat.cpu(), t.cpu()),
            std::string("axis ") + name + ": a world of one reduces and gathers to itself");
      check(torch::equal(in.cpu(), out.cpu()), std::string("axis ") + name + ": a send to itself is received");
    }
  }
  if (failures == 0) std::cout << "gpu-mesh: NCCL split and own communicators on each axis, sends to itself" << std::endl;
  return failures == 0 ? 0 : 1;
#else
  std::cout << "volt::nccl is not linked (no NCCL or no CUDA LibTorch at configure time): skipped" << std::endl;
  return 77;
#endif
}

}  // namespace

namespace {

/// The scenarios, by the name the command line (and so each CTest entry, `dist.<name>.*` and `gpu.ddp_*`) gives.
struct Mode {
  const char* name;
  const char* arguments;
  int (*run)(const std::vector<std::string>& a);  // a[0] is the name
};
/// The CPUs this process may run on (its affinity), read from the kernel.
int affinity_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : -1;
}

/// What a started process found wrong with its placement, said from inside the fit (a rank that throws there ends
/// the job, where an exit status after fit would not reach the launching process).
struct PlacementNetImpl : PredictNetImpl {
  std::string problem;
  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    if (!problem.empty()) throw std::runtime_error("MISMATCH: " + problem);
    return PredictNetImpl::training_step(b, ctx);
  }
};
TORCH_MODULE(PlacementNet);

/// The processes volt starts (Script's copies, Spawn's workers) are not bound to cores: each may run on every CPU the
/// launching process may (Open MPI would bind each to one core). Unless OMP_NUM_THREADS was set for the job
/// (`want_threads` > 0: that value must reach them), each is told its share of the cores in intra-op threads:
/// the ranks' threads together neither exceed the launching process's CPUs nor fall below half of them (a core may
/// hold 2 hyper-threads), and each runs at least 1.
template <class L>
int placement_scenario(int want_threads) {
  PlacementNet net;
  const char* role = std::getenv("VOLT_LAUNCH_ROLE");
  if (role == nullptr) {  // the launching process: before MPI starts, so the processes it starts see this
    ::setenv("VOLT_TEST_LAUNCHER_CPUS", std::to_string(affinity_count()).c_str(), 1);
  } else {
    const int launcher_cpus = std::stoi(std::getenv("VOLT_TEST_LAUNCHER_CPUS"));
    const char* omp = std::getenv("OMP_NUM_THREADS");
    const int threads = omp != nullptr ? std::stoi(omp) : 0;
    const bool ok = want_threads > 0 ? threads == want_threads
                                     : threads >= std::max(1, launcher_cpus / 2 / g_world) &&
                                           threads * g_world <= std::max(g_world, launcher_cpus);
    if (affinity_count() != launcher_cpus || !ok) {
      net->problem = std::string("a ") + role + " copy may run on " + std::to_string(affinity_count()) +
                     " CPUs (the launching process on " + std::to_string(launcher_cpus) + ") with OMP_NUM_THREADS=" +
                     (omp != nullptr ? omp : "(unset)") + " for " + std::to_string(g_world) + " ranks" +
                     (want_threads > 0 ? " (the job's: " + std::to_string(want_threads) + ")" : "");
    }
  }
  auto x = torch::randn({16, 4}), y = torch::randn({16, 1});
  volt::Trainer<volt::DDP<L>> trainer({.devices = g_world, .max_epochs = 1});
  trainer.fit(net, volt::data::TensorLoader(x, y, {.batch_size = 4}));
  return 0;
}

bool spawn_given(const std::vector<std::string>& a) { return a.size() > 1 && a[1] == "spawn"; }
const Mode kModes[] = {
    {"fit",
     "<script|spawn> [--accumulate k] [--fused] [--ema DECAY]: DDP on 2 ranks against one process's hand-written "
     "loop (--fused: with volt::optim::SGD; --ema: with EMAWeightAveraging, its average on every rank)",
     [](const std::vector<std::string>& a) {
       int k = 1;
       bool fused = false;
       double ema = 0.0;
       for (std::size_t i = 2; i < a.size(); ++i) {
         if (a[i] == "--accumulate" && i + 1 < a.size()) {
           k = std::stoi(a[++i]);
         } else if (a[i] == "--fused") {
           fused = true;
         } else if (a[i] == "--ema" && i + 1 < a.size()) {
           ema = std::stod(a[++i]);
         } else {
           throw std::invalid_argument("fit: unknown argument " + a[i] + "; allowed: --accumulate k, --fused, --ema DECAY");
         }
       }
       return spawn_given(a) ? fit_scenario<volt::Spawn>(k, fused, ema) : fit_scenario<volt::Script>(k, fused, ema);
     }},
    {"manual", "<script|spawn>: DDP on 2 ranks with manual optimization (two optimizers, toggling, no_sync) against "
               "one process's hand-written loop",
     [](const std::vector<std::string>& a) {
       return spawn_given(a) ? manual_scenario<volt::Spawn>() : manual_scenario<volt::Script>();
     }},
    {"placement", "<script|spawn> [threads]: the started processes are not bound to cores and run their share of "
                  "them in threads (threads: the OMP_NUM_THREADS the job set, which must reach them)",
     [](const std::vector<std::string>& a) {
       const int want = a.size() > 2 ? std::stoi(a[2]) : 0;
       return spawn_given(a) ? placement_scenario<volt::Spawn>(want) : placement_scenario<volt::Script>(want);
     }},
    {"indices", "<script|spawn> n: every sample once per epoch across ranks (padded as DistributedSampler)",
     [](const std::vector<std::string>& a) {
       const int64_t n = std::stoll(a.at(2));
       return spawn_given(a) ? indices_scenario<volt::Spawn>(n) : indices_scenario<volt::Script>(n);
     }},
    {"predict", "<script|spawn> world: predict and validate on 1001 samples against a hand-written loop",
     [](const std::vector<std::string>& a) {
       const int world = std::stoi(a.at(2));
       return spawn_given(a) ? predict_scenario<volt::Spawn>(world) : predict_scenario<volt::Script>(world);
     }},
    {"collectives", ": Mpi's flat reduce-scatter and all-gather on every dtype against known answers",
     [](const std::vector<std::string>&) { return collectives_scenario(); }},
    {"zero", "<script|spawn> stage world adam|sgd|fused-adam: ZeRO against a one-process loop (accumulation 3, clipping)",
     [](const std::vector<std::string>& a) {
       const int stage = std::stoi(a.at(2)), world = std::stoi(a.at(3));
       const bool adam = a.at(4) != "sgd", fused = a.at(4) == "fused-adam";
       if (stage == 1) {
         return spawn_given(a) ? zero_scenario<1, volt::Spawn>(world, adam, fused)
                               : zero_scenario<1, volt::Script>(world, adam, fused);
       }
       return spawn_given(a) ? zero_scenario<2, volt::Spawn>(world, adam, fused)
                             : zero_scenario<2, volt::Script>(world, adam, fused);
     }},
    {"fsdp", "<script|spawn> world reshard|keep [checkpointing] [bf16]: FSDP against a one-process loop (5 units and "
             "a root that do not divide by the world size, accumulation 3, clipping; Bf16Mixed)",
     [](const std::vector<std::string>& a) {
       const int world = std::stoi(a.at(2));
       const bool reshard = a.at(3) == "reshard";
       const bool checkpointing = std::find(a.begin() + 4, a.end(), "checkpointing") != a.end();
       if (std::find(a.begin() + 4, a.end(), "bf16") != a.end()) {
         return spawn_given(a) ? fsdp_scenario<volt::Spawn, volt::Bf16Mixed>(world, reshard, checkpointing)
                               : fsdp_scenario<volt::Script, volt::Bf16Mixed>(world, reshard, checkpointing);
       }
       return spawn_given(a) ? fsdp_scenario<volt::Spawn, volt::Fp32>(world, reshard, checkpointing)
                             : fsdp_scenario<volt::Script, volt::Fp32>(world, reshard, checkpointing);
     }},
    {"fsdp-declared", "world [swapped-on-rank]: FSDP of a module that declares its units in configure_model (laid out "
                      "at the fit's start) against a one-process loop; a rank that declares another order: refused",
     [](const std::vector<std::string>& a) {
       return fsdp_declared_scenario(std::stoi(a.at(1)), a.size() > 2 ? std::stoi(a.at(2)) : -1);
     }},
    {"fsdp-gpt", "world reshard|keep: a small GPT (examples/gpt_model.hpp) under FSDP for 10 AdamW steps against one "
                 "process",
     [](const std::vector<std::string>& a) { return fsdp_gpt_scenario(std::stoi(a.at(1)), a.at(2) == "reshard"); }},
    {"zero-inf", "stage: ZeRO on 2 ranks, a scaled loss, an inf in one rank's gradients: every rank skips that step",
     [](const std::vector<std::string>& a) { return a.at(1) == "1" ? zero_inf_scenario<1>() : zero_inf_scenario<2>(); }},
    {"zero-unfreeze", ": ZeRO<2> on 2 ranks whose module unfreezes a layer during the fit (refused)",
     [](const std::vector<std::string>&) { return zero_unfreeze_scenario(); }},
    {"legacy-checkpoint", "write|resume DIR [sharded]: checkpoints of an earlier volt (test/data/legacy/) resume exactly",
     [](const std::vector<std::string>& a) {
       return legacy_checkpoint_scenario(a.at(1), a.at(2), a.size() > 3 && a.at(3) == "sharded");
     }},
    {"manual-refusals", ": ManualParallel on 2 ranks refuses a one-file checkpoint",
     [](const std::vector<std::string>&) { return manual_refusals_scenario(); }},
    {"manual-weigh-loss", ": ManualParallel on 2 ranks with a token-weighted loss (refused)",
     [](const std::vector<std::string>&) { return manual_weigh_loss_scenario(); }},
    {"model-parallel", "world hsdp|two-parts: ModelParallel's parts (FSDP, HSDP, DDP) against a one-process loop, "
                       "its checkpoint resumed",
     [](const std::vector<std::string>& a) { return model_parallel_scenario(std::stoi(a.at(1)), a.at(2)); }},
    {"mesh-roles", "[refused]: ModelParallel on 4 ranks over replicate=1 x shard=2 x tensor=2 (tensor): batches, "
                   "sync_dist and gradients over the data axes only; refused: a part planned along the tensor axis",
     [](const std::vector<std::string>& a) { return mesh_roles_scenario(a.size() > 1 && a.at(1) == "refused"); }},
    {"mesh", ": a 2x2 and a 2x1x2 mesh on 4 ranks, collectives and sends along each axis",
     [](const std::vector<std::string>&) { return mesh_scenario(); }},
    {"mesh-fault", "die|stall: on a 2x2 mesh, rank 3 dies or stalls while rank 2 waits to receive from it",
     [](const std::vector<std::string>& a) { return mesh_fault_scenario(a.at(1)); }},
    {"metrics", ": sync_dist means and sums across ranks", [](const std::vector<std::string>&) { return metrics_scenario(); }},
    {"profiler", ": the Profiler callback on 2 ranks: a trace per rank with the fit loop's ranges",
     [](const std::vector<std::string>&) { return profiler_scenario(); }},
    {"metrics-mixed", ": a name logged with sync_dist on one rank and without on another is refused",
     [](const std::vector<std::string>&) { return metrics_mixed_scenario(); }},
    {"fsdp-weigh-loss", ": FSDP on 2 ranks, a window of 3 micro-batches weighted by tokens (refused)",
     [](const std::vector<std::string>&) {
       return sharded_weigh_loss_scenario<volt::FSDP<volt::Script, volt::Mpi>, vt::MaskedLM>();
     }},
    {"model-parallel-weigh-loss", ": ModelParallel on 2 ranks, a sharded part, a window of 3 micro-batches weighted by "
                                  "tokens (refused)",
     [](const std::vector<std::string>&) {
       return sharded_weigh_loss_scenario<volt::ModelParallel<volt::Script, volt::Mpi>, ShardedMaskedLM>();
     }},
    {"clip-fp64", "ddp|zero1|zero2|fsdp|model-parallel: clipping under Fp64True within 1e-12 of one process",
     [](const std::vector<std::string>& a) { return clip_fp64_scenario(a.at(1)); }},
    {"unit-order", "fsdp|model-parallel: rank 1 runs its units in reverse order (refused on every rank)",
     [](const std::vector<std::string>& a) {
       return a.at(1) == "fsdp" ? unit_order_scenario<volt::FSDP<volt::Script, volt::Mpi>, false>()
                                : unit_order_scenario<volt::ModelParallel<volt::Script, volt::Mpi>, true>();
     }},
    {"weighted-loss", ": one step of 3 micro-batches on 2 ranks with losses weighted by tokens (DDP, ZeRO<2>, FSDP)",
     [](const std::vector<std::string>&) { return weighted_loss_scenario(); }},
    {"checkpointing", ": a small GPT with activation checkpointing under DDP and ZeRO<2> (the plain run's weights)",
     [](const std::vector<std::string>&) { return checkpointing_scenario(); }},
    {"max-time", ": max_time on 2 ranks stepping at different speeds: both stop after the same batch",
     [](const std::vector<std::string>&) { return max_time_scenario(); }},
    {"gpu-ddp", "<script|spawn>: DDP over NCCL at world size 1 against SingleDevice on the GPU",
     [](const std::vector<std::string>& a) {
       return spawn_given(a) ? gpu_ddp_scenario<volt::Spawn>() : gpu_ddp_scenario<volt::Script>();
     }},
    {"gpu-zero", "<script|spawn>: ZeRO<2> over NCCL at world size 1 against SingleDevice on the GPU",
     [](const std::vector<std::string>& a) {
       return spawn_given(a) ? gpu_ddp_scenario<volt::Spawn, true>() : gpu_ddp_scenario<volt::Script, true>();
     }},
    {"fsdp-world-one", ": FSDP over MPI at world size 1 against SingleDevice on the CPU (Bf16Mixed, units), both "
                       "checkpoint forms (gpu-fsdp's case on the CPU)",
     [](const std::vector<std::string>&) { return fsdp_world_one_scenario<volt::Mpi, volt::CPU>(); }},
    {"gpu-fsdp", ": FSDP over NCCL at world size 1 against SingleDevice on the GPU (Bf16Mixed, units), both "
                 "checkpoint forms",
     [](const std::vector<std::string>&) { return gpu_fsdp_scenario(); }},
    {"model-parallel-world-one", ": ModelParallel over MPI at world size 1 against SingleDevice (a 1x1 mesh, HSDP's "
                                 "plan; gpu-model-parallel's case on the CPU)",
     [](const std::vector<std::string>&) { return model_parallel_world_one_scenario<volt::Mpi, volt::CPU>(); }},
    {"gpu-model-parallel", ": ModelParallel over NCCL at world size 1 against SingleDevice on the GPU (a 1x1 mesh)",
     [](const std::vector<std::string>&) { return gpu_model_parallel_scenario(); }},
    {"gpu-mesh", ": Nccl on the axes of a 1x1 mesh (split and made), sends to itself",
     [](const std::vector<std::string>&) { return gpu_mesh_scenario(); }},
    {"fail", "<script|spawn> rank step [throw|die|stall]: that rank throws, is killed or stalls at that step",
     [](const std::vector<std::string>& a) {
       const int rank = std::stoi(a.at(2)), step = std::stoi(a.at(3));
       const std::string how = a.size() > 4 && a[4].rfind("volt_fail_token", 0) != 0 ? a[4] : "throw";
       return spawn_given(a) ? fail_scenario<volt::Spawn>(rank, step, how) : fail_scenario<volt::Script>(rank, step, how);
     }},
    {"expect-failure", "timeout message... -- command...: the command ends within timeout, with every message, leaving no process",
     [](const std::vector<std::string>& a) {
       const double timeout = std::stod(a.at(1));
       const auto dashes = std::find(a.begin(), a.end(), std::string("--"));
       std::vector<std::string> messages(a.begin() + 2, dashes);
       // --any-status: mpirun --enable-recovery exits 0 whatever its ranks return; the messages are the check
       const auto any = std::find(messages.begin(), messages.end(), std::string("--any-status"));
       const bool any_status = any != messages.end();
       if (any_status) messages.erase(any);
       if (messages.empty() || dashes == a.end()) throw std::invalid_argument("expect-failure: no message, or no --");
       std::vector<std::string> cmd(dashes + 1, a.end());
       const std::string token = "volt_fail_token_" + std::to_string(::getpid());
       cmd.push_back(token);  // ignored by the scenario, found in /proc afterwards
       return expect_failure(timeout, messages, cmd, token, any_status);
     }},
};

int usage(const std::string& given) {
  std::cerr << (given.empty() ? std::string("no scenario given") : "unknown scenario " + given) << "; the scenarios:\n";
  for (const Mode& m : kModes) std::cerr << "  distributed " << m.name << " " << m.arguments << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);  // one intra-op thread per rank: 2 ranks on 2 cores
  std::vector<std::string> a(argv + 1, argv + argc);
  for (const char* flag : {"--world", "--nodes", "--timeout"}) {  // anywhere before a "--", for every scenario
    const auto end = std::find(a.begin(), a.end(), std::string("--"));  // after it: another command's words
    const auto at = std::find(a.begin(), end, flag);
    if (at == end || at + 1 == end) continue;
    const std::string f = flag;
    if (f == "--timeout") g_timeout = std::chrono::milliseconds(static_cast<int64_t>(std::stod(*(at + 1)) * 1000));
    if (f == "--world" || f == "--nodes") (f == "--world" ? g_world : g_nodes) = std::stoi(*(at + 1));
    a.erase(at, at + 2);
  }
  if (a.empty()) return usage("");
  try {
    for (const Mode& m : kModes) {
      if (a[0] == m.name) return m.run(a);
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  return usage(a[0]);
}
