"""Checks a short run of the GPT example (examples/gpt.cpp): its validation loss fell (printed before and after
training), it printed a sample of generated text, and its TensorBoard file, read with Python's tensorboard, holds the
training and validation losses, the training loss lower at the end than at the start.
Usage: gpt_check.py <the example's output> <its trainer.default_root_dir>. Prints "gpt ok", or "MISMATCH: ..." and
exits 1."""
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
