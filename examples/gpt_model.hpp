#pragma once
// A decoder-only transformer (GPT-2's shape): token and position embeddings, pre-norm blocks of causal self-attention
// and an MLP, a final norm and a head that shares the token embedding's weights; and the module volt trains it as,
// with the recipe of today's language models. Used by examples/gpt.cpp, its benchmark (bench/gpt.cpp) and the tests;
// bench/gpt_torch.py builds the same model in PyTorch, parameter for parameter.

#include <volt/volt.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gpt {

struct Config {
  int64_t vocab = 65;    // characters
  int64_t context = 64;  // the longest sequence
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;   // embedding size
  double dropout = 0.0;
  volt::ActivationCheckpointing checkpointing{};  // which blocks recompute their activations in backward
  bool gelu_tanh = false;  // GELU's tanh approximation, GPT-2's "gelu_new" (false: the exact GELU)
};

/// Multi-head causal self-attention: one projection to queries, keys and values, a lower-triangular mask.
struct CausalSelfAttentionImpl : torch::nn::Module {
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  torch::nn::Dropout attn_drop{nullptr}, resid_drop{nullptr};
  torch::Tensor mask;
  int64_t heads;

  explicit CausalSelfAttentionImpl(const Config& c) : heads(c.heads) {
    qkv = register_module("qkv", torch::nn::Linear(c.width, 3 * c.width));
    proj = register_module("proj", torch::nn::Linear(c.width, c.width));
    attn_drop = register_module("attn_drop", torch::nn::Dropout(c.dropout));
    resid_drop = register_module("resid_drop", torch::nn::Dropout(c.dropout));
    mask = register_buffer("mask", torch::ones({c.context, c.context}).tril().view({1, 1, c.context, c.context}));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2), hd = c / heads;
    auto parts = qkv(x).split(c, 2);
    auto q = parts[0].view({b, t, heads, hd}).transpose(1, 2);
    auto k = parts[1].view({b, t, heads, hd}).transpose(1, 2);
    auto v = parts[2].view({b, t, heads, hd}).transpose(1, 2);
    auto att = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    att = att.masked_fill(mask.slice(2, 0, t).slice(3, 0, t) == 0, -std::numeric_limits<float>::infinity());
    att = attn_drop(torch::softmax(att, -1));
    auto y = att.matmul(v).transpose(1, 2).contiguous().view({b, t, c});
    return resid_drop(proj(y));
  }
};
TORCH_MODULE(CausalSelfAttention);

/// x + attention(norm(x)), then x + mlp(norm(x)).
struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, fc_proj{nullptr};
  torch::nn::Dropout drop{nullptr};
  std::string gelu;  // "none" (exact) or "tanh"

  explicit BlockImpl(const Config& c) : gelu(c.gelu_tanh ? "tanh" : "none") {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    attn = register_module("attn", CausalSelfAttention(c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    fc = register_module("fc", torch::nn::Linear(c.width, 4 * c.width));
    fc_proj = register_module("fc_proj", torch::nn::Linear(4 * c.width, c.width));
    drop = register_module("drop", torch::nn::Dropout(c.dropout));
  }

  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln1(x));
    return x + drop(fc_proj(torch::gelu(fc(ln2(x)), gelu)));
  }
};
TORCH_MODULE(Block);

/// The whole model: token ids [batch, time] to logits [batch, time, vocab].
struct GPTImpl : torch::nn::Module {
  Config config;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f{nullptr};

  explicit GPTImpl(const Config& c) : config(c) {
    wte = register_module("wte", torch::nn::Embedding(c.vocab, c.width));
    wpe = register_module("wpe", torch::nn::Embedding(c.context, c.width));
    drop = register_module("drop", torch::nn::Dropout(c.dropout));
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
    register_module("blocks", blocks);
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    init_weights();
  }

  /// GPT-2's initialisation: N(0, 0.02) for weights, zero biases, the residual projections scaled by 1/sqrt(2 layers).
  void init_weights() {
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      if (name.ends_with(".bias")) {
        p.value().zero_();
      } else if (name.find("ln") != std::string::npos) {
        p.value().fill_(1.0);
      } else if (name.ends_with("proj.weight")) {
        p.value().normal_(0.0, 0.02 / std::sqrt(2.0 * static_cast<double>(config.layers)));
      } else {
        p.value().normal_(0.0, 0.02);
      }
    }
  }

  torch::Tensor forward(const torch::Tensor& idx) {
    const int64_t t = idx.size(1);
    TORCH_CHECK(t <= config.context, "gpt: a sequence of ", t, " tokens is longer than the context (", config.context,
                ")");
    auto pos = torch::arange(t, idx.options().dtype(torch::kLong));
    auto x = drop(wte(idx) + wpe(pos));
    x = volt::forward_blocks<BlockImpl>(blocks, x, volt::Units{}, config.checkpointing);  // each block an FSDP unit
    return torch::nn::functional::linear(ln_f(x), wte->weight);  // the head shares the token embedding
  }
};
TORCH_MODULE(GPT);

