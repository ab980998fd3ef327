"""Reads the safetensors files volt wrote (test/checkpoint.cpp, "[.safetensors_export]") with Python's safetensors
and torch, and writes files for volt to read back ("[.safetensors_import]"). Usage: safetensors_check.py <dir>.

- every dtype's tensor holds arange(6) as [2, 3] converted (bool: odd elements; complex: arange - arange*i), computed
  here with torch; the scalar, empty and transposed tensors hold what the C++ side put there;
- Python's safetensors writing the same tensors with the same metadata gives volt's file byte for byte;
- the network's weights load into a PyTorch network of the same shape (strict), whose output on volt's input equals
  volt's output;
- each checkpoint ModelCheckpoint wrote with save_safetensors has its weights file beside it, the checkpoint's
  state_dict (read with torch.load) tensor for tensor;
- the network saved as a Hugging Face folder of shards reads through its index to the same tensors;
- then this side's own files: every dtype this torch has, with metadata, and another network's weights (also as a
  folder of three shards and an index, as save_pretrained writes), input and output. Prints MISMATCH on any difference."""
import json
import os
import sys

import torch
from torch import nn

from torch_load_check import load as load_checkpoint  # torch.load as a careful user calls it (weights_only)

try:
    from safetensors.torch import load_file, save_file
except ImportError:
    print("Python's safetensors is not installed for", sys.executable, "(scripts/test.sh installs it). Skipped.")
    sys.exit(77)

DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
          "F64": torch.float64, "C64": torch.complex64}
for name, attr in [("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                   ("F8_E5M2", "float8_e5m2")]:
    if hasattr(torch, attr) and (name[0] != "U" or hasattr(torch, "uint64")):
        DTYPES[name] = getattr(torch, attr)


def pattern(dtype):
    a = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    if dtype == torch.bool:
        return (a % 2).to(torch.bool)
    if dtype == torch.complex64:
        return torch.complex(a.float(), -a.float())
    return a.to(dtype)


def same(a, b):
    """Same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                         b.contiguous().view(-1).view(torch.uint8))


class TunedNet(nn.Module):
    """test/checkpoint.cpp's TunedNet: a backbone (linear, batch norm, ReLU) and a head."""

    def __init__(self, classes=3):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def check_volt_files(folder):
    bad = []
    tensors = load_file(f"{folder}/all.safetensors")
    for name, dtype in DTYPES.items():
        if name in tensors and not same(tensors[name], pattern(dtype)):
            bad.append(f"{name}: {tensors[name]} vs {pattern(dtype)}")
    missing = sorted(set(DTYPES) - set(tensors))
    if missing:
        bad.append(f"volt wrote no tensor for {missing}")
    if not same(tensors["scalar"], torch.tensor(3.5, dtype=torch.float64)):
        bad.append(f"scalar: {tensors['scalar']}")
    if tensors["empty"].shape != (0, 4) or tensors["empty"].dtype != torch.float16:
        bad.append(f"empty: {tensors['empty'].shape} {tensors['empty'].dtype}")
    if not same(tensors["strided"], torch.arange(12, dtype=torch.float32).reshape(3, 4).t().contiguous()):
        bad.append(f"strided: {tensors['strided']}")
    mine = f"{folder}/all_by_python.safetensors"
    save_file({k: v for k, v in tensors.items() if k in DTYPES or k in ("scalar", "empty", "strided")}, mine,
              metadata={"format": "pt"})
    if open(mine, "rb").read() != open(f"{folder}/all.safetensors", "rb").read():
        bad.append("Python's safetensors writes other bytes for the same tensors and metadata")
    net = TunedNet()
    net.load_state_dict(load_file(f"{folder}/net.safetensors"), strict=True)
    net.eval()
    io = load_file(f"{folder}/io.safetensors")
    with torch.no_grad():
        out = net(io["input"])
    if not torch.allclose(out, io["output"], atol=1e-6, rtol=1e-5):
        bad.append(f"the network's output differs by {(out - io['output']).abs().max().item()}")
    # The same network saved as a Hugging Face folder of shards (save_weights, max_shard_bytes = 100): read through its
    # index as transformers reads one, the same tensors.
    sharded = load_sharded(f"{folder}/net_sharded")
    whole = load_file(f"{folder}/net.safetensors")
    if sorted(sharded) != sorted(whole) or any(not same(sharded[k], whole[k]) for k in whole):
        bad.append("the sharded folder's tensors are not net.safetensors'")
    index = json.load(open(f"{folder}/net_sharded/model.safetensors.index.json"))
    total = sum(t.numel() * t.element_size() for t in whole.values())
    if index["metadata"]["total_size"] != total:
        bad.append(f"the index's total_size is {index['metadata']['total_size']}, the tensors hold {total} bytes")
    return bad


def load_sharded(folder):
    """A folder's tensors through model.safetensors.index.json, as transformers' load_sharded_checkpoint reads them."""
    index = json.load(open(f"{folder}/model.safetensors.index.json"))
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(f"{folder}/{shard}"))
    if sorted(out) != sorted(index["weight_map"]):
        raise SystemExit(f"MISMATCH: the shards of {folder} hold {sorted(out)}, the index lists {sorted(index['weight_map'])}")
    return out


def save_sharded(state, folder, shards):
    """`state` in `shards` files and an index, as save_pretrained lays them out."""
    os.makedirs(folder, exist_ok=True)
    names = list(state)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n].contiguous() for n in names[k::shards]}
        save_file(part, f"{folder}/{file}", metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, open(f"{folder}/model.safetensors.index.json", "w"))


