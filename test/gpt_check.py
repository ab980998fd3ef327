"""Checks a short run of the GPT example (examples/gpt.cpp): its validation loss fell (printed before and after
training), it printed a sample of generated text, and its TensorBoard file, read with Python's tensorboard, holds the
training and validation losses, the training loss lower at the end than at the start.
Usage: gpt_check.py <the example's output> <its trainer.default_root_dir>. Prints "gpt ok", or "MISMATCH: ..." and
exits 1. `gpt_check.py prepare <text> <dir>` writes the text as nanoGPT's token files (train.bin, val.bin);
`gpt_check.py tokens <output> <root dir> <that dir>` checks a run on them, its vocabulary the text's too."""
import glob
import re
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def fail(message):
    print("MISMATCH: " + message)
    sys.exit(1)


def main(output_file, out_dir):
    text = open(output_file).read()
    m = re.search(r"validation loss ([0-9.]+) -> ([0-9.]+)", text)
    if not m:
        fail("no 'validation loss X -> Y' line in the output")
    before, after = float(m.group(1)), float(m.group(2))
    if not after < before - 0.3:
        fail(f"the validation loss did not fall: {before} -> {after}")
    sample = re.search(r"---- sample ----\n(.*)\n---- end ----", text, re.S)
    if not sample or len(sample.group(1)) < 100:
        fail("no sample of generated text")
    events = sorted(glob.glob(f"{out_dir}/volt_logs/version_*/events.out.tfevents.*"))
    if not events:
        fail(f"no TensorBoard file under {out_dir}/volt_logs")
    acc = EventAccumulator(events[-1])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train_loss", "val_loss", "lr-AdamW/pg1"):
        if tag not in tags:
            fail(f"TensorBoard has no {tag} (it has {sorted(tags)})")
    train = [e.value for e in acc.Scalars("train_loss")]
    if not train[-1] < train[0] - 0.3:
        fail(f"the logged training loss did not fall: {train[0]} -> {train[-1]}")
    print(f"gpt ok: validation loss {before:.3f} -> {after:.3f}, training loss {train[0]:.3f} -> {train[-1]:.3f} "
          f"({len(train)} points)")


def prepare(text_dir, out_dir):
    """Token files as nanoGPT's data/shakespeare_char/prepare.py writes them: the sorted characters of the text are its
    vocabulary, the first 90% of the ids train.bin and the rest val.bin, uint16; the vocabulary's size in meta.txt."""
    import os

    import numpy as np

    files = [text_dir] if os.path.isfile(text_dir) else sorted(
        os.path.join(text_dir, f) for f in os.listdir(text_dir) if f.endswith(".txt"))
    data = "".join(open(f, encoding="latin-1").read() for f in files)
    chars = sorted(set(data))
    ids = np.searchsorted(np.array([ord(c) for c in chars]), np.frombuffer(data.encode("latin-1"), dtype=np.uint8))
    ids = ids.astype(np.uint16)
    n = int(0.9 * len(ids))
    os.makedirs(out_dir, exist_ok=True)
    ids[:n].tofile(os.path.join(out_dir, "train.bin"))
    ids[n:].tofile(os.path.join(out_dir, "val.bin"))
    open(os.path.join(out_dir, "meta.txt"), "w").write(str(len(chars)))


def tokens(output_file, out_dir, tokens_dir):
    """main's checks, and the vocabulary the example found in the token files is the text's."""
    expected = int(open(f"{tokens_dir}/meta.txt").read())
    m = re.search(r"vocabulary (\d+)", open(output_file).read())
    if not m or int(m.group(1)) != expected:
        fail(f"the example's vocabulary is {m.group(1) if m else 'not printed'}, the text has {expected} characters")
    main(output_file, out_dir)


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "tokens":
        tokens(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main(sys.argv[1], sys.argv[2])
