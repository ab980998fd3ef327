"""Trains, in PyTorch, what the C++ case "the recipe's fit written for PyTorch to repeat" (test/transformer.cpp)
trained with volt: the same network from the same initial weights on the same batches, AdamW with two parameter
groups (weight decay 0.1 on matrices, none on vectors) and SequentialLR(LinearLR, CosineAnnealingLR) stepped after
each optimizer step; then compares the rates of every step and the final weights. Usage: recipe_check.py <dir>."""
import sys

import torch
from torch import nn



def load(path):
    """torch.load of a file LibTorch's torch::pickle_save wrote (transformer.cpp: not a volt checkpoint, so with
    LibTorch's type tags): on PyTorch 2.6 and later weights_only, allowing the builders those tags are
    (torch.jit._pickle: they rebuild a list or restore a type annotation); the full unpickler before."""
    if hasattr(torch.serialization, "safe_globals"):
        from torch.jit import _pickle
        builders = [_pickle.restore_type_tag, _pickle.build_tensorlist, _pickle.build_intlist,
                    _pickle.build_doublelist, _pickle.build_boollist]
        with torch.serialization.safe_globals(builders):
            return torch.load(path, weights_only=True)
    return torch.load(path)


class RecipeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 16)
        self.norm = nn.LayerNorm(16)
        self.lin2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.lin2(torch.tanh(self.norm(self.lin1(x))))


def main(folder):
    init = load(f"{folder}/init.pt")
    volt = load(f"{folder}/volt.pt")
    net = RecipeNet()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(init["param." + name])
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=8)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40, eta_min=1e-4)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[8])
    x, y = init["data.x"], init["data.y"]
    rates = []
    for epoch in range(5):
        for i in range(0, 80, 4):
            rates.append([g["lr"] for g in opt.param_groups])
            loss = (net(x[i:i + 4]) - y[i:i + 4]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    rates = torch.tensor(rates, dtype=torch.float64)
    rate_diff = (rates - volt["rates"]).abs().max().item()
    weight_diff = max((p.detach() - volt["param." + n]).abs().max().item() for n, p in net.named_parameters())
    print(f"torch {torch.__version__}: 100 steps; max |rate difference| {rate_diff:.3g}, "
          f"max |weight difference| {weight_diff:.3g}")
    ok = rate_diff <= 1e-12 and weight_diff <= 1e-6
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
