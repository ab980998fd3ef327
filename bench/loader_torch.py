"""PyTorch's DataLoader reading the PNG folder that `bench/loader throughput` writes (root/class*/N.png), with
num_workers 0, 1, 2 and 4, batch 64, rounds interleaved; prints one JSON line per worker count (median batches/s).
Decodes with Pillow into the same float tensors volt's ImageFolder gives ([1, 28, 28] in [0, 1]).

    python3 bench/loader_torch.py DIR [--rounds 3]

Run it on the same machine right after `build/bench/loader throughput --dir DIR` and compare batches/s. Needs torch,
numpy and Pillow (Debian: python3-torch, python3-numpy, python3-pil).
"""
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from PIL import Image
from torch_blas import blas_name


class Pngs(torch.utils.data.Dataset):
    def __init__(self, root):
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.samples = []
        for label, c in enumerate(classes):
            folder = os.path.join(root, c)
            for name in sorted(f for f in os.listdir(folder) if f.endswith(".png")):
                self.samples.append((os.path.join(folder, name), label))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        with Image.open(path) as img:
            pixels = np.asarray(img.convert("L"), dtype=np.uint8)
        return torch.from_numpy(pixels.copy()).float().div_(255.0).unsqueeze(0), label


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    torch.set_num_threads(1)
    data = Pngs(root)
    batches = (len(data) + 63) // 64
    seconds = {w: [] for w in (0, 1, 2, 4)}
    for _ in range(rounds):
        for w in seconds:
            loader = torch.utils.data.DataLoader(data, batch_size=64, num_workers=w)
            start = time.perf_counter()
            n = sum(x.shape[0] for x, _ in loader)
            seconds[w].append(time.perf_counter() - start)
            assert n == len(data), (n, len(data))
    for w, s in seconds.items():
        print(json.dumps({"bench": "loader_throughput_pytorch", "files": len(data), "num_workers": w,
                          "pytorch_batches_per_s": batches / statistics.median(s), "rounds": rounds,
                          "torch": torch.__version__, "blas": blas_name()}))


if __name__ == "__main__":
    main()
