// A character-level GPT trained on Shakespeare's plays with the recipe of today's language models: AdamW with weight
// decay on matrices only, a linear warm-up then a cosine decay stepped per optimizer step, the loss a mean over the
// real tokens of each batch (`weigh_loss`: the last window of each play is shorter, padded and masked), activation
// checkpointing as an option, bfloat16 mixed precision on a GPU, a progress bar with tokens/s, validation loss,
// TensorBoard, and at the end a sample of generated text.
//
//   gpt [--text DIR] [--layers N] [--width N] [--heads N] [--context N] [--batch N] [--accumulate N] [--steps N]
//       [--lr X] [--warmup N] [--dropout X] [--checkpointing K] [--val-every N] [--val-batches N] [--sample N]
//       [--device auto|cpu|cuda] [--strategy single|ddp|zero|fsdp] [--devices N] [--out DIR] [--seed N]
//
// --text: a folder of .txt files (read in name order) or one file; default $VOLT_TEXT_DIR or ~/.cache/volt/shakespeare
// (`bash scripts/install-text.sh` puts the plays there). --checkpointing K: every K-th block recomputes its
// activations in backward (0: none, 1: all). --strategy ddp|zero|fsdp: DDP, ZeRO<2> or FSDP (each block a unit whose
// parameters are gathered as it runs: gpt_model.hpp) over --devices processes (on the CPU the program starts its
// copies itself, or runs as one rank of mpirun/srun; on GPUs one worker per GPU).
// The defaults train a 4-layer, 128-wide model on the CPU in a few minutes. Exits with 77 when there is no text.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "gpt_data.hpp"
#include "gpt_model.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

struct Args {
  std::string text, device = "auto", strategy = "single", out = ".";
  int64_t layers = 4, width = 128, heads = 4, context = 64, batch = 32, accumulate = 1, steps = 600, warmup = 60;
  int64_t checkpointing = 0, val_every = 200, val_batches = 20, sample = 400, devices = 2, seed = 1337;
  double lr = 3e-3, dropout = 0.1;
};


/// `n` characters generated after `prompt`: each drawn from the softmax of the last position's logits at
/// temperature 0.8, among the 20 likeliest.
std::string generate(gpt::GPT& net, const gpt::Vocabulary& v, const std::string& prompt, int64_t n,
                     torch::Device device) {
  torch::NoGradGuard no_grad;
  net->eval();
  std::vector<int64_t> ids;
  for (char c : prompt) ids.push_back(v.ids.count(c) ? v.ids.at(c) : 0);
  std::string out = prompt;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  for (int64_t i = 0; i < n; ++i) {
    const auto from = static_cast<int64_t>(ids.size()) > net->config.context
                          ? ids.end() - net->config.context : ids.begin();
    auto x = torch::tensor(std::vector<int64_t>(from, ids.end())).unsqueeze(0).to(device);
    auto logits = net->forward(x).select(1, -1).squeeze(0).to(torch::kCPU, torch::kFloat32) / 0.8;
    auto [top, where] = logits.topk(std::min<int64_t>(20, v.size()));
    const auto pick = torch::multinomial(torch::softmax(top, -1), 1, false, gen).item<int64_t>();
    ids.push_back(where[pick].item<int64_t>());
    out += v.chars[static_cast<std::size_t>(ids.back())];
  }
  net->train();
  return out;
}

// ---- the run ------------------------------------------------------------------------------------------------------

