"""Token files (volt::data::TokenFile, TokenLoader) against NumPy's reading of them.

  tokens_check.py write DIR     NumPy writes token files of every type volt reads (a raw uint16 .bin as nanoGPT's
                                prepare.py writes, and .npy files of uint8, uint16, int32, uint32, int64)
  tokens_check.py compare DIR   reads what volt's loader produced from them ([.tokens_export] in test/data.cpp) and checks
                                every window against NumPy's reading of the file

Every file holds base + a permutation of 0..N-1, so a window's first id says where in the file it starts. Prints
"tokens ok: ..." or "MISMATCH: ..." and exits 1."""
import os
import sys

import numpy as np

BLOCK = 16
BATCH = 4
RANDOM_PER_EPOCH = 40
# name: (dtype, N, base)
FILES = {
    "u16.bin": (np.uint16, 5000, 7),
    "u8.npy": (np.uint8, 256, 0),
    "u16.npy": (np.uint16, 5000, 60000 - 5000),
    "i32.npy": (np.int32, 3000, 2**30),
    "u32.npy": (np.uint32, 3000, 2**31 + 5),
    "i64.npy": (np.int64, 3000, 2**40),
}


def fail(msg):
    print("MISMATCH: " + msg)
    sys.exit(1)


def contents(name):
    dtype, n, base = FILES[name]
    perm = np.random.default_rng(len(name) * 7919 + n).permutation(n)
    return (perm.astype(np.int64) + base).astype(dtype)


def write(d):
    os.makedirs(d, exist_ok=True)
    for name in FILES:
        a = contents(name)
        if name.endswith(".bin"):
            a.tofile(os.path.join(d, name))
        else:
            np.save(os.path.join(d, name), a)


def windows_of(path):
    raw = np.fromfile(path, dtype=np.int64)
    if raw.size % (2 * BLOCK):
        fail(f"{path}: {raw.size} ids is not a whole number of (x, y) windows of {BLOCK}")
    return raw.reshape(-1, 2, BLOCK)


def offsets(name, data, path):
    """Each window's start in the file, every window checked against NumPy's slice there."""
    _, n, base = FILES[name]
    inverse = np.empty(n, dtype=np.int64)
    inverse[data.astype(np.int64) - base] = np.arange(n)
    starts = []
    for k, (x, y) in enumerate(windows_of(path)):
        o = int(inverse[x[0] - base])
        if o + BLOCK + 1 > n:
            fail(f"{path}: window {k} starts at {o}, too near the end of {n} tokens")
        if not np.array_equal(x, data[o:o + BLOCK].astype(np.int64)):
            fail(f"{path}: window {k}'s x differs from the file's tokens {o}..{o + BLOCK - 1}")
        if not np.array_equal(y, data[o + 1:o + BLOCK + 1].astype(np.int64)):
            fail(f"{path}: window {k}'s y is not its x shifted by one token")
        starts.append(o)
    return np.array(starts)


def compare(d):
    checked = 0
    for name in FILES:
        _, n, _ = FILES[name]
        path = os.path.join(d, name)
        data = np.fromfile(path, dtype=np.uint16) if name.endswith(".bin") else np.load(path, mmap_mode="r")
        tiled = (n - 1) // BLOCK
        t = offsets(name, data, path + ".tiled.i64")
        if t.size != 2 * tiled:
            fail(f"{name}: {t.size} tiled windows in two epochs, expected {2 * tiled}")
        for e in range(2):
            if sorted(t[e * tiled:(e + 1) * tiled]) != [BLOCK * i for i in range(tiled)]:
                fail(f"{name}: epoch {e} did not hold every tiled window once")
        if tiled > 2 and np.array_equal(t[:tiled], t[tiled:]):
            fail(f"{name}: the two shuffled epochs have the same order")
        r = offsets(name, data, path + ".random.i64")
        if r.size != 2 * RANDOM_PER_EPOCH or r.max() >= n - BLOCK or np.all(r % BLOCK == 0):
            fail(f"{name}: random windows {r[:8]}... are not {2 * RANDOM_PER_EPOCH} draws in [0, {n - BLOCK})")
        ranks = [set(offsets(name, data, path + f".rank{k}.i64").tolist()) for k in range(2)]
        per_rank = (tiled // 2) // BATCH * BATCH  # drop_last: the epoch trimmed to 2 ranks, each rank's last part batch dropped
        if ranks[0] & ranks[1]:
            fail(f"{name}: ranks 0 and 1 share windows {sorted(ranks[0] & ranks[1])[:5]}")
        if [len(s) for s in ranks] != [per_rank, per_rank]:
            fail(f"{name}: ranks hold {[len(s) for s in ranks]} windows, expected {per_rank} each")
        checked += t.size + r.size + 2 * per_rank
    print(f"tokens ok: {len(FILES)} files, {checked} windows equal NumPy's slices; tiled epochs whole, ranks disjoint")


if __name__ == "__main__":
    {"write": write, "compare": compare}[sys.argv[1]](sys.argv[2])
