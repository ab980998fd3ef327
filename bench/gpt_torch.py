"""The GPT benchmark's PyTorch side (bench/gpt.sh runs it beside build/bench/gpt_bench): the same decoder-only
transformer (token and position embeddings, pre-norm blocks of causal self-attention and an MLP, the head tied to the
token embedding), written here from its description, started from the weights volt made (`gpt_bench export`), trained
on the same windows of Shakespeare's plays in the same order with the same recipe (AdamW betas 0.9/0.95, weight decay
0.1 on matrices only, a linear warm-up from 1% over 10 steps then a cosine to a tenth, the loss a mean over the real
tokens), dropout 0. Prints one JSON line per run: tokens/s (after 5 steps), the validation loss over the last 8
batches' windows, the peak of resident memory and its rise during training.

    python gpt_torch.py --impl eager|checkpoint|lightning --init FILE --text DIR [--steps N] [--batch N]
                        [--layers N] [--width N] [--heads N] [--context N]
"""
import argparse
import json
import math
import os
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


class Attention(nn.Module):
    def __init__(self, width, heads, context):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.ones(context, context).tril().view(1, 1, context, context))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, width, heads, context):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, context)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, context, layers, heads, width, recompute):
        super().__init__()
        self.recompute = recompute
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, context) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute and self.training else block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def read_windows(folder, context):
    """Every .txt file in name order, cut every `context` characters into windows of context + 1 tokens that do not
    cross files, the last window of a file padded with token 0; each row's count of positions with a next token."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".txt"))
    texts = [open(os.path.join(folder, n), "rb").read().decode("latin-1") for n in names]
    chars = sorted(set("".join(texts)))
    ids = {c: i for i, c in enumerate(chars)}
    rows, lengths = [], []
    for t in texts:
        for start in range(0, len(t) - 1, context):
            n = min(context, len(t) - 1 - start)
            piece = [ids[c] for c in t[start:start + n + 1]]
            rows.append(piece + [0] * (context + 1 - len(piece)))
            lengths.append(n)
    return torch.tensor(rows), torch.tensor(lengths), len(chars)


def masked_loss(model, rows, lengths):
    logits = model(rows[:, :-1])
    mask = (torch.arange(rows.shape[1] - 1).unsqueeze(0) < lengths.unsqueeze(1)).float().reshape(-1)
    each = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1), reduction="none")
    return (each * mask).sum() / mask.sum()


def optimizer_and_schedule(model, steps, lr=3e-3, warmup=10):
    warmup = max(1, min(warmup, steps - 1))  # as the C++ recipe (gpt::LanguageModel) bounds it for short runs
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps - warmup), eta_min=lr / 10)
    return opt, torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[warmup])


def status_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0
    return -1.0


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:  # the peak of resident memory (VmHWM) starts again from here
        f.write("5")


class Clock:
    """When each training step ended; resident memory at the start, and after the first step (the weights, their
    gradients and the optimizer's state then exist, so what later steps add above it is their activations)."""

    def __init__(self):
        self.ends, self.rss_before, self.peak_first = [], status_mib("VmRSS"), 0.0
        reset_peak()

    def step_end(self):
        self.ends.append(time.perf_counter())
        if len(self.ends) == 1:
            self.peak_first, self.rss_after_first = status_mib("VmHWM"), status_mib("VmRSS")
            reset_peak()


def train_eager(model, batches, steps, clock):
    opt, sched = optimizer_and_schedule(model, steps)
    for rows, lengths in batches:
        loss = masked_loss(model, rows, lengths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        clock.step_end()


def train_lightning(model, batches, steps, clock):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, _):
            return masked_loss(self.model, *batch)

        def configure_optimizers(self):
            opt, sched = optimizer_and_schedule(self.model, steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_batch_end(self, *_):
            clock.step_end()

    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    rows = torch.cat([r for r, _ in batches])
    lengths = torch.cat([l for _, l in batches])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows, lengths), batch_size=len(batches[0][0]))
    trainer.fit(Module(), train_dataloaders=loader)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["eager", "checkpoint", "lightning"])
    ap.add_argument("--init", required=True)
    ap.add_argument("--text", required=True)
    for name, default in [("steps", 60), ("batch", 32), ("layers", 4), ("width", 128), ("heads", 4), ("context", 64)]:
        ap.add_argument("--" + name, type=int, default=default)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    rows, lengths, vocab = read_windows(a.text, a.context)
    model = GPT(vocab, a.context, a.layers, a.heads, a.width, recompute=a.impl == "checkpoint")
    init = torch.load(a.init, weights_only=False)  # the file gpt_bench just wrote (LibTorch's typed dict)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
    n_train, n_val = a.steps * a.batch, 8 * a.batch
    batches = [(rows[i:i + a.batch], lengths[i:i + a.batch]) for i in range(0, n_train, a.batch)]
    model.train()
    clock = Clock()
    (train_lightning if a.impl == "lightning" else train_eager)(model, batches, a.steps, clock)
    ends, step_peak = clock.ends, status_mib("VmHWM")
    peak = max(clock.peak_first, step_peak)
    model.eval()
    with torch.no_grad():
        val_rows, val_lengths = rows[-n_val:], lengths[-n_val:]
        total, count = 0.0, 0.0
        for i in range(0, n_val, a.batch):
            r, l = val_rows[i:i + a.batch], val_lengths[i:i + a.batch]
            tokens = float(l.sum())
            total += float(masked_loss(model, r, l)) * tokens
            count += tokens
    warm = min(5, a.steps - 2)
    tokens = (a.steps - 1 - warm) * a.batch * a.context
    print(json.dumps({"bench": "gpt", "impl": "torch_" + a.impl, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "layers": a.layers, "width": a.width, "context": a.context,
                      "batch": a.batch, "steps": a.steps, "checkpointing": 1 if a.impl == "checkpoint" else 0,
                      "tokens_per_s": tokens / (ends[-1] - ends[warm]), "val_loss": total / count,
                      "peak_rss_mib": peak, "train_rss_rise_mib": peak - clock.rss_before,
                      "step_rss_rise_mib": step_peak - clock.rss_after_first}), flush=True)


if __name__ == "__main__":
    main()
