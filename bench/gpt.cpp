// Benchmark: the GPT example's model and recipe (examples/gpt_model.hpp) trained by volt's Trainer on the CPU for a
// fixed number of steps, against the same in PyTorch (bench/gpt_torch.py: eager, torch.utils.checkpoint, Lightning);
// bench/gpt.sh runs them in interleaved rounds and prints the ratios. One run per process, so that each peak of
// resident memory is its own.
//
//   gpt_bench export FILE [model flags]   the initial weights, as torch.load reads them (PyTorch starts from them)
//   gpt_bench run [--checkpointing K] [--steps N] [--batch N] [--text DIR] [model flags]   one JSON line
//   model flags: --layers N --width N --heads N --context N (default 4, 128, 4, 64)
//
// The data: the windows of Shakespeare's plays (examples/gpt_data.hpp) in order, no shuffling, dropout 0, so both
// sides see the same batches and compute the same function; the validation loss is over the last 8 batches' windows.

#include <torch/torch.h>
#include <volt/volt.hpp>

#include "../examples/gpt_data.hpp"
#include "../examples/gpt_model.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Args {
  std::string mode, file, text;
  int64_t layers = 4, width = 128, heads = 4, context = 64, batch = 32, steps = 60, checkpointing = 0;
};

/// A line of /proc/self/status in MiB (VmRSS, VmHWM).
double status_mib(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) / 1024.0;
  }
  return -1.0;
}

/// The peak of resident memory (VmHWM) starts again from the current resident memory.
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

/// When each training step ended; resident memory at the start, and after the first step (the weights, their
/// gradients and the optimizer's state then exist, so what later steps add above it is their activations).
struct Clock {
  std::vector<std::chrono::steady_clock::time_point> ends;
  double rss_before = status_mib("VmRSS"), peak_first = 0.0, rss_after_first = 0.0;
  Clock() { reset_peak(); }
  void step_end() {
    ends.push_back(std::chrono::steady_clock::now());
    if (ends.size() != 1) return;
    peak_first = status_mib("VmHWM");
    rss_after_first = status_mib("VmRSS");
    reset_peak();
  }
};

/// The Trainer's callback that tells the clock.
struct StepClock {
  Clock* clock;
  template <class T, class M, class B>
  void on_train_batch_end(T&, M&, const torch::Tensor&, const B&, int64_t) {
    clock->step_end();
  }
};

gpt::Config config_of(const Args& a, int64_t vocab) {
  return {.vocab = vocab, .context = a.context, .layers = a.layers, .heads = a.heads, .width = a.width,
          .dropout = 0.0, .checkpointing = {.every = static_cast<std::size_t>(a.checkpointing)}};
}

int run(const Args& a) {
  const auto texts = gpt::read_texts(a.text);
  if (texts.empty()) {
    std::cerr << "gpt_bench: no text at " << a.text << " (bash scripts/install-text.sh)\n";
    return 77;
  }
  const gpt::Vocabulary vocab(texts);
  const auto [rows, lengths] = gpt::windows(texts, vocab, a.context);
  const int64_t n_train = a.steps * a.batch, n_val = 8 * a.batch;
  volt::data::TensorLoader train(rows.slice(0, 0, n_train), lengths.slice(0, 0, n_train), {.batch_size = a.batch});
  volt::data::TensorLoader val(rows.slice(0, -n_val), lengths.slice(0, -n_val), {.batch_size = a.batch});
  torch::manual_seed(1337);
  gpt::LanguageModel model(config_of(a, vocab.size()), gpt::Recipe{.lr = 3e-3, .warmup = 10, .steps = a.steps});
  Clock clock;
  auto trainer = volt::make_trainer(
      {.max_steps = a.steps, .num_sanity_val_steps = 0, .log_every_n_steps = 1000},
      StepClock{&clock});
  trainer.fit(model, train);
  const double step_peak = status_mib("VmHWM"), peak = std::max(clock.peak_first, step_peak);
  const auto& ends = clock.ends;
  const double val_loss = trainer.validate(model, val).at("val_loss");
  const int64_t warm = std::min<int64_t>(5, a.steps - 2);
  const double seconds = std::chrono::duration<double>(ends.back() - ends[static_cast<std::size_t>(warm)]).count();
  const double tokens = static_cast<double>((a.steps - 1 - warm) * a.batch * a.context);
  std::cout << "{\"bench\":\"gpt\",\"impl\":\"volt\",\"torch\":\"" << TORCH_VERSION << "\",\"threads\":"
            << at::get_num_threads() << ",\"layers\":" << a.layers << ",\"width\":" << a.width << ",\"context\":"
            << a.context << ",\"batch\":" << a.batch << ",\"steps\":" << a.steps << ",\"checkpointing\":"
            << a.checkpointing << ",\"tokens_per_s\":" << tokens / seconds << ",\"val_loss\":" << val_loss
            << ",\"peak_rss_mib\":" << peak << ",\"train_rss_rise_mib\":" << peak - clock.rss_before
            << ",\"step_rss_rise_mib\":" << step_peak - clock.rss_after_first << "}" << std::endl;
  return 0;
}

int export_weights(const Args& a) {
  const auto texts = gpt::read_texts(a.text);
  if (texts.empty()) return 77;
  const gpt::Vocabulary vocab(texts);
  torch::manual_seed(1337);
  gpt::LanguageModel model(config_of(a, vocab.size()), gpt::Recipe{});
  c10::Dict<std::string, at::Tensor> weights;
  for (const auto& p : model->net->named_parameters()) weights.insert(p.key(), p.value().detach().clone());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(weights));
  std::ofstream(a.file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  Args a;
  const char* home = std::getenv("HOME");
  const char* text_env = std::getenv("VOLT_TEXT_DIR");
  a.text = text_env ? text_env : std::string(home ? home : ".") + "/.cache/volt/shakespeare";
  if (argc < 2) {
    std::cerr << "usage: gpt_bench export FILE | run [--checkpointing K] [--steps N] [--batch N] [--text DIR] "
                 "[--layers N] [--width N] [--heads N] [--context N]\n";
    return 2;
  }
  a.mode = argv[1];
  int i = 2;
  if (a.mode == "export" && argc > 2) a.file = argv[i++];
  for (; i < argc; i += 2) {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--text") a.text = v;
    else if (k == "--layers") a.layers = std::stoll(v);
    else if (k == "--width") a.width = std::stoll(v);
    else if (k == "--heads") a.heads = std::stoll(v);
    else if (k == "--context") a.context = std::stoll(v);
    else if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--steps") a.steps = std::stoll(v);
    else if (k == "--checkpointing") a.checkpointing = std::stoll(v);
    else throw std::invalid_argument("unknown flag " + k);
  }
  if (a.mode == "export" && !a.file.empty()) return export_weights(a);
  if (a.mode == "run") return run(a);
  throw std::invalid_argument("the first argument is export FILE or run");
} catch (const std::exception& e) {
  std::cerr << "gpt_bench: " << e.what() << "\n";
  return 1;
}