template <class Strategy, class Precision, class Accelerator>
int train(const Args& args, const std::vector<std::string>& texts) {
  const gpt::Vocabulary vocab(texts);
  const auto [rows, lengths] = gpt::windows(texts, vocab, args.context);
  // Every 10th window for validation, the rest for training (both spread over all the plays).
  const auto all = torch::arange(rows.size(0));
  const auto is_val = all.remainder(10) == 9;
  const auto train_idx = all.masked_select(~is_val), val_idx = all.masked_select(is_val);
  volt::data::TensorLoader train(rows.index_select(0, train_idx), lengths.index_select(0, train_idx),
                                 {.batch_size = args.batch, .shuffle = true, .seed = static_cast<uint64_t>(args.seed)});
  volt::data::TensorLoader val(rows.index_select(0, val_idx), lengths.index_select(0, val_idx),
                               {.batch_size = args.batch});
  gpt::Config config{.vocab = vocab.size(), .context = args.context, .layers = args.layers, .heads = args.heads,
                     .width = args.width, .dropout = args.dropout,
                     .checkpointing = {.every = static_cast<std::size_t>(args.checkpointing)}};
  torch::manual_seed(static_cast<uint64_t>(args.seed));
  gpt::LanguageModel model(config, gpt::Recipe{.lr = args.lr, .warmup = args.warmup, .steps = args.steps});
  auto trainer = volt::make_trainer<Strategy, Precision, Accelerator>(
      {.devices = Strategy::is_distributed ? static_cast<int>(args.devices) : 1, .max_steps = args.steps,
       .limit_val_batches = volt::Limit(args.val_batches), .val_check_interval = volt::Limit(args.val_every),
       .check_val_every_n_epoch = std::nullopt, .num_sanity_val_steps = 0,
       .accumulate_grad_batches = args.accumulate, .seed = static_cast<uint64_t>(args.seed),
       .log_every_n_steps = 10, .default_root_dir = args.out},
      volt::ProgressBar{}, volt::LearningRateMonitor{},
      volt::TensorBoardLogger({.hparams = {{"layers", static_cast<double>(args.layers)},
                                           {"width", static_cast<double>(args.width)},
                                           {"context", static_cast<double>(args.context)},
                                           {"batch", static_cast<double>(args.batch)}, {"lr", args.lr},
                                           {"checkpointing", static_cast<double>(args.checkpointing)}},
                               .hparam_metrics = {"val_loss"}}));
  // The loss is weighed by tokens over each accumulation window, so its micro-batches' gradients wait on each rank
  // until the window's last (FSDP's default reduce-scatters each as it ends).
  if constexpr (requires { trainer.strategy().set_sync_every_micro_batch(false); }) {
    if (args.accumulate > 1) trainer.strategy().set_sync_every_micro_batch(false);
  }
  if (trainer.is_global_zero()) {
    std::cout << "text: " << texts.size() << " files, " << rows.size(0) << " windows of " << args.context
              << " tokens, vocabulary " << vocab.size() << "; model: " << args.layers << " layers, width "
              << args.width << ", " << model->net->parameters().size() << " tensors\n";
  }
  const double before = trainer.validate(model, val).at("val_loss");
  const auto start = std::chrono::steady_clock::now();
  trainer.fit(model, train, val);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto metrics = trainer.validate(model, val);  // every rank takes part
  if (!trainer.is_global_zero()) return 0;
  std::cout << "trained " << trainer.global_step() << " steps in " << seconds << " s; validation loss " << before
            << " -> " << metrics.at("val_loss") << "\n";
  std::cout << "tensorboard: " << trainer.template callback<volt::TensorBoardLogger>().event_file().string() << "\n";
  std::cout << "---- sample ----\n"
            << generate(model->net, vocab, "ROMEO.\n", args.sample, model->net->wte->weight.device())
            << "\n---- end ----\n";
  return 0;
}

int usage() {
  std::cerr << "usage: gpt [--text DIR] [--layers N] [--width N] [--heads N] [--context N] [--batch N] "
               "[--accumulate N] [--steps N] [--lr X] [--warmup N] [--dropout X] [--checkpointing K] [--val-every N] "
               "[--val-batches N] [--sample N] [--device auto|cpu|cuda] [--strategy single|ddp|zero|fsdp] "
               "[--devices N] [--out DIR] [--seed N]\n";
  return 2;
}

