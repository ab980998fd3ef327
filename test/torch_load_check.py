"""Reads a volt checkpoint of the quick-start net with torch.load and checks that the same network built in
Python gives the C++ model's outputs. Usage: torch_load_check.py <dir written by `resume export`>."""
import sys

import torch
from torch import nn


class Net(nn.Module):  # examples/quickstart_net.hpp
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        x = self.drop(torch.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def load(path):
    """torch.load as a careful user on PyTorch >= 2.6 calls it: weights_only (the default there), allowing the
    builders LibTorch's pickler writes for typed dicts and lists (torch.jit._pickle: they only rebuild a list or
    restore a type annotation)."""
    if hasattr(torch.serialization, "safe_globals"):
        from torch.jit import _pickle
        builders = [_pickle.restore_type_tag, _pickle.build_tensorlist, _pickle.build_intlist,
                    _pickle.build_doublelist, _pickle.build_boollist]
        with torch.serialization.safe_globals(builders):
            return torch.load(path, weights_only=True)
    return torch.load(path)


def main(folder):
    print("torch", torch.__version__)
    ckpt = load(f"{folder}/model.ckpt")
    io = load(f"{folder}/io.pt")
    print("checkpoint keys:", sorted(ckpt))
    print("format", ckpt["format"], ckpt["format_version"], "volt", ckpt["volt_version"],
          "epoch", ckpt["loops"]["epoch"], "global_step", ckpt["loops"]["global_step"])
    net = Net()
    net.load_state_dict(ckpt["state_dict"])  # strict: every name and shape must match
    net.eval()
    with torch.no_grad():
        out = net(io["input"])
    diff = (out - io["output"]).abs().max().item()
    print(f"max abs difference between the Python and C++ outputs: {diff:.3g}")
    if diff > 1e-5:
        print("MISMATCH")
        return 1
    print("outputs match")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
