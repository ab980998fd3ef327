"""Reads volt checkpoints with torch.load as a Python user does (weights_only, PyTorch's default since 2.6): the
quick-start net built in Python gives the C++ model's outputs, and Python's AdamW, Adam and SGD loaded from a
checkpoint's optimizer state step to the weights of volt's own next step (float64, within 1e-12).
Usage: torch_load_check.py <dir written by `resume export`>..."""
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


def load(path, weights_only_file=False):
    """torch.load as a Lightning user calls it: plainly on PyTorch 2.6 and later, whose default is weights_only=True
    (tensors and plain containers only). PyTorch 1.13's weights-only unpickler reads no float at all (it has no
    BINFLOAT: even `torch.save({"a": 1.5})` of 1.13 itself fails it), so there a weights-only checkpoint (no float in
    it) is read with weights_only=True and one holding floats (learning rates, metric sums) with the full unpickler."""
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 6):
        return torch.load(path)
    if weights_only_file:
        return torch.load(path, weights_only=True)
    return torch.load(path, weights_only=False)


class OptNet(nn.Module):  # test/resume.cpp's OptNetImpl
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def optimizers(folder):
    """Python's AdamW, Adam and SGD take the state volt wrote and step once: the weights of volt's own next step."""
    io = load(f"{folder}/opt_io.pt", weights_only_file=True)
    failed = 0
    for kind, make in (("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)):
        ckpt = load(f"{folder}/opt_{kind}.ckpt")
        net = OptNet().double()
        net.load_state_dict(ckpt["state_dict"])
        saved = ckpt["optimizer_states"][0]
        opt = make(net.parameters(), lr=1.0)  # every option comes from the file
        opt.load_state_dict(saved)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(io["input"]), io["target"]).backward()
        opt.step()
        want = load(f"{folder}/opt_{kind}_next.ckpt", weights_only_file=True)["state_dict"]
        diff = max((p - want[n]).abs().max().item() for n, p in net.state_dict().items())
        groups = saved["param_groups"][0]
        print(f"{make.__name__}: state of {len(saved['state'])} parameters, lr {groups['lr']}, one step from it: "
              f"max |weights - volt's next step| = {diff:.3g}")
        if not diff <= 1e-12:
            print(f"MISMATCH: {make.__name__}'s step from volt's state is {diff:.3g} off volt's")
            failed += 1
    return failed


def main(folder):
    """The quick start's checks where `folder` has its files (`resume export` writes them; the committed folders of
    each LibTorch line, test/data/torch_load/, hold the optimizers' only), then the optimizers'."""
    import os
    print("torch", torch.__version__, "reading", folder)
    if not os.path.exists(f"{folder}/model.ckpt"):
        return 1 if optimizers(folder) else 0
    ckpt = load(f"{folder}/model.ckpt")
    io = load(f"{folder}/io.pt", weights_only_file=True)
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
    weights = load(f"{folder}/weights.ckpt", weights_only_file=True)  # weights_only=True on every version
    if sorted(weights["state_dict"]) != sorted(ckpt["state_dict"]) or "optimizer_states" in weights:
        print("MISMATCH: the weights-only checkpoint holds other entries")
        return 1
    return 1 if optimizers(folder) else 0


if __name__ == "__main__":
    sys.exit(max(main(folder) for folder in sys.argv[1:]))
