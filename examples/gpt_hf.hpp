#pragma once
// GPT-2's Hugging Face layout for the model of gpt_model.hpp, both ways: `gpt::from_pretrained(folder)` builds a GPT
// from a folder transformers' `save_pretrained` wrote (config.json, and model.safetensors or shards with their
// index) and loads its weights; `gpt::save_pretrained(net, folder)` writes a folder `GPT2LMHeadModel.from_pretrained`
// reads. The layouts differ in names (`transformer.h.3.attn.c_attn` is `blocks.3.attn.qkv`) and in GPT-2's `Conv1D`,
// which keeps its weights as [in, out] where a Linear keeps [out, in]: volt::load_weights and volt::save_weights
// rename and transpose on the way. The head shares the token embedding in both (`tie_word_embeddings`), so
// `lm_head.weight` is neither read nor written.

#include "gpt_model.hpp"

#include <volt/config.hpp>
#include <volt/weights.hpp>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gpt {

namespace hf_layout {
/// Hugging Face's names to this model's.
inline std::vector<std::pair<std::string, std::string>> names() {
  return {{"transformer.wte.", "wte."},
          {"transformer.wpe.", "wpe."},
          {"transformer.ln_f.", "ln_f."},
          {"transformer.h.*.ln_1.", "blocks.*.ln1."},
          {"transformer.h.*.ln_2.", "blocks.*.ln2."},
          {"transformer.h.*.attn.c_attn.", "blocks.*.attn.qkv."},
          {"transformer.h.*.attn.c_proj.", "blocks.*.attn.proj."},
          {"transformer.h.*.mlp.c_fc.", "blocks.*.fc."},
          {"transformer.h.*.mlp.c_proj.", "blocks.*.fc_proj."}};
}
/// This model's names to Hugging Face's.
inline std::vector<std::pair<std::string, std::string>> names_back() {
  auto rules = names();
  for (auto& [a, b] : rules) std::swap(a, b);
  return rules;
}
[[noreturn]] inline void refuse(const std::string& folder, const std::string& why) {
  throw std::invalid_argument("gpt: " + folder + "/config.json: " + why);
}
}  // namespace hf_layout

/// The GPT a Hugging Face GPT-2 folder describes, with its weights. Refuses a config this model cannot compute alike
/// (another model type, activation or norm epsilon, an inner width other than 4x, attention scaled by layer).
inline GPT from_pretrained(const std::string& folder) {
  std::ifstream in(std::filesystem::path(folder) / "config.json");
  if (!in) hf_layout::refuse(folder, "cannot be read (save_pretrained writes it beside the weights)");
  const volt::Json c = volt::Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!c.is_object()) hf_layout::refuse(folder, "is not a JSON object");
  const auto get = [&](const char* key, auto fallback) { return c.value(key, fallback); };
  if (get("model_type", std::string()) != "gpt2") {
    hf_layout::refuse(folder,
                      "model_type is \"" + get("model_type", std::string()) + "\"; this model is GPT-2's (\"gpt2\")");
  }
  const std::string act = get("activation_function", std::string("gelu_new"));
  if (act != "gelu_new" && act != "gelu") {
    hf_layout::refuse(folder, "activation_function is \"" + act + "\"; this model computes \"gelu_new\" or \"gelu\"");
  }
  const int64_t width = get("n_embd", int64_t{768});
  if (get("layer_norm_epsilon", 1e-5) != 1e-5 || (c.contains("n_inner") && !c["n_inner"].is_null() &&
                                                   c["n_inner"].get<int64_t>() != 4 * width) ||
      get("scale_attn_by_inverse_layer_idx", false) || get("reorder_and_upcast_attn", false) ||
      !get("scale_attn_weights", true) || !get("tie_word_embeddings", true)) {
    hf_layout::refuse(folder, "asks for a variant of GPT-2 this model does not compute (layer_norm_epsilon other than "
                              "1e-5, n_inner other than 4 n_embd, scale_attn_by_inverse_layer_idx, "
                              "reorder_and_upcast_attn, no scale_attn_weights, or untied embeddings)");
  }
  GPT net(Config{.vocab = get("vocab_size", int64_t{50257}), .context = get("n_positions", int64_t{1024}),
                 .layers = get("n_layer", int64_t{12}), .heads = get("n_head", int64_t{12}), .width = width,
                 .dropout = 0.0, .gelu_tanh = act == "gelu_new"});
  volt::load_weights(*net, folder,
                     {.rename = hf_layout::names(),
                      .skip = {"lm_head.", "transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias"},
                      .transforms = {{"transformer.h.*.*.c_*.weight", volt::transform::transpose(),
                                      "Conv1D's [in, out] to Linear's [out, in]"}},
                      .keep = {"blocks.*.attn.mask"}});
  return net;
}

/// Writes `net` as a Hugging Face GPT-2 folder: config.json and its weights (shards of at most `max_shard_bytes`, when
/// given, with their index).
inline void save_pretrained(const GPT& net, const std::string& folder, int64_t max_shard_bytes = 0) {
  const Config& c = net->config;
  const auto transpose = [](const char* name) {
    return volt::WeightTransform{name, volt::transform::transpose(), "Linear's [out, in] to Conv1D's [in, out]"};
  };
  volt::save_weights(*net, folder,
                     {.rename = hf_layout::names_back(),
                      .transforms = {transpose("blocks.*.attn.qkv.weight"), transpose("blocks.*.attn.proj.weight"),
                                     transpose("blocks.*.fc.weight"), transpose("blocks.*.fc_proj.weight")},
                      .skip = {"blocks.*.attn.mask"},
                      .max_shard_bytes = max_shard_bytes});
  volt::Json config = {{"architectures", {"GPT2LMHeadModel"}},
                       {"model_type", "gpt2"},
                       {"vocab_size", c.vocab},
                       {"n_positions", c.context},
                       {"n_embd", c.width},
                       {"n_layer", c.layers},
                       {"n_head", c.heads},
                       {"n_inner", nullptr},
                       {"activation_function", c.gelu_tanh ? "gelu_new" : "gelu"},
                       {"layer_norm_epsilon", 1e-5},
                       {"resid_pdrop", c.dropout},
                       {"embd_pdrop", c.dropout},
                       {"attn_pdrop", c.dropout},
                       {"scale_attn_weights", true},
                       {"tie_word_embeddings", true},
                       {"bos_token_id", nullptr},
                       {"eos_token_id", nullptr}};
  const std::string text = config.dump(2) + "\n";
  volt::checkpoint::write_atomic((std::filesystem::path(folder) / "config.json").string(), text.data(), text.size());
}

}  // namespace gpt