def check_beside_checkpoints(folder):
    """ModelCheckpoint's save_safetensors: each checkpoint has its weights file beside it, holding the checkpoint's
    state_dict (read with torch.load) tensor for tensor."""
    bad = []
    files = os.listdir(f"{folder}/ckpt")
    ckpts = sorted(f[:-5] for f in files if f.endswith(".ckpt"))
    beside = sorted(f[:-12] for f in files if f.endswith(".safetensors"))
    if ckpts != beside or len(ckpts) < 5:
        bad.append(f"checkpoints {ckpts} and safetensors files {beside}")
    for stem in sorted(set(ckpts) & set(beside)):
        state = load_checkpoint(f"{folder}/ckpt/{stem}.ckpt")["state_dict"]
        weights = load_file(f"{folder}/ckpt/{stem}.safetensors")
        if sorted(state) != sorted(weights):
            bad.append(f"{stem}: names {sorted(weights)} vs the checkpoint's {sorted(state)}")
        for name in sorted(set(state) & set(weights)):
            if not same(weights[name], state[name]):
                bad.append(f"{stem}: {name} differs from the checkpoint's")
    return bad, len(ckpts)


def write_python_files(folder):
    save_file({name: pattern(dtype) for name, dtype in DTYPES.items()}, f"{folder}/from_python.safetensors",
              metadata={"written_by": "python", "dtypes": " ".join(sorted(DTYPES))})
    torch.manual_seed(7)
    net = TunedNet()
    net.train()
    with torch.no_grad():
        net(torch.randn(16, 4) * 3 + 1)  # running statistics that are not the initial ones
    net.eval()
    x = torch.randn(5, 4)
    with torch.no_grad():
        y = net(x)
    save_file(net.state_dict(), f"{folder}/py_net.safetensors")
    save_sharded(net.state_dict(), f"{folder}/py_net_sharded", 3)
    save_file({"input": x, "output": y}, f"{folder}/py_io.safetensors")


def main(folder):
    bad = check_volt_files(folder)
    beside_bad, pairs = check_beside_checkpoints(folder)
    bad += beside_bad
    write_python_files(folder)
    for b in bad:
        print("MISMATCH:", b)
    print(f"torch {torch.__version__}: {len(DTYPES)} dtypes read and written, {pairs} checkpoints with their "
          f"safetensors beside them; {len(bad)} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
