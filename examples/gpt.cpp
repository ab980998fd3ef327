// A character-level GPT trained on Shakespeare's plays with the recipe of today's language models: AdamW with weight
// decay on matrices only, a linear warm-up then a cosine decay stepped per optimizer step, the loss a mean over the
// real tokens of each batch (`weigh_loss`: the last window of each play is shorter, padded and masked), activation
// checkpointing as an option, bfloat16 mixed precision on a GPU, a progress bar with tokens/s, validation loss,
// TensorBoard, and at the end a sample of generated text.
//
//   gpt [--data.text=DIR | --data.tokens=FILE [--data.val_tokens=FILE]] [--data.batch_size=N] [--model.vocab=N]
//       [--model.layers=N] [--model.width=N] [--model.heads=N]
//       [--model.context=N] [--model.dropout=X] [--model.checkpointing=K] [--model.lr=X] [--model.warmup=N]
//       [--run.device=auto|cpu|cuda] [--run.strategy=single|ddp|zero|fsdp] [--run.sample=N] [--trainer.max_steps=N]
//       [--trainer.accumulate_grad_batches=N] [--trainer.val_check_interval=N] [--trainer.limit_val_batches=N]
//       [--trainer.devices=N] [--trainer.seed=N] [--trainer.default_root_dir=DIR] [--trainer.<option>=VALUE ...]
//       [--config FILE] [--print_config] [--help]
//
// --data.text: a folder of .txt files (read in name order) or one file; default $VOLT_TEXT_DIR or
// ~/.cache/volt/shakespeare (`bash scripts/install-text.sh` puts the plays there). --data.tokens: train on a token file
// instead (nanoGPT's train.bin of uint16 ids, or a .npy), from windows drawn at random as nanoGPT draws them (one
// per data.batch_size row, trainer.max_steps batches), validating on --data.val_tokens (nanoGPT's val.bin; none: the
// training file's own windows in order); the vocabulary is model.vocab ids (0: the highest id in the files, plus one),
// and the sample printed is ids. --model.checkpointing=K: every K-th
// block recomputes its activations in backward (0: none, 1: all). --run.strategy=ddp|zero|fsdp: DDP, ZeRO<2> or FSDP
// (each block a unit whose parameters are gathered as it runs: gpt_model.hpp) over trainer.devices processes (on the
// CPU the program starts its copies itself, or runs as one rank of mpirun/srun; on GPUs one worker per GPU).
// trainer.max_steps is also the length of the warm-up and cosine schedule, and trainer.seed also seeds the shuffling
// and the initial weights (null: 0 for those). The whole configuration is the run's hyper-parameters (TensorBoard's
// HPARAMS tab and hparams.yaml).
// The defaults train a 4-layer, 128-wide model on the CPU in a few minutes. Exits with 77 when there is no text, and
// with 2 for an option it does not take.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "device.hpp"
#include "gpt_data.hpp"
#include "gpt_model.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

/// The Trainer's strategy: one process, or data parallelism over trainer.devices processes.
enum class Strategy { single, ddp, zero, fsdp };

constexpr auto volt_enum_names(Strategy) {
  using P = std::pair<Strategy, std::string_view>;
  return std::array{P{Strategy::single, "single"}, P{Strategy::ddp, "ddp"}, P{Strategy::zero, "zero"},
                    P{Strategy::fsdp, "fsdp"}};
}

/// Where and how the run goes.
struct RunOptions {
  Device device = Device::automatic;
  Strategy strategy = Strategy::single;
  int64_t sample = 400;
};
constexpr auto volt_fields(const RunOptions*) {
  return volt::fields({{"device", "auto: the GPU in bfloat16 mixed precision where CUDA sees one, else the CPU"},
                       {"strategy", "single: one process; ddp, zero (ZeRO<2>), fsdp: over trainer.devices processes"},
                       {"sample", "characters of text generated after training"}});
}

/// The text, or token files.
struct DataOptions {
  std::string text;
  std::string tokens;
  std::string val_tokens;
  int64_t batch_size = 32;
};
constexpr auto volt_fields(const DataOptions*) {
  return volt::fields({{"text", "a folder of .txt files (read in name order) or one file"},
                       {"tokens", "a token file to train on instead of text (nanoGPT's .bin of uint16 ids, or .npy)"},
                       {"val_tokens", "the token file to validate on (empty: the training file's windows in order)"},
                       {"batch_size", "windows per batch"}});
}