template <class Precision, class Accelerator, class Backend>
int with_strategy(const Args& args, const std::vector<std::string>& texts) {
  constexpr bool gpu = Accelerator::device_type == c10::DeviceType::CUDA;
  const bool external = volt::cluster::detect().launched_externally();
  if (args.strategy == "ddp") {
    if (gpu && !external) return train<volt::DDP<volt::Spawn, Backend>, Precision, Accelerator>(args, texts);
    return train<volt::DDP<volt::Script, Backend>, Precision, Accelerator>(args, texts);
  }
  if (args.strategy == "zero") {
    if (gpu && !external) return train<volt::ZeRO<2, volt::Spawn, Backend>, Precision, Accelerator>(args, texts);
    return train<volt::ZeRO<2, volt::Script, Backend>, Precision, Accelerator>(args, texts);
  }
  if (args.strategy == "fsdp") {
    if (gpu && !external) return train<volt::FSDP<volt::Spawn, Backend>, Precision, Accelerator>(args, texts);
    return train<volt::FSDP<volt::Script, Backend>, Precision, Accelerator>(args, texts);
  }
  return train<volt::SingleDevice, Precision, Accelerator>(args, texts);
}

int main(int argc, char** argv) try {
  Args args;
  const char* home = std::getenv("HOME");
  const char* text_env = std::getenv("VOLT_TEXT_DIR");
  args.text = text_env ? text_env : std::string(home ? home : ".") + "/.cache/volt/shakespeare";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::cerr << "gpt: " << a << " needs a value\n";
      return usage();
    }
    const std::string v = argv[++i];
    if (a == "--text") args.text = v;
    else if (a == "--device") args.device = v;
    else if (a == "--strategy") args.strategy = v;
    else if (a == "--out") args.out = v;
    else if (a == "--layers") args.layers = std::stoll(v);
    else if (a == "--width") args.width = std::stoll(v);
    else if (a == "--heads") args.heads = std::stoll(v);
    else if (a == "--context") args.context = std::stoll(v);
    else if (a == "--batch") args.batch = std::stoll(v);
    else if (a == "--accumulate") args.accumulate = std::stoll(v);
    else if (a == "--steps") args.steps = std::stoll(v);
    else if (a == "--warmup") args.warmup = std::stoll(v);
    else if (a == "--checkpointing") args.checkpointing = std::stoll(v);
    else if (a == "--val-every") args.val_every = std::stoll(v);
    else if (a == "--val-batches") args.val_batches = std::stoll(v);
    else if (a == "--sample") args.sample = std::stoll(v);
    else if (a == "--devices") args.devices = std::stoll(v);
    else if (a == "--seed") args.seed = std::stoll(v);
    else if (a == "--lr") args.lr = std::stod(v);
    else if (a == "--dropout") args.dropout = std::stod(v);
    else {
      std::cerr << "gpt: unknown flag " << a << "\n";
      return usage();
    }
  }
  if (args.device != "auto" && args.device != "cpu" && args.device != "cuda") {
    std::cerr << "gpt: --device " << args.device << " is not one of auto, cpu, cuda\n";
    return 2;
  }
  if (args.strategy != "single" && args.strategy != "ddp" && args.strategy != "zero" && args.strategy != "fsdp") {
    std::cerr << "gpt: --strategy " << args.strategy << " is not one of single, ddp, zero, fsdp\n";
    return 2;
  }
  if (args.heads < 1 || args.width % args.heads != 0 || args.checkpointing < 0 || args.steps < 1) {
    std::cerr << "gpt: --width " << args.width << ", --heads " << args.heads << ", --checkpointing "
              << args.checkpointing << ", --steps " << args.steps << ": the width must be a multiple of the heads (1 "
              << "or more), checkpointing 0 or more, steps 1 or more\n";
    return 2;
  }
  const auto texts = gpt::read_texts(args.text);
  if (texts.empty()) {
    std::cerr << "gpt: no text at " << args.text << " (a .txt file or a folder of them); "
              << "`bash scripts/install-text.sh` puts Shakespeare's plays in ~/.cache/volt/shakespeare.\n";
    return 77;
  }
  if (args.device == "cuda" || (args.device == "auto" && volt::GPU::is_available())) {
    using Backend = std::conditional_t<VOLT_WITH_NCCL != 0, volt::Nccl, volt::Mpi>;
    return with_strategy<volt::Bf16Mixed, volt::GPU, Backend>(args, texts);
  }
  return with_strategy<volt::Fp32, volt::CPU, volt::Mpi>(args, texts);
} catch (const std::exception& e) {
  std::cerr << "gpt: " << e.what() << "\n";
  return 1;
}