/// The training recipe: AdamW (betas 0.9, 0.95) with weight decay 0.1 on matrices only, the rate warmed up linearly
/// from 1% over `warmup` steps, then down a cosine to a tenth of it at `steps`.
struct Recipe {
  double lr = 3e-3;
  int64_t warmup = 60;
  int64_t steps = 600;
};

/// The model as volt trains it: windows of tokens (each row's count of real tokens as the target), the loss a mean
/// over the real tokens (`weigh_loss`), `train_loss` (and tokens per second) in the progress bar, `val_loss`.
struct LanguageModelImpl : torch::nn::Module {
  GPT net{nullptr};
  Recipe recipe;
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();

  LanguageModelImpl(const Config& c, Recipe r) : recipe(r) { net = register_module("net", GPT(c)); }

  /// Next-token cross-entropy over the real tokens of a batch (rows of tokens, each row's count; or a token file's
  /// windows and their next tokens, volt::data::TokenLoader's batches, every token real): its sum and count.
  std::pair<torch::Tensor, torch::Tensor> loss_terms(const torch::data::Example<>& b) {
    if (b.target.dim() == 2) {
      auto logits = net->forward(b.data);
      auto sum = torch::nn::functional::cross_entropy(
          logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), b.target.reshape({-1}),
          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      return {sum, torch::scalar_tensor(static_cast<double>(b.target.numel()), sum.options())};
    }
    auto logits = net->forward(b.data.slice(1, 0, -1));
    const int64_t t = b.data.size(1) - 1;
    auto mask = torch::arange(t, b.target.options()).unsqueeze(0) < b.target.unsqueeze(1);
    auto each = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), b.data.slice(1, 1).reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    const auto m = mask.reshape({-1}).to(torch::kFloat32);
    return {(each * m).sum(), m.sum()};
  }

  torch::Tensor training_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto [sum, count] = loss_terms(b);
    const auto loss = sum / count;
    ctx.weigh_loss(count);  // the window's gradient: the mean over every real token of every batch and rank
    const auto tokens = count.item<int64_t>();
    const auto now = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(now - last).count();
    last = now;
    ctx.log("train_loss", loss, {.prog_bar = true, .batch_size = tokens});
    if (ctx.batch_idx() > 0) ctx.log("tok_per_s", static_cast<double>(tokens) * ctx.world_size() / seconds,
                                     {.prog_bar = true, .on_step = true, .on_epoch = false});
    return loss;
  }

  void validation_step(const torch::data::Example<>& b, volt::Context& ctx) {
    auto [sum, count] = loss_terms(b);
    ctx.log("val_loss", sum / count, {.prog_bar = true, .sync_dist = true, .batch_size = count.item<int64_t>()});
  }

  volt::OptimizerConfig configure_optimizers() {
    const auto defaults = torch::optim::AdamWOptions(recipe.lr).betas({0.9, 0.95});
    auto opt = std::make_shared<volt::optim::AdamW>(volt::optim::weight_decay_groups(*this, 0.1, defaults), defaults);
    const int64_t warmup = std::max<int64_t>(1, std::min(recipe.warmup, recipe.steps - 1));
    auto warm = std::make_shared<volt::optim::LinearLR>(
        *opt, volt::optim::LinearLROptions{.start_factor = 0.01, .total_iters = warmup});
    auto decay = std::make_shared<volt::optim::CosineAnnealingLR>(
        *opt, volt::optim::CosineAnnealingLROptions{.t_max = std::max<int64_t>(1, recipe.steps - warmup),
                                                    .eta_min = recipe.lr / 10.0});
    return {.optimizer = opt,
            .scheduler = std::make_shared<volt::optim::SequentialLR>(*opt, volt::optim::Schedules{warm, decay},
                                                                     std::vector<int64_t>{warmup}),
            .interval = volt::Interval::step};
  }
};
TORCH_MODULE(LanguageModel);

}  // namespace gpt