/// The model and its optimizer's recipe.
struct ModelOptions {
  int64_t vocab = 0;
  int64_t layers = 4;
  int64_t width = 128;
  int64_t heads = 4;
  int64_t context = 64;
  double dropout = 0.1;
  int64_t checkpointing = 0;
  double lr = 3e-3;
  int64_t warmup = 60;
};
constexpr auto volt_fields(const ModelOptions*) {
  return volt::fields({{"vocab", "token files: ids the model knows (0: the highest id in the files, plus one)"},
                       {"layers", "transformer blocks"},
                       {"width", "embedding width (a multiple of heads)"},
                       {"heads", "attention heads per block"},
                       {"context", "tokens per window: the longest sequence the model sees"},
                       {"dropout", "dropout probability"},
                       {"checkpointing", "every K-th block recomputes its activations in backward (0: none, 1: all)"},
                       {"lr", "AdamW's peak learning rate"},
                       {"warmup", "optimizer steps of linear warm-up before the cosine decay"}});
}

/// The configuration's sections as parsed, and the whole as JSON (the run's hyper-parameters).
struct Setup {
  const volt::TrainerOptions& trainer;
  const RunOptions& run;
  const DataOptions& data;
  const ModelOptions& model;
  volt::Json hparams;
};

/// `n` ids generated after `ids`: each drawn from the softmax of the last position's logits at temperature 0.8, among
/// the 20 likeliest.
std::vector<int64_t> generate(gpt::GPT& net, std::vector<int64_t> ids, int64_t n, torch::Device device) {
  torch::NoGradGuard no_grad;
  net->eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  for (int64_t i = 0; i < n; ++i) {
    const auto from = static_cast<int64_t>(ids.size()) > net->config.context
                          ? ids.end() - net->config.context : ids.begin();
    auto x = torch::tensor(std::vector<int64_t>(from, ids.end())).unsqueeze(0).to(device);
    auto logits = net->forward(x).select(1, -1).squeeze(0).to(torch::kCPU, torch::kFloat32) / 0.8;
    auto [top, where] = logits.topk(std::min<int64_t>(20, logits.size(0)));
    const auto pick = torch::multinomial(torch::softmax(top, -1), 1, false, gen).item<int64_t>();
    ids.push_back(where[pick].item<int64_t>());
  }
  net->train();
  return ids;
}

/// What the model learns from: the texts' characters, or a token file's ids.
struct Corpus {
  std::vector<std::string> texts;
  std::optional<gpt::Vocabulary> chars;
  std::optional<volt::data::TokenFile> tokens, val_tokens;
  int64_t vocab = 0;

  /// A sample of `n` tokens after a prompt, as text (characters) or as ids.
  std::string sample(gpt::GPT& net, int64_t n) const {
    const torch::Device device = net->wte->weight.device();
    if (!chars) {
      std::string out;
      for (int64_t id : generate(net, {0}, n, device)) out += std::to_string(id) + " ";
      return out;
    }
    std::vector<int64_t> prompt;
    for (char c : std::string("ROMEO.\n")) prompt.push_back(chars->ids.count(c) ? chars->ids.at(c) : 0);
    std::string out;
    for (int64_t id : generate(net, prompt, n, device)) out += chars->chars[static_cast<std::size_t>(id)];
    return out;
  }
};

/// The highest id in `file`, plus one.
int64_t vocabulary_of(const volt::data::TokenFile& file) {
  int64_t highest = 0;
  std::vector<int64_t> chunk(1 << 20);
  for (int64_t at = 0; at < file.size(); at += static_cast<int64_t>(chunk.size())) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), file.size() - at);
    file.read(at, n, chunk.data());
    highest = std::max(highest, *std::max_element(chunk.begin(), chunk.begin() + n));
  }
  return highest + 1;
}

// ---- the run ------------------------------------------------------------------------------------------------------

