"""GPT-2 weights between volt's GPT (examples/gpt_model.hpp, examples/gpt_hf.hpp) and Hugging Face's transformers.

  gpt2_check.py write DIR     transformers builds a GPT-2 of random weights from a config (offline), saves it with
                              save_pretrained twice (one model.safetensors, and shards of at most 20 KB with their
                              index), and its logits on a batch of tokens
  gpt2_check.py compare DIR   after volt ([.gpt2] in test/transformer.cpp) loaded both folders, compared its logits,
                              and exported a GPT of its own: GPT2LMHeadModel.from_pretrained loads volt's folders (one
                              file, and shards) and its logits equal volt's

Logits are compared within 1e-4 absolute (float32 on the CPU: the two sides add in other orders). Prints "gpt2 ok: ..." or
"MISMATCH: ..." and exits 1; exits 77 where transformers is not installed (it needs torch 2: the 2.11 lane)."""
import os
import sys

import torch

try:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"transformers is not installed for {sys.executable} ({e}; scripts/install-torch.sh puts it in the 2.11 "
          "lane's environment). Skipped.")
    sys.exit(77)

TOLERANCE = 1e-4


def fail(msg):
    print("MISMATCH: " + msg)
    sys.exit(1)


def write(d):
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(3)
    config = GPT2Config(n_layer=3, n_head=4, n_embd=32, vocab_size=101, n_positions=24, bos_token_id=None,
                        eos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and norms away from their initial zeros and ones, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(f"{d}/hf")
    model.save_pretrained(f"{d}/hf_sharded", max_shard_size="20KB")
    shards = [f for f in os.listdir(f"{d}/hf_sharded") if f.endswith(".safetensors")]
    if len(shards) < 3:
        fail(f"save_pretrained wrote {len(shards)} shards; the test wants several")
    tokens = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(tokens).logits
    save_file({"tokens": tokens, "logits": logits.contiguous()}, f"{d}/hf_io.safetensors")


def compare(d):
    io = load_file(f"{d}/volt_io.safetensors")
    worst = 0.0
    for folder in ("volt", "volt_sharded"):
        model = GPT2LMHeadModel.from_pretrained(f"{d}/{folder}").eval()
        with torch.no_grad():
            logits = model(io["tokens"]).logits
        diff = (logits - io["logits"]).abs().max().item()
        worst = max(worst, diff)
        if diff > TOLERANCE:
            fail(f"transformers' logits from volt's {folder} folder differ from volt's by {diff}")
    print(f"gpt2 ok: transformers {transformers.__version__} loads volt's GPT (one file and shards), logits within "
          f"{worst:.2e} of volt's")


if __name__ == "__main__":
    {"write": write, "compare": compare}[sys.argv[1]](sys.argv[2])