template <class S, class Precision, class Accelerator, class TrainLoader, class ValLoader>
int fit(const Setup& s, const Corpus& corpus, TrainLoader& train, ValLoader& val, const std::string& described) {
  const ModelOptions& m = s.model;
  gpt::Config config{.vocab = corpus.vocab, .context = m.context, .layers = m.layers, .heads = m.heads,
                     .width = m.width, .dropout = m.dropout,
                     .checkpointing = {.every = static_cast<std::size_t>(m.checkpointing)}};
  torch::manual_seed(s.trainer.seed.value_or(0));
  gpt::LanguageModel model(config, gpt::Recipe{.lr = m.lr, .warmup = m.warmup, .steps = s.trainer.max_steps});
  volt::TrainerOptions options = s.trainer;
  if constexpr (!S::is_distributed) options.devices = 1;  // trainer.devices counts a distributed strategy's ranks
  auto trainer = volt::make_trainer<S, Precision, Accelerator>(
      options, volt::ProgressBar{}, volt::LearningRateMonitor{},
      volt::TensorBoardLogger({.hparam_metrics = {"val_loss"}}));
  trainer.save_hyperparameters(s.hparams);
  // The loss is weighed by tokens over each accumulation window, so its micro-batches' gradients wait on each rank
  // until the window's last (FSDP's default reduce-scatters each as it ends).
  if constexpr (requires { trainer.strategy().set_sync_every_micro_batch(false); }) {
    if (options.accumulate_grad_batches > 1) trainer.strategy().set_sync_every_micro_batch(false);
  }
  if (trainer.is_global_zero()) {
    std::cout << described << " of " << m.context << " tokens, vocabulary " << corpus.vocab << "; model: " << m.layers
              << " layers, width " << m.width << ", " << model->net->parameters().size() << " tensors\n";
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
  std::cout << "---- sample ----\n" << corpus.sample(model->net, s.run.sample) << "\n---- end ----\n";
  return 0;
}

template <class S, class Precision, class Accelerator>
int train(const Setup& s, const Corpus& corpus) {
  const ModelOptions& m = s.model;
  const uint64_t seed = s.trainer.seed.value_or(0);
  if (corpus.tokens) {  // nanoGPT's batches: random windows, max_steps batches' worth an epoch
    using volt::data::TokenLoader;
    TokenLoader train(*corpus.tokens, {.block_size = m.context, .windows = volt::data::Windows::random,
                                       .windows_per_epoch = s.trainer.max_steps * s.data.batch_size,
                                       .loader = {.batch_size = s.data.batch_size, .seed = seed}});
    TokenLoader val(corpus.val_tokens ? *corpus.val_tokens : *corpus.tokens,
                    {.block_size = m.context, .loader = {.batch_size = s.data.batch_size}});
    return fit<S, Precision, Accelerator>(s, corpus, train, val, "tokens: " + corpus.tokens->path().string() + ", " +
                                          std::to_string(corpus.tokens->size()) + " ids; windows");
  }
  const auto [rows, lengths] = gpt::windows(corpus.texts, *corpus.chars, m.context);
  // Every 10th window for validation, the rest for training (both spread over all the plays).
  const auto all = torch::arange(rows.size(0));
  const auto is_val = all.remainder(10) == 9;
  const auto train_idx = all.masked_select(~is_val), val_idx = all.masked_select(is_val);
  volt::data::TensorLoader train(rows.index_select(0, train_idx), lengths.index_select(0, train_idx),
                                 {.batch_size = s.data.batch_size, .shuffle = true, .seed = seed});
  volt::data::TensorLoader val(rows.index_select(0, val_idx), lengths.index_select(0, val_idx),
                               {.batch_size = s.data.batch_size});
  return fit<S, Precision, Accelerator>(s, corpus, train, val, "text: " + std::to_string(corpus.texts.size()) +
                                        " files, " + std::to_string(rows.size(0)) + " windows");
}

template <class Precision, class Accelerator, class Backend>
int with_strategy(const Setup& s, const Corpus& corpus) {
  constexpr bool gpu = Accelerator::device_type == c10::DeviceType::CUDA;
  const bool spawn = gpu && !volt::cluster::detect().launched_externally();
  switch (s.run.strategy) {
    case Strategy::ddp:
      if (spawn) return train<volt::DDP<volt::Spawn, Backend>, Precision, Accelerator>(s, corpus);
      return train<volt::DDP<volt::Script, Backend>, Precision, Accelerator>(s, corpus);
    case Strategy::zero:
      if (spawn) return train<volt::ZeRO<2, volt::Spawn, Backend>, Precision, Accelerator>(s, corpus);
      return train<volt::ZeRO<2, volt::Script, Backend>, Precision, Accelerator>(s, corpus);
    case Strategy::fsdp:
      if (spawn) return train<volt::FSDP<volt::Spawn, Backend>, Precision, Accelerator>(s, corpus);
      return train<volt::FSDP<volt::Script, Backend>, Precision, Accelerator>(s, corpus);
    case Strategy::single: break;
  }
  return train<volt::SingleDevice, Precision, Accelerator>(s, corpus);
}

// What the options' types alone do not bound: the model's shape and the schedule's length.
void check(const volt::TrainerOptions& trainer, const ModelOptions& model) {
  if (model.heads < 1 || model.width % model.heads != 0 || model.checkpointing < 0 || trainer.max_steps < 1) {
    throw volt::ConfigError("model.width " + std::to_string(model.width) + ", model.heads " +
                            std::to_string(model.heads) + ", model.checkpointing " +
                            std::to_string(model.checkpointing) + ", trainer.max_steps " +
                            std::to_string(trainer.max_steps) + ": the width must be a multiple of the heads (1 or "
                            "more), checkpointing 0 or more, max_steps 1 or more");
  }
}

// $VOLT_TEXT_DIR, else ~/.cache/volt/shakespeare.
std::string default_text() {
  const char* home = std::getenv("HOME");
  const char* text_env = std::getenv("VOLT_TEXT_DIR");
  return text_env ? text_env : std::string(home ? home : ".") + "/.cache/volt/shakespeare";
}

int main(int argc, char** argv) try {
  volt::TrainerOptions trainer{.devices = 2, .max_steps = 600, .limit_val_batches = volt::Limit(20),
                               .val_check_interval = volt::Limit(200), .check_val_every_n_epoch = std::nullopt,
                               .num_sanity_val_steps = 0, .seed = 1337, .log_every_n_steps = 10};
  RunOptions run;
  DataOptions data{.text = default_text()};
  ModelOptions model;
  volt::Config config("gpt", "Trains a character-level GPT on a text (Shakespeare's plays) and samples from it.");
  config.add("trainer", trainer).add("run", run).add("data", data).add("model", model);
  if (!config.parse(argc, argv)) return 0;
  check(trainer, model);
  Corpus corpus;
  if (!data.tokens.empty()) {
    corpus.tokens.emplace(data.tokens);
    if (!data.val_tokens.empty()) corpus.val_tokens.emplace(data.val_tokens);
    corpus.vocab = model.vocab > 0 ? model.vocab
                                  : std::max(vocabulary_of(*corpus.tokens),
                                             corpus.val_tokens ? vocabulary_of(*corpus.val_tokens) : int64_t{0});
  } else {
    corpus.texts = gpt::read_texts(data.text);
    if (corpus.texts.empty()) {
      std::cerr << "gpt: no text at " << data.text << " (a .txt file or a folder of them); "
                << "`bash scripts/install-text.sh` puts Shakespeare's plays in ~/.cache/volt/shakespeare.\n";
      return 77;
    }
    corpus.chars.emplace(corpus.texts);
    corpus.vocab = corpus.chars->size();
  }
  const Setup setup{trainer, run, data, model, config.json()};
  switch (resolve(run.device)) {
    case Device::cuda: {
      using Backend = std::conditional_t<VOLT_WITH_NCCL != 0, volt::Nccl, volt::Mpi>;
      return with_strategy<volt::Bf16Mixed, volt::GPU, Backend>(setup, corpus);
    }
    default: return with_strategy<volt::Fp32, volt::CPU, volt::Mpi>(setup, corpus);
  }
} catch (const volt::ConfigError& e) {
  std::cerr << "gpt: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "gpt: " << e.what() << "\n";
  return 1;
}
